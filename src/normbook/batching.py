"""The batched backward, one token at a time: the loop that einsum replaces.

:func:`normbook.reference.layer_norm_backward` handles N tokens at once with the einsum strings
of the chapter "Batching with einsum": per-token statistics keep n (``"nd->n"``, equation
(batch-stats)), shared parameters sum it away (``"nd->d"``, equation (batch-params)). The loops
here call the one-token functions on one token at a time and accumulate the parameter gradients
with ``+=``: one weight used by N tokens receives N contributions (the fork rule). They exist to
check the batched path and to time it; they are not meant to be fast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from normbook import reference

__all__ = ["layer_norm_backward_loop", "rms_norm_backward_loop"]


# the per-row loop of "The backward pass" is this loop: one function, two names
layer_norm_backward_loop = reference.layer_norm_rows_backward


def rms_norm_backward_loop(
    dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor
) -> tuple[Tensor, Tensor | None]:
    """RMSNorm backward (rms-dx), token by token; the same returns as the batched reference:
    ghat = dy * weight, c2 = mean(ghat * xhat), dx = rstd * (ghat - c2 * xhat) with
    xhat = x * rstd, and dweight = sum over tokens of dy * xhat.

    Args:
        dy, x: (N, D). weight: (D,) or None. rstd: (N,) from the forward.

    Returns:
        dx: (N, D); dweight: (D,) summed over the N tokens, or None.
    """
    N, D = reference._check_rows(x, dy, weight=weight, rstd=rstd)
    dx = torch.empty_like(x)                            # (N, D)
    dweight = None if weight is None else torch.zeros(D, dtype=x.dtype, device=x.device)
    for n in range(N):
        dx_n, dw_n = reference.rms_norm_token_backward(dy[n], x[n], weight, rstd[n])
        dx[n] = dx_n
        if weight is not None:
            dweight += dw_n                             # shared: n is summed (fork rule)
    return dx, dweight
