"""The derivation in code: LayerNorm and RMSNorm, forward, Jacobian and backward.

Every function here is the book's equations written out in PyTorch with the book's symbols
(``mean``, ``var``, ``rstd``, ``xhat``, ``ghat``, ``c1``, ``c2``). They compute in whatever
dtype they are given (float64 for the derivation checks) and are the oracle that every other
implementation in the package is tested against.

The code is staged as the book is. First one token's vector, x of shape (D,), with the
one-token einsum strings: ``"d->"`` a sum over the features, ``"d,d->"`` a dot product
(``layer_norm_token_forward`` and friends, chapters "One token's vector" and "The backward
pass"). Then the loop that runs them row by row, the algorithm a kernel runs
(``layer_norm_rows_forward``, ``layer_norm_rows_backward``). Last the batched functions
(``layer_norm_forward`` and friends, chapter "Batching with einsum"): normalization is over the
last dimension, and any leading dimensions are flattened into one token axis ``n`` so that the
reductions are exactly the einsum strings of the batching chapter: per-token statistics keep
``n`` (``"nd->n"``), shared parameters sum it away (``"nd->d"``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from normbook import _validate

__all__ = [
    "layer_norm_token_forward",
    "layer_norm_token_backward",
    "rms_norm_token_forward",
    "rms_norm_token_backward",
    "layer_norm_rows_forward",
    "layer_norm_rows_backward",
    "layer_norm_forward",
    "layer_norm_backward",
    "layer_norm_jacobian",
    "rms_norm_forward",
    "rms_norm_backward",
    "rms_norm_jacobian",
]


def _rows(t: Tensor) -> Tensor:
    """View ``t`` of shape (..., D) as (N, D), N the product of the leading dims (not -1: a
    reshape of 0 elements to (-1, 0) cannot tell N)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


_NOT_GIVEN = object()   # an argument the function does not take (dy of a forward)


def _token(x, dy=_NOT_GIVEN, **given):
    """D for one token's vector ``x``, after the arguments ``given``
    beside it (see :func:`_against_x`), else a ValueError."""
    _tensor("x", x)
    _floating(x)
    if x.dim() != 1:
        raise ValueError(f"x: expected a 1-D vector of shape (D,), got shape {tuple(x.shape)}")
    return _against_x(x, dy=dy, numbers=True, **given)


def _check_rows(x, dy=_NOT_GIVEN, **given):
    """(N, D) for rows ``x``, after the arguments ``given`` beside them
    (see :func:`_against_x`), else a ValueError."""
    _tensor("x", x)
    _floating(x)
    if x.dim() != 2:
        raise ValueError(f"x: expected rows of shape (N, D), got shape {tuple(x.shape)}")
    _against_x(x, dy=dy, **given)
    return x.shape


def _batch(x, dy=_NOT_GIVEN, **given):
    """D for tokens ``x`` of shape (..., D), after the arguments
    ``given`` beside them (see :func:`_against_x`), else a ValueError."""
    _tensor("x", x)
    _floating(x)
    if x.dim() == 0:
        raise ValueError("x: expected a tensor of shape (..., D), got a 0-d tensor")
    return _against_x(x, dy=dy, **given)


def _tensor(name, t):
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _floating(x):
    """A real floating x: an integer x was computed into an integer output
    (truncated) by the row loop, and a complex one gave a complex rstd."""
    if not x.is_floating_point():
        raise TypeError(f"x: expected a real floating-point dtype, got {x.dtype}")


# what each argument's shape must be, by its name, given x (..., D)
_LIKE_X = ("dy", "dx", "t")        # gradients and saved outputs: x's shape
_VECTORS = ("weight", "bias")      # one value per feature: (D,)
_PER_TOKEN = ("mean", "rstd")      # one value per token: x's leading shape


def _against_x(x, numbers=False, **given):
    """D = x.shape[-1], once every argument in ``given`` (by name) has
    the shape its name asks for beside x: dy and t x's shape; weight
    and bias (D,), or None; A (D, D); mean and rstd one value per
    token, x's leading shape or those dims flattened into one (with
    ``numbers``, the token functions', a number for a single token);
    eps a real number or a 0-d tensor, not NaN. Else a ValueError or
    TypeError naming it, expected against given: the formulas would
    broadcast a (1,) weight or a scalar rstd over every token and
    return a wrong answer."""
    D, lead = x.shape[-1], tuple(x.shape[:-1])
    for name, t in given.items():
        if t is _NOT_GIVEN or (t is None and name in _VECTORS):
            continue
        if name == "eps":
            _validate.check_eps(_validate.as_eps(t))
            continue
        if name in _LIKE_X:
            shapes, why = [tuple(x.shape)], " (as x)"
        elif name in _VECTORS:
            shapes, why = [(D,)], " (D = x.shape[-1])"
        elif name == "A":
            shapes, why = [(D, D)], " (D x D, D = x.shape[-1])"
        else:
            if (numbers and not lead and isinstance(t, (int, float))
                    and not isinstance(t, bool)):
                continue
            shapes, why = [lead, (math.prod(lead),)], " (one value per token of x)"
        _tensor(name, t)
        if not t.is_floating_point():   # a complex weight made y complex, an int one passed
            raise TypeError(f"{name}: expected a real floating-point dtype, got {t.dtype}")
        if tuple(t.shape) not in shapes:
            expected = " or ".join(str(s) for s in dict.fromkeys(shapes))
            raise ValueError(f"{name}: expected shape {expected}{why}, "
                             f"got shape {tuple(t.shape)}")
    return D


# One token's vector, x of shape (D,): chapters "One token's vector" and "The backward pass".
# Every public function keeps its lines within 72 characters: the chapters show them whole.


def layer_norm_token_forward(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """One token's LayerNorm forward, (ln-mean) to (ln-y) of the
    chapter "One token's vector".

    mean = (1/D) sum_d x_d,   var = (1/D) sum_d (x_d - mean)^2,
    rstd = 1 / sqrt(var + eps),   xhat = (x - mean) * rstd,
    y = weight * xhat + bias.
    The variance is the biased one (divides by D); eps sits inside
    the root. Two sweeps over the row: its sum, then its squared
    deviations from the mean (no E[x^2] - mean^2 cancellation).

    Args:
        x: (D,) one token's vector.
        weight: (D,) scale gamma, or None for 1.
        bias: (D,) shift beta, or None for 0.
        eps: added to the variance inside the square root.

    Returns:
        y: (D,); mean, rstd: () scalars, all that backward needs
            besides x: two numbers instead of the D values of xhat.
    """
    D = _token(x, weight=weight, bias=bias, eps=eps)
    mean = torch.einsum("d->", x) / D           # ()  (ln-mean), sweep 1
    xc = x - mean                               # (D,) centred
    var = torch.einsum("d,d->", xc, xc) / D     # ()  (ln-var), sweep 2
    rstd = torch.rsqrt(var + eps)               # ()  (ln-rstd)
    xhat = xc * rstd                            # (D,) (ln-xhat)
    y = xhat if weight is None else xhat * weight   # (D,) (ln-y)
    y = y if bias is None else y + bias
    return y, mean, rstd


def layer_norm_token_backward(
    dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor,
    rstd: Tensor,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """One token's LayerNorm backward, (ln-ghat), (ln-c), (ln-dx) and
    (ln-dparams) of the chapter "The backward pass".

    ghat = dy * weight,   c1 = mean_d(ghat),   c2 = mean_d(ghat * xhat),
    dx = (ghat - c1 - c2 * xhat) * rstd,
    dweight = dy * xhat,   dbias = dy.

    Args:
        dy: (D,) gradient of the loss with respect to y.
        x: (D,) the forward input.
        weight: (D,) or None.
        mean, rstd: () saved by :func:`layer_norm_token_forward`.

    Returns:
        dx: (D,); dweight: (D,) or None; dbias: (D,). One token's
            share of the parameter gradients; a batch adds up the shares.
    """
    D = _token(x, dy, weight=weight, mean=mean, rstd=rstd)
    xhat = (x - mean) * rstd                    # (D,) recomputed
    ghat = dy if weight is None else dy * weight    # (D,) (ln-ghat)
    c1 = torch.einsum("d->", ghat) / D          # ()  (ln-c): along 1
    c2 = torch.einsum("d,d->", ghat, xhat) / D  # ()  (ln-c): along xhat
    dx = (ghat - c1 - c2 * xhat) * rstd         # (D,) (ln-dx)
    dweight = None if weight is None else dy * xhat  # (ln-dparams)
    dbias = dy.clone()                          # (D,)
    return dx, dweight, dbias


def rms_norm_token_forward(
    x: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """One token's RMSNorm forward, (rms-ms) and (rms-y) of the
    chapter "One token's vector".

    ms = (1/D) sum_d x_d^2,   rstd = 1 / sqrt(ms + eps),
    xhat = x * rstd,   y = weight * xhat.
    LayerNorm without the mean: one sweep over the row, no bias.

    Args:
        x: (D,) one token's vector.
        weight: (D,) scale gamma, or None for 1.
        eps: added to the mean square inside the square root.

    Returns:
        y: (D,); rstd: (), the one scalar that backward needs.
    """
    D = _token(x, weight=weight, eps=eps)
    ms = torch.einsum("d,d->", x, x) / D        # ()  (rms-ms): 1 sweep
    rstd = torch.rsqrt(ms + eps)                # ()
    xhat = x * rstd                             # (D,) (rms-xhat)
    y = xhat if weight is None else xhat * weight   # (D,) (rms-y)
    return y, rstd


def rms_norm_token_backward(
    dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor
) -> tuple[Tensor, Tensor | None]:
    """One token's RMSNorm backward, (rms-dx) and (rms-dparams) of
    the chapter "RMSNorm": (ln-dx) without c1.

    ghat = dy * weight,   c2 = mean_d(ghat * xhat),
    dx = (ghat - c2 * xhat) * rstd,   dweight = dy * xhat.

    Args:
        dy: (D,) gradient of the loss with respect to y.
        x: (D,) the forward input.
        weight: (D,) or None.
        rstd: () saved by :func:`rms_norm_token_forward`.

    Returns:
        dx: (D,); dweight: (D,), this token's share, or None.
    """
    D = _token(x, dy, weight=weight, rstd=rstd)
    xhat = x * rstd                             # (D,) recomputed
    ghat = dy if weight is None else dy * weight    # (D,)
    c2 = torch.einsum("d,d->", ghat, xhat) / D  # ()  the only sum
    dx = (ghat - c2 * xhat) * rstd              # (D,) (rms-dx)
    dweight = None if weight is None else dy * xhat  # (rms-dparams)
    return dx, dweight


# Row by row, x of shape (N, D): the algorithm a kernel runs ("Kernels").


def layer_norm_rows_forward(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm forward over N rows, one row at a time, as a kernel
    runs it: (ln-mean) to (ln-y) of "One token's vector" on each row.

    Each row is one program's work on a GPU (the chapter "Kernels"):
    sweep 1 sums the row for the mean, sweep 2 sums its squared
    deviations for the variance, then every element is normalized.
    Rows share nothing but weight and bias, so they run in parallel.
    (A kernel does the arithmetic in fp32; this loop in x's dtype.)

    Args:
        x: (N, D) N tokens' vectors, one per row.
        weight, bias: (D,) or None; eps: as in the one-token forward.

    Returns:
        y: (N, D); mean, rstd: (N,), two scalars saved per row.
    """
    N, D = _check_rows(x, weight=weight, bias=bias, eps=eps)
    y = torch.empty_like(x)                     # (N, D)
    mean = x.new_empty(N)                       # (N,)
    rstd = x.new_empty(N)                       # (N,)
    for n in range(N):                          # program n: row n
        y[n], mean[n], rstd[n] = layer_norm_token_forward(
            x[n], weight, bias, eps)
    return y, mean, rstd


def layer_norm_rows_backward(
    dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor,
    rstd: Tensor,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """LayerNorm backward over N rows, one row at a time, as a kernel
    runs it: (ln-dx) per row, (ln-dparams) added up over the rows.

    Each row is one program's work on a GPU: recompute xhat from the
    saved mean and rstd, one sweep for c1 and c2, one for dx. The
    parameter gradients are shared by all rows: every row adds its
    share into the same D sums (the fork rule).

    Args:
        dy, x: (N, D). weight: (D,) or None.
        mean, rstd: (N,) saved by the row forward,
            :func:`normbook.reference.layer_norm_rows_forward`.

    Returns:
        dx: (N, D); dweight: (D,) or None; dbias: (D,), both summed
            over the N rows.
    """
    N, D = _check_rows(x, dy, weight=weight, mean=mean,
                       rstd=rstd)
    dx = torch.empty_like(x)                    # (N, D)
    dweight = None if weight is None else x.new_zeros(D)  # (D,)
    dbias = x.new_zeros(D)                      # (D,)
    for n in range(N):                          # program n: row n
        dx[n], dw, db = layer_norm_token_backward(
            dy[n], x[n], weight, mean[n], rstd[n])
        if dweight is not None:
            dweight += dw                       # shared: rows add up
        dbias += db
    return dx, dweight, dbias


# The batched functions, x of shape (..., D): chapter "Batching with einsum".


def layer_norm_forward(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm forward, (ln-mean) to (ln-y) of "One token's vector",
    for N tokens at once: (batch-stats) of "Batching with einsum".

    mean = (1/D) sum_d x_d,   var = (1/D) sum_d (x_d - mean)^2,
    rstd = 1 / sqrt(var + eps),   xhat = (x - mean) * rstd,
    y = weight * xhat + bias.
    The variance is biased (divides by D), computed in a second pass
    over the centred rows (no cancellation); eps sits inside the root.

    Args:
        x: (..., D) input; normalized over the last dim.
        weight: (D,) scale gamma, or None for 1.
        bias: (D,) shift beta, or None for 0.
        eps: added to the variance inside the square root.

    Returns:
        y: (..., D); mean: (...,); rstd: (...,). mean and rstd are
            all that backward needs besides x: two scalars per token
            instead of D values of xhat.
    """
    D = _batch(x, weight=weight, bias=bias, eps=eps)
    X = _rows(x)                                # (N, D)
    mean = torch.einsum("nd->n", X) / D         # (N,)  (ln-mean)
    xc = X - mean[:, None]                      # (N, D) centred
    var = torch.einsum("nd,nd->n", xc, xc) / D  # (N,)  (ln-var)
    rstd = torch.rsqrt(var + eps)               # (N,)  (ln-rstd)
    xhat = xc * rstd[:, None]                   # (N, D) (ln-xhat)
    y = xhat if weight is None else xhat * weight   # (N, D) (ln-y)
    y = y if bias is None else y + bias
    lead = x.shape[:-1]
    return y.reshape(x.shape), mean.reshape(lead), rstd.reshape(lead)


def layer_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor,
    rstd: Tensor,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """LayerNorm backward, (ln-ghat), (ln-c), (ln-dx), (ln-dparams) of
    "The backward pass", for N tokens at once: (batch-stats),
    (batch-dx) and (batch-params) of "Batching with einsum".

    ghat = dy * weight,   c1 = mean_d(ghat),   c2 = mean_d(ghat * xhat),
    dx = (ghat - c1 - c2 * xhat) * rstd,
    dweight_d = sum_n dy_nd xhat_nd,   dbias_d = sum_n dy_nd.

    Args:
        dy: (..., D) gradient of the loss with respect to y.
        x: (..., D) the forward input.
        weight: (D,) or None.
        mean, rstd: (...,) saved by :func:`layer_norm_forward`.

    Returns:
        dx: (..., D); dweight: (D,) or None; dbias: (D,). The
            parameter gradients are summed over every leading dim, because
            one weight is used by every token (the fork rule).
    """
    D = _batch(x, dy, weight=weight, mean=mean, rstd=rstd)
    X, G = _rows(x), _rows(dy)                  # (N, D)
    r = rstd.reshape(-1, 1)                     # (N, 1)
    xhat = (X - mean.reshape(-1, 1)) * r        # (N, D) recomputed
    ghat = G if weight is None else G * weight  # (N, D) (ln-ghat)
    c1 = torch.einsum("nd->n", ghat) / D        # (N,)  c1: along 1
    c2 = torch.einsum("nd,nd->n", ghat, xhat) / D  # (N,) c2: along xhat
    dx = (ghat - c1[:, None] - c2[:, None] * xhat) * r  # (ln-dx)
    dweight = (None if weight is None
               else torch.einsum("nd,nd->d", G, xhat))  # (D,)
    dbias = torch.einsum("nd->d", G)            # (D,)
    return dx.reshape(x.shape), dweight, dbias


def layer_norm_jacobian(x: Tensor, eps: float) -> Tensor:
    """The D x D Jacobian d xhat_d / d x_e of LayerNorm, equation
    (ln-jac) of "The Jacobian".

    J_de = rstd * (delta_de - 1/D - xhat_d * xhat_e / D): the direct
    path, the path through the mean, and the path through the
    standard deviation.

    Args:
        x: (D,) one token's vector.
        eps: as in the forward.

    Returns:
        Tensor: (D, D), row d = output, column e = input.
    """
    D = _token(x, eps=eps)
    _, mean, rstd = layer_norm_token_forward(x, None, None, eps)
    xhat = (x - mean) * rstd                    # (D,)
    eye = torch.eye(D, dtype=x.dtype, device=x.device)  # term 1: direct
    through_mean = torch.full_like(eye, 1.0 / D)  # term 2: via the mean
    through_std = torch.outer(xhat, xhat) / D   # term 3: via s
    return rstd * (eye - through_mean - through_std)


def rms_norm_forward(
    x: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """RMSNorm forward, (rms-ms) and (rms-y) of "One token's vector"
    and (rms-xhat) of "RMSNorm", for N tokens at once.

    ms = (1/D) sum_d x_d^2,   rstd = 1 / sqrt(ms + eps),
    xhat = x * rstd,   y = weight * xhat.
    No mean is subtracted and there is no bias.

    Args:
        x: (..., D) input; normalized over the last dim.
        weight: (D,) scale gamma, or None for 1.
        eps: added to the mean square inside the square root.

    Returns:
        y: (..., D); rstd: (...,), the one scalar per token that
            backward needs.
    """
    D = _batch(x, weight=weight, eps=eps)
    X = _rows(x)                                # (N, D)
    ms = torch.einsum("nd,nd->n", X, X) / D     # (N,)  (rms-ms)
    rstd = torch.rsqrt(ms + eps)                # (N,)
    y = X * rstd[:, None]                       # (N, D) xhat
    y = y if weight is None else y * weight     # (N, D) (rms-y)
    return y.reshape(x.shape), rstd.reshape(x.shape[:-1])


def rms_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor
) -> tuple[Tensor, Tensor | None]:
    """RMSNorm backward, (rms-dparams) and (rms-dx) of "RMSNorm":
    (ln-dx) without c1, for N tokens at once.

    ghat = dy * weight,   c2 = mean_d(ghat * xhat),
    dx = (ghat - c2 * xhat) * rstd,   dweight_d = sum_n dy_nd xhat_nd.

    Args:
        dy: (..., D) gradient of the loss with respect to y.
        x: (..., D) the forward input.
        weight: (D,) or None.
        rstd: (...,) saved by :func:`rms_norm_forward`.

    Returns:
        dx: (..., D); dweight: (D,) summed over every leading dim, or
            None.
    """
    D = _batch(x, dy, weight=weight, rstd=rstd)
    X, G = _rows(x), _rows(dy)                  # (N, D)
    r = rstd.reshape(-1, 1)                     # (N, 1)
    xhat = X * r                                # (N, D)
    ghat = G if weight is None else G * weight  # (N, D)
    c2 = torch.einsum("nd,nd->n", ghat, xhat) / D  # (N,) the only sum
    dx = (ghat - c2[:, None] * xhat) * r        # (N, D) (rms-dx)
    dweight = (None if weight is None
               else torch.einsum("nd,nd->d", G, xhat))  # (D,)
    return dx.reshape(x.shape), dweight


def rms_norm_jacobian(x: Tensor, eps: float) -> Tensor:
    """The D x D Jacobian d xhat_d / d x_e of RMSNorm, equation
    (rms-jac) of "RMSNorm".

    J_de = rstd * (delta_de - xhat_d * xhat_e / D): LayerNorm's
    (ln-jac) without the 1/D term, since there is no mean for x_e to
    flow through.

    Args:
        x: (D,) one token's vector.
        eps: as in the forward.

    Returns:
        Tensor: (D, D), row d = output, column e = input.
    """
    D = _token(x, eps=eps)
    xhat, rstd = rms_norm_token_forward(x, None, eps)  # (D,), ()
    eye = torch.eye(D, dtype=x.dtype, device=x.device)
    return rstd * (eye - torch.outer(xhat, xhat) / D)
