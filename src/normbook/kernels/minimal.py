"""The smallest honest LayerNorm kernels: one row per program.

Chapter "Kernels" opens with these, before the production kernels of
``_forward`` and ``_backward``. They compute the same equations, (ln-mean)
to (ln-y) forward and (ln-ghat), (ln-c), (ln-dx), (ln-dparams) backward,
with none of the machinery that makes those fast: no persistent grid, no
pipelining, no wide-row path (D up to MAX_D), no residual add, no RMSNorm
(an exercise of the chapter), fp32 statistics and contiguous rows only.

The backward adds its dweight and dbias contributions with ``tl.atomic_add``
into fp32 sums: short to write, but the order in which programs arrive
changes the rounding, so two runs on a GPU may differ in the last bits.
The production backward sums per-program partials in a fixed order instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["layer_norm_forward", "layer_norm_backward", "MAX_D"]

MAX_D = 8192    # one row per program, all of it in registers


@triton.jit
def ln_fwd_kernel(X, Y, W, B, Mean, Rstd, D, eps, BLOCK_D: tl.constexpr):
    """(ln-mean) to (ln-y) for row ``program_id(0)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)             # BLOCK_D >= D: a mask
    mask = cols < D
    x = tl.load(X + row * D + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    mean = tl.sum(x, axis=0) / D                          # (ln-mean)
    xc = tl.where(mask, x - mean, 0.0)       # padding stays 0
    var = tl.sum(xc * xc, axis=0) / D                     # (ln-var)
    rstd = 1.0 / tl.sqrt(var + eps)                       # (ln-rstd)
    w = tl.load(W + cols, mask=mask).to(tl.float32)
    b = tl.load(B + cols, mask=mask).to(tl.float32)
    y = xc * rstd * w + b                     # (ln-xhat), (ln-y)
    tl.store(Y + row * D + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + row, mean)               # two fp32 scalars a row
    tl.store(Rstd + row, rstd)               # are all backward needs


@triton.jit
def ln_bwd_kernel(X, DY, DX, W, Mean, Rstd, DW, DB, D,
                  BLOCK_D: tl.constexpr):
    """(ln-ghat), (ln-c), (ln-dx) for one row; adds the row's share
    of (ln-dparams) into the fp32 sums DW, DB with atomics."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X + row * D + cols, mask=mask, other=0.0)
    dy = tl.load(DY + row * D + cols, mask=mask, other=0.0)
    x, dy = x.to(tl.float32), dy.to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    mean, rstd = tl.load(Mean + row), tl.load(Rstd + row)
    xhat = tl.where(mask, (x - mean) * rstd, 0.0)   # recomputed
    ghat = dy * w                                         # (ln-ghat)
    c1 = tl.sum(ghat, axis=0) / D                         # (ln-c)
    c2 = tl.sum(ghat * xhat, axis=0) / D
    dx = (ghat - c1 - c2 * xhat) * rstd                   # (ln-dx)
    tl.store(DX + row * D + cols, dx.to(DX.dtype.element_ty), mask=mask)
    # (ln-dparams): every row adds into the same D sums
    tl.atomic_add(DW + cols, dy * xhat, mask=mask)
    tl.atomic_add(DB + cols, dy, mask=mask)


def _check(name, t, shape, x=None):
    """A contiguous floating tensor of ``shape`` (on x's device), else
    an error naming the argument, expected against given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor of shape {shape}, "
                        f"got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point dtype, "
                        f"got {t.dtype}")
    if tuple(t.shape) != shape or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor of shape "
                         f"{shape}, got {tuple(t.shape)}"
                         + ("" if t.is_contiguous() else " strided"))
    if x is not None and t.device != x.device:
        raise ValueError(f"{name}: expected a tensor on x's device "
                         f"{x.device}, got {t.device}")
    if t.is_neg():      # (the kernels read memory, not the sign bit)
        raise ValueError(f"{name}: expected a tensor whose values are "
                         "in memory, got a negative view (call "
                         ".resolve_neg() first)")


def _rows(x):
    """(M, D) of rows x, else an error naming x."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a tensor (M, D), "
                        f"got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x: expected (M, D), got {tuple(x.shape)}")
    if not x.is_cuda and not isinstance(ln_fwd_kernel, InterpretedFunction):
        raise ValueError(f"x: expected a CUDA tensor, got one on {x.device} "
                         "while Triton's interpreter is off (set "
                         "TRITON_INTERPRET=1 before triton is imported)")
    return x.shape


def _block(D):
    if not 1 <= D <= MAX_D:
        raise ValueError(f"D: expected 1 <= D <= {MAX_D} (one row per "
                         f"program, in registers), got {D}")
    return triton.next_power_of_2(D)


def layer_norm_forward(x, weight, bias, eps=1e-5):
    """LayerNorm forward, (ln-mean) to (ln-y), one row per program.

    Args:
        x: (M, D) contiguous, D <= MAX_D; weight, bias: (D,).
        eps: added to the variance inside the square root.

    Returns:
        y: (M, D) in x's dtype; mean, rstd: (M,) fp32.
    """
    M, D = _rows(x)
    block = _block(D)
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        _check(name, t, (M, D) if name == "x" else (D,), x)
    y = torch.empty_like(x)
    mean = x.new_empty((M,), dtype=torch.float32)
    rstd = x.new_empty((M,), dtype=torch.float32)
    if M:
        ln_fwd_kernel[(M,)](x, y, weight, bias, mean, rstd, D, eps,
                            BLOCK_D=block, enable_fp_fusion=True)
    return y, mean, rstd


def layer_norm_backward(dy, x, weight, mean, rstd):
    """LayerNorm backward, (ln-ghat), (ln-c), (ln-dx), (ln-dparams).

    Args:
        dy, x: (M, D) contiguous, D <= MAX_D; weight: (D,);
        mean, rstd: (M,) fp32 from :func:`layer_norm_forward`.

    Returns:
        dx: (M, D) in x's dtype; dweight, dbias: (D,) fp32, summed
            over rows with atomics (not bitwise reproducible on a GPU).
    """
    M, D = _rows(x)
    block = _block(D)
    for name, t, shape in (("dy", dy, (M, D)), ("x", x, (M, D)),
                           ("weight", weight, (D,)),
                           ("mean", mean, (M,)), ("rstd", rstd, (M,))):
        _check(name, t, shape, x)
    dx = torch.empty_like(x)
    dweight = x.new_zeros((D,), dtype=torch.float32)
    dbias = x.new_zeros((D,), dtype=torch.float32)
    if M:
        ln_bwd_kernel[(M,)](x, dy, dx, weight, mean, rstd, dweight,
                            dbias, D, BLOCK_D=block, enable_fp_fusion=True)
    return dx, dweight, dbias
