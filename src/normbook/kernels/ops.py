"""The kernels' custom ops, and :mod:`normbook.kernels`' public functions.

The public functions here are thin aliases of :func:`normbook.layer_norm` and its kin that force
the kernel backend: the one front door (:mod:`normbook.functional`) validates and flattens each
call once and applies the one autograd Function, ``normbook.functional.NormFunction``, whose
kernel backend calls the launchers (``_forward.norm_forward``, ``_backward.norm_backward``)
directly in eager mode.

Under ``torch.compile``, and for a DTensor, that Function calls the launchers through the custom
ops ``torch.ops.normbook.norm_forward`` and ``norm_backward`` defined here: each has a fake
(shape-only) implementation, so Dynamo traces the Function through them without a graph break,
and sharding rules (:mod:`normbook.kernels._dtensor`), so that DTensor runs them on each rank's
rows. Autograd is the Function's; the ops themselves have none.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from normbook import functional as _F
from normbook.kernels import _backward, _forward

__all__ = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "norm_forward", "norm_backward"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# decided once, when triton decorated the kernels
_INTERPRETED = isinstance(_forward.norm_fwd_rows_kernel, InterpretedFunction)


def interpreted() -> bool:
    """True when TRITON_INTERPRET=1 was set before triton was imported: kernels run on the CPU."""
    return _INTERPRETED


def _rows(t: Tensor) -> Tensor:
    """(..., D) -> (M, D) with a unit stride along D. Row strides are kept (a slice of a wider
    tensor is read in place); only a non-contiguous last dim is copied."""
    if t.dim() != 2:
        D = t.shape[-1]
        t = t.reshape(-1, D) if D else t.reshape(math.prod(t.shape[:-1]), 0)
    return t.contiguous() if t.stride(-1) != 1 and t.shape[-1] > 1 else t


# ----------------------------------------------------------------------------- custom ops

@torch.library.custom_op("normbook::norm_forward", mutates_args=())
def norm_forward(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor],
                 bias: Optional[Tensor], eps: float, is_rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(ln-y) or (rms-y) over the last dim of x, (..., D): returns y, h (empty without
    residual) and the fp32 stats, (2, ...) mean and rstd, or (1, ...) rstd for RMSNorm.
    The public functions pass (M, D) rows; a DTensor keeps its leading dims (its sharding
    rules, ``_dtensor``, keep each token's row whole on one rank)."""
    lead = x.shape[:-1]
    y, h, stats = _forward.norm_forward(_rows(x), None if residual is None else _rows(residual),
                                        weight, bias, eps, is_rms)
    if len(lead) != 1:
        y, h, stats = y.view(x.shape), None if h is None else h.view(x.shape), stats.view(-1, *lead)
    return y, x.new_empty((0,)) if h is None else h, stats   # an op returns tensors, never None


@norm_forward.register_fake
def _(x, residual, weight, bias, eps, is_rms):
    return (x.new_empty(x.shape), x.new_empty(x.shape if residual is not None else (0,)),
            x.new_empty((1 if is_rms else 2, *x.shape[:-1]), dtype=torch.float32))


@torch.library.custom_op("normbook::norm_backward", mutates_args=())
def norm_backward(dy: Tensor, dh: Optional[Tensor], x: Tensor, weight: Optional[Tensor], stats: Tensor,
                  bias_dtype: Optional[torch.dtype], is_rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(ln-dx) or (rms-dx), (ln-dparams) and the (fork-rule): dx (x's shape, (..., D)),
    dweight, dbias (empty if absent)."""
    dx, dweight, dbias = _backward.norm_backward(
        _rows(dy), None if dh is None else _rows(dh), _rows(x), weight,
        stats.reshape(stats.shape[0], -1), bias_dtype, is_rms)
    empty = x.new_empty((0,))
    return (dx if x.dim() == 2 else dx.view(x.shape), empty.clone() if dweight is None else dweight,
            empty if dbias is None else dbias)


@norm_backward.register_fake
def _(dy, dh, x, weight, stats, bias_dtype, is_rms):
    D = x.shape[-1]
    return (x.new_empty(x.shape), x.new_empty((0,)) if weight is None else weight.new_empty((D,)),
            x.new_empty((0,)) if bias_dtype is None else x.new_empty((D,), dtype=bias_dtype))


# ----------------------------------------------------------------------------- public API

def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """(ln-y): :func:`normbook.layer_norm` on the kernel backend, as ``torch.nn.functional.layer_norm``.

    Forward (ln-mean) to (ln-y) of "One token's vector"; gradient (ln-dx) and (ln-dparams) of
    "The backward pass". Statistics in fp32 (biased variance, eps inside the root).
    float64 is refused: use :func:`normbook.layer_norm`, whose torch backend computes in it.

    Args:
        input: ``(*, *normalized_shape)`` float16, bfloat16 or float32; CUDA, or CPU under
            TRITON_INTERPRET=1.
        normalized_shape: int or sequence, the trailing dims to normalize over (D = product).
        weight, bias: optional, of shape ``normalized_shape``, any of the three dtypes.
        eps: added to the variance inside the square root.

    Returns:
        Tensor of input's shape and dtype (also when weight is fp32 and input bf16). Rows wider
        than the device's programs can share are computed by the torch backend, with a warning.
    """
    return _F._norm(input, normalized_shape, weight, bias, _F._ln_eps(eps), False, kernels=True)[0]


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """(rms-y): :func:`normbook.rms_norm` on the kernel backend, as ``torch.nn.functional.rms_norm``.

    Forward (rms-ms), (rms-y) of "One token's vector"; gradient (rms-dx) of "RMSNorm".

    Args:
        input: ``(*, *normalized_shape)`` float16, bfloat16 or float32.
        normalized_shape: int or sequence, the trailing dims to normalize over.
        weight: optional, of shape ``normalized_shape``.
        eps: inside the square root; None means fp32's machine epsilon, as torch computes.

    Returns:
        Tensor of input's shape and dtype.
    """
    return _F._norm(input, normalized_shape, weight, _F._NO_BIAS, _F._rms_eps(input, eps), True,
                    kernels=True)[0]


def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5):
    """(fork-rule): :func:`normbook.add_layer_norm` on the kernel backend: h = x + residual,
    y = LayerNorm(h) over the last dim, in one pass (x and the residual read once, h written once).

    Args:
        x, residual: ``(..., D)``, of one dtype and device.
        weight, bias: (D,) or None.
        eps: added to the variance inside the square root.

    Returns:
        (y, h), both of x's shape and dtype.
    """
    return _F._add_norm(x, residual, weight, bias, _F._ln_eps(eps), False, kernels=True)


def add_rms_norm(x, residual, weight=None, eps=None):
    """(fork-rule): :func:`normbook.add_rms_norm` on the kernel backend: h = x + residual,
    y = RMSNorm(h) over the last dim, in one pass.

    Args:
        x, residual: ``(..., D)``, of one dtype and device.
        weight: (D,) or None.
        eps: added to the mean square inside the square root; None: fp32's machine epsilon.

    Returns:
        (y, h), both of x's shape and dtype.
    """
    return _F._add_norm(x, residual, weight, _F._NO_BIAS, _F._rms_eps(x, eps), True,
                        kernels=True)


if _F._DTensor is not None:
    from normbook.kernels import _dtensor  # noqa: E402,F401  (registers the sharding rules)
