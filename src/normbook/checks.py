"""The two free checks: identities every correct LayerNorm backward satisfies.

LayerNorm ignores shifts of its input (exactly) and positive rescalings (exactly only at
eps = 0), so its input gradient has no component along either direction. These functions
compute the identities per token; tests and chapters assert with them, with no reference
implementation, no finite differences and no autograd. See the chapter "Invariances and the
two free checks", equations (ln-shift-id), (ln-scale-id) and (ln-eps-residual).
"""

from __future__ import annotations

import torch

from normbook import reference

__all__ = [
    "shift_identity",
    "scale_identity",
    "scale_identity_residual",
    "assert_layer_norm_identities",
]


def _xhat(x: torch.Tensor, eps: float) -> torch.Tensor:
    _, mean, rstd = reference.layer_norm_forward(x, None, None, eps)
    return (x - mean[..., None]) * rstd[..., None]


def shift_identity(dx: torch.Tensor) -> torch.Tensor:
    """Equation (ln-shift-id): sum_d dx_d, which is zero for LayerNorm at any eps.

    Args:
        dx: (..., D) input gradient of a LayerNorm.

    Returns:
        (...,) the sum over the last dim, one value per token.
    """
    return dx.sum(-1)


def scale_identity(x: torch.Tensor, dx: torch.Tensor, eps: float) -> torch.Tensor:
    """Equation (ln-scale-id): sum_d xhat_d dx_d, zero at eps = 0 for a LayerNorm input gradient.

    xhat is LayerNorm's (the mean is subtracted), so this is not RMSNorm's identity: for RMSNorm
    compute sum_d (x_d * rstd) dx_d directly, as the exercise in the invariances chapter does.

    Args:
        x: (..., D) the forward input (xhat is recomputed from it with LayerNorm's statistics).
        dx: (..., D) the input gradient.
        eps: the eps of the forward.

    Returns:
        (...,) one value per token. At eps > 0 it equals :func:`scale_identity_residual`.
    """
    return (_xhat(x, eps) * dx).sum(-1)


def scale_identity_residual(
    x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """Equation (ln-eps-residual): the exact sum_d xhat_d dx_d when eps > 0.

    With c2 = mean_d(ghat * xhat) and rstd = 1 / sqrt(var + eps),
    sum_d xhat_d dx_d = D * c2 * eps * rstd^3,
    because sum_d xhat_d^2 = D * var / (var + eps) rather than D.

    Args:
        x: (..., D) the forward input.
        dy: (..., D) the gradient arriving at y.
        weight: (D,) or None.
        eps: the eps of the forward.

    Returns:
        (...,) the predicted residual, one value per token.
    """
    D = x.shape[-1]
    _, mean, rstd = reference.layer_norm_forward(x, None, None, eps)
    xhat = (x - mean[..., None]) * rstd[..., None]
    ghat = dy * weight if weight is not None else dy
    c2 = (ghat * xhat).mean(-1)
    return D * c2 * eps * rstd**3


def assert_layer_norm_identities(
    x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor | None,
    dx: torch.Tensor, eps: float, atol: float | None = None,
) -> None:
    """Assert both free checks on a LayerNorm input gradient ``dx``.

    Raise AssertionError if either fails. Checks (ln-shift-id),
    sum_d dx_d = 0, and (ln-eps-residual), sum_d xhat_d dx_d equal to its
    closed form, each per token within ``atol`` scaled by the size of the
    terms being summed (default: 64 units of roundoff of dx's dtype).

    Args:
        x, dy: (..., D) the forward input and the gradient arriving at y.
        weight: (D,) or None.
        dx: (..., D) the input gradient under test.
        eps: the eps of the forward.
        atol: relative tolerance per token; default
            64 * finfo(dx.dtype).eps.
    """
    if atol is None:
        atol = 64 * torch.finfo(dx.dtype).eps
    scale = (
        dx.abs().sum(-1) * (1 + _xhat(x, eps).abs().amax(-1))
        + torch.finfo(dx.dtype).tiny
    )
    shift = shift_identity(dx).abs() / scale
    if shift.numel() and shift.max() > atol:
        raise AssertionError(
            f"shift identity sum(dx) = 0 fails: worst relative residual "
            f"{shift.max().item():.3e} "
            f"> {atol:.1e} (token {int(shift.argmax())})"
        )
    resid = scale_identity_residual(x, dy, weight, eps).to(dx.dtype)
    scale_err = (scale_identity(x, dx, eps) - resid).abs() / scale
    if scale_err.numel() and scale_err.max() > atol:
        raise AssertionError(
            f"scale identity sum(xhat * dx) = D c2 eps rstd^3 fails: "
            f"worst relative residual "
            f"{scale_err.max().item():.3e} > {atol:.1e} "
            f"(token {int(scale_err.argmax())})"
        )
