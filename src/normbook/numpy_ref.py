"""LayerNorm and RMSNorm forward in NumPy: the first chapter's code, readable without torch.

Both reduce over ``axis=-1``, the features of one token, and nothing else. Changing the axis
changes the function (see the chapter "One token's vector").
"""

from __future__ import annotations

import numpy as np

__all__ = ["layer_norm", "rms_norm"]


def layer_norm(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-5
) -> np.ndarray:
    """LayerNorm forward, equations (ln-mean) to (ln-y).

    From the chapter "One token's vector". y = weight * (x - mean) /
    sqrt(var + eps) + bias, per token over the last axis, with the biased
    variance (dividing by D).

    Args:
        x: (..., D) array. weight, bias: (D,) arrays. eps: added inside
            the square root.

    Returns:
        ndarray: (..., D).
    """
    mean = x.mean(axis=-1, keepdims=True)                   # (..., 1)
    # (..., 1), biased: / D
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return weight * (x - mean) / np.sqrt(var + eps) + bias  # (..., D)


def rms_norm(
    x: np.ndarray, weight: np.ndarray, eps: float = 1e-5
) -> np.ndarray:
    """RMSNorm forward, equations (rms-ms) and (rms-y).

    From the chapter "One token's vector". y = weight * x /
    sqrt(mean(x^2) + eps), per token over the last axis; no centring, no
    bias.

    Args:
        x: (..., D) array. weight: (D,) array. eps: added inside the
            square root (1e-5 by default, LayerNorm's: not torch's
            RMSNorm default, the machine epsilon of the compute dtype).

    Returns:
        ndarray: (..., D).
    """
    ms = (x**2).mean(axis=-1, keepdims=True)  # (..., 1) mean square
    return weight * x / np.sqrt(ms + eps)     # (..., D)
