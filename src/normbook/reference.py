"""The derivation in code: LayerNorm and RMSNorm, forward, Jacobian and backward.

Every function here is the book's equations written out in PyTorch with the book's symbols
(``mean``, ``var``, ``rstd``, ``xhat``, ``ghat``, ``c1``, ``c2``). They compute in whatever
dtype they are given (float64 for the derivation checks) and are the oracle that every other
implementation in the package is tested against.

Normalization is over the last dimension. Any leading dimensions are flattened into one token
axis ``n`` so that the reductions are exactly the einsum strings of the batching chapter:
per-token statistics keep ``n`` (``"nd->n"``), shared parameters sum it away (``"nd->d"``).
"""

from __future__ import annotations

import torch

__all__ = [
    "layer_norm_forward",
    "layer_norm_backward",
    "layer_norm_jacobian",
    "rms_norm_forward",
    "rms_norm_backward",
    "rms_norm_jacobian",
]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` of shape (..., D) as (N, D), N the product of the leading dims."""
    return t.reshape(-1, t.shape[-1])


def layer_norm_forward(x, weight, bias, eps):
    """LayerNorm forward, equations (ln-mean) to (ln-y) of the chapter "One token's vector".

    mean = (1/D) sum_e x_e,   var = (1/D) sum_e (x_e - mean)^2   (biased: divides by D),
    rstd = 1 / sqrt(var + eps)   (eps inside the root),
    xhat = (x - mean) * rstd,   y = weight * xhat + bias.

    Args:
        x: (..., D) input; normalized over the last dim.
        weight: (D,) scale gamma, or None for 1.
        bias: (D,) shift beta, or None for 0.
        eps: added to the variance inside the square root.

    Returns:
        y: (..., D); mean: (...,); rstd: (...,). mean and rstd are all that backward needs
        besides x: two scalars per token instead of D values of xhat.
    """
    D = x.shape[-1]
    X = _rows(x)                                        # (N, D)
    mean = torch.einsum("nd->n", X) / D                 # (N,)  (ln-mean)
    xc = X - mean[:, None]                              # (N, D) centred
    var = torch.einsum("nd,nd->n", xc, xc) / D          # (N,)  (ln-var), two-pass: no cancellation
    rstd = torch.rsqrt(var + eps)                       # (N,)  (ln-rstd)
    xhat = xc * rstd[:, None]                           # (N, D) (ln-xhat)
    y = xhat
    if weight is not None:
        y = y * weight                                  # (ln-y)
    if bias is not None:
        y = y + bias
    lead = x.shape[:-1]
    return y.reshape(x.shape), mean.reshape(lead), rstd.reshape(lead)


def layer_norm_backward(dy, x, weight, mean, rstd):
    """LayerNorm backward, equations (ln-dparams), (ln-ghat), (ln-c) and (ln-dx) of "The backward pass".

    dweight_d = sum_n dy_nd xhat_nd,   dbias_d = sum_n dy_nd,
    ghat = dy * weight,   c1 = mean_d(ghat),   c2 = mean_d(ghat * xhat),
    dx = (ghat - c1 - c2 * xhat) * rstd.

    Args:
        dy: (..., D) gradient of the loss with respect to y.
        x: (..., D) the forward input.
        weight: (D,) or None.
        mean, rstd: (...,) saved by :func:`layer_norm_forward`.

    Returns:
        dx: (..., D); dweight: (D,) or None; dbias: (D,). The parameter gradients are summed
        over every leading dim, because one weight is used by every token (the fork rule).
    """
    D = x.shape[-1]
    X, G = _rows(x), _rows(dy)                          # (N, D)
    xhat = (X - mean.reshape(-1, 1)) * rstd.reshape(-1, 1)  # (N, D) recomputed, not saved
    ghat = G * weight if weight is not None else G      # (N, D) (ln-ghat)
    c1 = torch.einsum("nd->n", ghat) / D                # (N,)  c1: the component along 1
    c2 = torch.einsum("nd,nd->n", ghat, xhat) / D       # (N,)  c2: the component along xhat
    dx = (ghat - c1[:, None] - c2[:, None] * xhat) * rstd.reshape(-1, 1)  # (N, D) (ln-dx)
    dweight = torch.einsum("nd,nd->d", G, xhat) if weight is not None else None  # (D,)
    dbias = torch.einsum("nd->d", G)                    # (D,)
    return dx.reshape(x.shape), dweight, dbias


def layer_norm_jacobian(x, eps):
    """The D x D Jacobian d xhat_d / d x_e of LayerNorm, equation (ln-jac) of "The Jacobian".

    J_de = rstd * (delta_de - 1/D - xhat_d * xhat_e / D): the direct path, the path through
    the mean, and the path through the standard deviation.

    Args:
        x: (D,) one token's vector.
        eps: as in the forward.

    Returns:
        (D, D) matrix, row d = output, column e = input.
    """
    if x.dim() != 1:
        raise ValueError(f"x: expected a 1-D vector of shape (D,), got shape {tuple(x.shape)}")
    D = x.shape[0]
    _, mean, rstd = layer_norm_forward(x, None, None, eps)
    xhat = (x - mean) * rstd                            # (D,)
    eye = torch.eye(D, dtype=x.dtype, device=x.device)  # term 1: direct path
    through_mean = torch.full_like(eye, 1.0 / D)        # term 2: path through the mean
    through_std = torch.outer(xhat, xhat) / D           # term 3: path through s
    return rstd * (eye - through_mean - through_std)


def rms_norm_forward(x, weight, eps):
    """RMSNorm forward, equations (rms-ms), (rms-y) of "One token's vector" and (rms-xhat) of "RMSNorm".

    ms = (1/D) sum_e x_e^2,   rstd = 1 / sqrt(ms + eps),   xhat = x * rstd,   y = weight * xhat.
    No mean is subtracted and there is no bias.

    Args:
        x: (..., D) input; normalized over the last dim.
        weight: (D,) scale gamma, or None for 1.
        eps: added to the mean square inside the square root.

    Returns:
        y: (..., D); rstd: (...,), the one scalar per token that backward needs.
    """
    D = x.shape[-1]
    X = _rows(x)                                        # (N, D)
    ms = torch.einsum("nd,nd->n", X, X) / D             # (N,)  (rms-ms): the only reduction
    rstd = torch.rsqrt(ms + eps)                        # (N,)
    y = X * rstd[:, None]                               # (N, D) xhat
    if weight is not None:
        y = y * weight                                  # (rms-y)
    return y.reshape(x.shape), rstd.reshape(x.shape[:-1])


def rms_norm_backward(dy, x, weight, rstd):
    """RMSNorm backward, equations (rms-dparams) and (rms-dx) of "RMSNorm": (ln-dx) without c1.

    ghat = dy * weight,   c2 = mean_d(ghat * xhat),   dx = (ghat - c2 * xhat) * rstd,
    dweight_d = sum_n dy_nd xhat_nd.

    Args:
        dy: (..., D) gradient of the loss with respect to y.
        x: (..., D) the forward input.
        weight: (D,) or None.
        rstd: (...,) saved by :func:`rms_norm_forward`.

    Returns:
        dx: (..., D); dweight: (D,) summed over every leading dim, or None.
    """
    D = x.shape[-1]
    X, G = _rows(x), _rows(dy)                          # (N, D)
    xhat = X * rstd.reshape(-1, 1)                      # (N, D)
    ghat = G * weight if weight is not None else G      # (N, D)
    c2 = torch.einsum("nd,nd->n", ghat, xhat) / D       # (N,)  the only reduction
    dx = (ghat - c2[:, None] * xhat) * rstd.reshape(-1, 1)  # (N, D) (rms-dx), no c1
    dweight = torch.einsum("nd,nd->d", G, xhat) if weight is not None else None  # (D,)
    return dx.reshape(x.shape), dweight


def rms_norm_jacobian(x, eps):
    """The D x D Jacobian d xhat_d / d x_e of RMSNorm, equation (rms-jac) of "RMSNorm".

    J_de = rstd * (delta_de - xhat_d * xhat_e / D): LayerNorm's (ln-jac) without the 1/D term,
    since there is no mean for x_e to flow through.

    Args:
        x: (D,) one token's vector.
        eps: as in the forward.

    Returns:
        (D, D) matrix, row d = output, column e = input.
    """
    if x.dim() != 1:
        raise ValueError(f"x: expected a 1-D vector of shape (D,), got shape {tuple(x.shape)}")
    D = x.shape[0]
    xhat, rstd = rms_norm_forward(x, None, eps)         # (D,), ()
    eye = torch.eye(D, dtype=x.dtype, device=x.device)
    return rstd * (eye - torch.outer(xhat, xhat) / D)
