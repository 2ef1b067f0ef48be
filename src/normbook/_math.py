"""The norms in plain, differentiable torch ops, for production rather than for reading.

:mod:`normbook.reference` is the derivation written with the book's einsum strings: the oracle,
exact in float64. In fp32 on a CPU an einsum reduction is a long sequential chain whose error
grows with D; this module computes the same equations with torch's vectorised reductions
(``sum``/``mean``, error growing like log D) and with a scale-safe variance, and it is what
the CPU path computes with. Every function is made of differentiable torch ops, so it also
serves double backward (when autograd builds a graph of the backward), the forward-mode
tangent (jvp) and batching (vmap) of both paths.

Shapes: x, dy (..., D); weight, bias (D,) or None; mean, rstd (..., 1).
"""

from __future__ import annotations

import torch


def _rsqrt_ms(xc: torch.Tensor, eps) -> torch.Tensor:
    """1 / sqrt(mean(xc^2) + eps), (..., 1), finite where mean(xc^2) alone would overflow.

    fp32 values past about 1e19 square to inf, and the plain formula would then give rstd = 0
    and an output of zeros. Such rows are divided by their largest |value| a first (|u| <= 1,
    nothing overflows) and a is taken back out of the root, as the kernels do:
    1 / sqrt(a^2 mean(u^2) + eps) = (1/a) / sqrt(mean(u^2) + eps / a^2).
    Where the values are not at hand (see :func:`_has_values`) both forms are computed and
    selected per row, without a branch on the data; a is at least 1 there, so that neither
    form of a zero row is 0/0 (whose NaN a second derivative through the unselected form would
    pick up).
    """
    ms = (xc * xc).mean(-1, keepdim=True)
    if _has_values(xc) and not torch.isinf(ms).any():
        return torch.rsqrt(ms + eps)
    a = xc.abs().amax(-1, keepdim=True).clamp_min(1.0)   # (..., 1)
    u = xc / a                                           # |u| <= 1
    safe = torch.rsqrt((u * u).mean(-1, keepdim=True) + eps / (a * a)) / a
    return torch.where(torch.isinf(ms), safe, torch.rsqrt(ms + eps))


def _has_values(t: torch.Tensor) -> bool:
    """Whether Python may branch on ``t``'s values: a plain eager tensor that holds data. Not
    under torch.compile or torch.export (a branch would guard on data or break the graph), nor
    torch.func transforms, nor for meta or fake tensors (no values), nor a subclass."""
    return not (type(t) is not torch.Tensor or t.is_meta or torch.compiler.is_compiling()
                or torch._C._are_functorch_transforms_active() or torch.jit.is_tracing())


def stats(x: torch.Tensor, eps, is_rms: bool):
    """(mean, rstd) of each row, (..., 1) each; mean is None for RMSNorm.
    (ln-mean), (ln-var), (ln-rstd); (rms-ms) for RMSNorm."""
    if is_rms:
        return None, _rsqrt_ms(x, eps)
    mean = x.mean(-1, keepdim=True)
    return mean, _rsqrt_ms(x - mean, eps)


def xhat(x, mean, rstd):
    """(ln-xhat): (x - mean) * rstd; RMSNorm (mean None): x * rstd."""
    return (x if mean is None else x - mean) * rstd


def forward(x, weight, bias, eps, is_rms: bool):
    """y, mean, rstd: (ln-y) or (rms-y)."""
    mean, rstd = stats(x, eps, is_rms)
    y = xhat(x, mean, rstd)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y, mean, rstd


def backward(dy, x, weight, mean, rstd, has_bias: bool):
    """dx, dweight, dbias: (ln-ghat), (ln-c), (ln-dx), (ln-dparams); RMSNorm when mean is None.

    dweight and dbias sum over every leading dim; dbias is None without a bias, dweight None
    without a weight.
    """
    xh = xhat(x, mean, rstd)                                   # (..., D)
    ghat = dy if weight is None else dy * weight               # (ln-ghat)
    c2 = (ghat * xh).mean(-1, keepdim=True)                    # component along xhat
    if mean is None:
        dx = (ghat - c2 * xh) * rstd                           # (rms-dx)
    else:
        c1 = ghat.mean(-1, keepdim=True)                       # component along 1
        dx = (ghat - c1 - c2 * xh) * rstd                      # (ln-dx)
    dweight = None if weight is None else _sum_tokens(dy * xh)   # (ln-dparams)
    dbias = _sum_tokens(dy) if has_bias else None
    return dx, dweight, dbias


def _sum_tokens(t):
    """(..., D) -> (D,): the sum over every leading dim ("nd->d"); a 1-D t is one token.
    (``sum(())`` would reduce over every dim, hence the special case.)"""
    return t.sum(tuple(range(t.dim() - 1))) if t.dim() > 1 else t


def jvp(tx, tw, tb, x, weight, mean, rstd):
    """The forward-mode tangent of y: weight * J tx + tw * xhat + tb, with J the Jacobian
    (ln-jac) applied to tx: rstd * (tx - mean(tx) - xhat * mean(xhat * tx)); RMSNorm has no
    mean(tx) term. Any of the tangents may be None (zero)."""
    xh = xhat(x, mean, rstd)
    ty = None
    if tx is not None:
        c2 = (xh * tx).mean(-1, keepdim=True)
        jt = tx - c2 * xh if mean is None else tx - tx.mean(-1, keepdim=True) - c2 * xh
        ty = jt * rstd if weight is None else jt * rstd * weight
    if tw is not None:
        ty = xh * tw if ty is None else ty + xh * tw
    if tb is not None:
        ty = tb.expand_as(xh) if ty is None else ty + tb
    return ty if ty is not None else torch.zeros_like(xh)
