"""The kernels' custom ops, and :mod:`normbook.kernels`' public functions.

The public functions here are thin aliases of :func:`normbook.layer_norm` and its kin that force
the kernel backend: the one front door (:mod:`normbook.functional`) validates and flattens each
call once and applies the one autograd Function, ``normbook.functional.NormFunction``, whose
kernel backend calls the launchers (``_forward.norm_forward``, ``_backward.norm_backward``)
directly in eager mode.

Under ``torch.compile``, and for a DTensor, that Function calls the launchers through the custom
ops ``torch.ops.normbook.norm_forward`` and ``norm_backward`` (defined in ``normbook._ops``,
without Triton, and named here too): each has a fake
(shape-only) implementation, so Dynamo traces the Function through them without a graph break,
and sharding rules (:mod:`normbook.kernels._dtensor`), so that DTensor runs them on each rank's
rows. Autograd is the Function's; ``norm_forward``'s own formula serves graphs that hold the
op itself (an exported program).
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from normbook import functional as _F
# the custom ops: defined by import normbook, without Triton (see normbook._ops)
from normbook._ops import _rows, norm_backward, norm_forward  # noqa: F401
from normbook.kernels import _backward, _forward

__all__ = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "norm_forward", "norm_backward"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# decided once, when triton decorated the kernels
_INTERPRETED = isinstance(_forward.norm_fwd_rows_kernel, InterpretedFunction)
# TRITON_INTERPRET=1 set after triton was imported but before these kernels: they are
# interpreted, triton.language's own @jit helpers (decorated at its import) are not, and a
# launch fails inside Triton ("Cannot call @triton.jit'd outside of the scope of a kernel")
_HELPER = getattr(importlib.import_module("triton.language.standard"), "sigmoid", None)
LATE_INTERPRET = (_INTERPRETED and _HELPER is not None
                  and not isinstance(_HELPER, InterpretedFunction))
LATE_MESSAGE = ("TRITON_INTERPRET=1 was set after triton was imported: Triton reads it once, "
                "at its import; restart Python with it set before anything imports triton")
if _INTERPRETED:   # the interpreter without its rescans of triton.language (same bits, ~2x
    from normbook.kernels import _interpret   # faster), rounding to bfloat16 as a GPU does

    _interpret.install()
    _interpret.install_rounding()


def interpreted() -> bool:
    """True when TRITON_INTERPRET=1 was set before triton was imported: kernels run on the CPU."""
    return _INTERPRETED


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
        Tensor: of input's shape and dtype (also when weight is fp32 and input bf16). Rows wider
            than the device's programs can share are computed by the torch backend, with a warning.
    """
    if type(input) is not Tensor and isinstance(input, _F._Proxy):   # torch.fx.symbolic_trace
        return _F._fx_node(layer_norm, input, normalized_shape, weight, bias, eps)
    return _F._norm(input, normalized_shape, weight, bias, _F._ln_eps(eps), False, kernels=True)[0]


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """(rms-y): :func:`normbook.rms_norm` on the kernel backend, as ``torch.nn.functional.rms_norm``.

    Forward (rms-ms), (rms-y) of "One token's vector": y = x / sqrt(mean(x^2) + eps) * weight;
    gradient (rms-dx) of "RMSNorm". float64 (input or weight) is refused: use
    :func:`normbook.rms_norm`, whose torch backend computes in it.

    Args:
        input: ``(*, *normalized_shape)`` float16, bfloat16 or float32; CUDA, or CPU under
            TRITON_INTERPRET=1.
        normalized_shape: int or sequence, the trailing dims to normalize over.
        weight: optional, of shape ``normalized_shape``, any of the three dtypes.
        eps: inside the square root; None means fp32's machine epsilon, as torch computes.

    Returns:
        Tensor: of input's shape and dtype.
    """
    if type(input) is not Tensor and isinstance(input, _F._Proxy):   # torch.fx.symbolic_trace
        return _F._fx_node(rms_norm, input, normalized_shape, weight, eps)
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
        tuple: (y, h), both of x's shape and dtype.
    """
    if (type(x) is not Tensor or type(residual) is not Tensor) and (
            isinstance(x, _F._Proxy) or isinstance(residual, _F._Proxy)):   # torch.fx.symbolic_trace
        return _F._fx_node(add_layer_norm, x, residual, weight, bias, eps)
    return _F._add_norm(x, residual, weight, bias, _F._ln_eps(eps), False, kernels=True)


def add_rms_norm(x, residual, weight=None, eps=None):
    """(fork-rule): :func:`normbook.add_rms_norm` on the kernel backend: h = x + residual,
    y = RMSNorm(h) over the last dim, in one pass.

    Args:
        x, residual: ``(..., D)``, of one dtype and device.
        weight: (D,) or None.
        eps: added to the mean square inside the square root; None: fp32's machine epsilon.

    Returns:
        tuple: (y, h), both of x's shape and dtype.
    """
    if (type(x) is not Tensor or type(residual) is not Tensor) and (
            isinstance(x, _F._Proxy) or isinstance(residual, _F._Proxy)):   # torch.fx.symbolic_trace
        return _F._fx_node(add_rms_norm, x, residual, weight, eps)
    return _F._add_norm(x, residual, weight, _F._NO_BIAS, _F._rms_eps(x, eps), True,
                        kernels=True)


# DTensor's sharding rules, where torch has torch.distributed. Registered with the kernels, not
# by ``import normbook``: torch.distributed.tensor takes a second to import (a third of
# ``import normbook``), and the torch backend needs no rules (DTensor runs its torch ops).
if torch.distributed.is_available():
    from normbook.kernels import _dtensor  # noqa: E402,F401  (registers the sharding rules)
