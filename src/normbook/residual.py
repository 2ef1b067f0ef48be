"""Residual blocks by hand: the fork rule in code.

A value used twice receives the gradient of each use, and the two add (equation (fork-rule) of
the chapter "Residual connections and the fork rule"). In ``y = x + tanh(A x)`` the input ``x``
is used by the identity path and by the branch, so its gradient is a sum of two terms
(equation (residual-grad)); in code the second term is accumulated with ``+=``.

Shapes: ``x`` is (..., D), one token per row; ``A`` is (D, D) and acts on each token,
``z_d = sum_e A_de x_e``, written ``x @ A.T`` for a batch of rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from normbook import reference

__all__ = [
    "residual_tanh_forward",
    "residual_tanh_backward",
    "pre_norm_tanh_forward",
    "pre_norm_tanh_backward",
]


def _branch_backward(dt, u, A, t):
    """Back through the branch t = tanh(A u).

    Returns (du, dA) for the gradient dt at t. du = A^T ((1 - t^2) * dt)
    per token; dA_de = sum_n dz_nd u_ne (A is shared by every token).
    """
    dz = dt * (1 - t * t)               # (..., D) tanh' = 1 - tanh^2
    du = dz @ A                         # (..., D) A^T dz for each row
    D = u.shape[-1]
    # (D, D)
    dA = torch.einsum("nd,ne->de", dz.reshape(-1, D), u.reshape(-1, D))
    return du, dA


def residual_tanh_forward(
    x: Tensor, A: Tensor
) -> tuple[Tensor, Tensor]:
    """Residual block y = x + tanh(A x), equation (residual-block).

    Its gradient is (residual-grad).

    Args:
        x: (..., D) input, one token per row.
        A: (D, D) weight of the branch.

    Returns:
        y: (..., D); t: (..., D) the branch output tanh(A x), saved
            because backward needs tanh' = 1 - t^2 and recomputing it
            would cost a matrix product.
    """
    reference._batch(x, A=A)
    t = torch.tanh(x @ A.T)                             # (..., D)
    return x + t, t


def residual_tanh_backward(
    dy: Tensor, x: Tensor, A: Tensor, t: Tensor
) -> tuple[Tensor, Tensor]:
    """Backward of y = x + tanh(A x): equation (residual-grad).

    An instance of (fork-rule). dx = dy + A^T ((1 - tanh^2(A x)) * dy):
    one term per use of x. See the chapter "Residual connections and the
    fork rule".

    Args:
        dy: (..., D) gradient arriving at y.
        x: (..., D) the forward input.
        A: (D, D) the branch weight.
        t: (..., D) tanh(A x), saved by :func:`residual_tanh_forward`.

    Returns:
        dx: (..., D); dA: (D, D) summed over every token.
    """
    reference._batch(x, dy, A=A, t=t)
    dx = dy.clone()     # use 1 of x: the identity path
    du, dA = _branch_backward(dy, x, A, t)
    dx += du            # use 2 of x: the branch. += (fork-rule), not =
    return dx, dA


def pre_norm_tanh_forward(
    x: Tensor, A: Tensor, weight: Tensor | None, bias: Tensor | None,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Pre-norm block y = x + tanh(A LayerNorm(x)), equation (residual-pre-norm).

    x feeds the identity path and the norm: the fork that :func:`pre_norm_tanh_backward` sums.

    Args:
        x: (..., D) input. A: (D, D). weight, bias: (D,) or None. eps: LayerNorm's eps.

    Returns:
        y: (..., D); t: (..., D) the branch output; mean, rstd: (...,) the norm's statistics.
    """
    reference._batch(x, A=A)
    u, mean, rstd = reference.layer_norm_forward(x, weight, bias, eps)  # (..., D) Norm(x)
    t = torch.tanh(u @ A.T)                             # (..., D) F(Norm(x))
    return x + t, t, mean, rstd


def pre_norm_tanh_backward(
    dy: Tensor, x: Tensor, A: Tensor, weight: Tensor | None,
    bias: Tensor | None, eps: float, t: Tensor, mean: Tensor,
    rstd: Tensor,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Backward of y = x + tanh(A LayerNorm(x)) by (fork-rule).

    dx is dy plus LayerNorm's (ln-dx) of the branch.

    Args:
        dy: (..., D). x: (..., D). A: (D, D). weight, bias: (D,) or None.
            eps: as in forward.
        t, mean, rstd: saved by :func:`pre_norm_tanh_forward`.

    Returns:
        dx: (..., D); dA: (D, D); dweight: (D,) or None; dbias: (D,) or
            None.
    """
    reference._batch(x, dy, A=A, weight=weight, bias=bias, t=t,
                     mean=mean, rstd=rstd)
    # recomputed, not saved
    u, _, _ = reference.layer_norm_forward(x, weight, bias, eps)
    du, dA = _branch_backward(dy, u, A, t)
    dxn, dweight, dbias = reference.layer_norm_backward(
        du, x, weight, mean, rstd
    )
    dx = dy.clone()     # use 1 of x: the identity path
    dx += dxn           # use 2 of x: through the norm and the branch
    return dx, dA, dweight, (dbias if bias is not None else None)
