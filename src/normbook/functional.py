"""The public functional API: ``normbook.layer_norm`` and ``normbook.rms_norm``.

Signatures, defaults and accepted inputs mirror ``torch.nn.functional``. A CUDA tensor, with
Triton installed, goes to the fused kernels in :mod:`normbook.kernels`; everything else goes to
an autograd Function whose backward is the book's hand-derived one from
:mod:`normbook.reference`, so a reader on a CPU trains through the book's own equations.
"""

from __future__ import annotations

import importlib.util
import math

import torch
from torch.autograd.function import once_differentiable

from normbook import _validate, reference

__all__ = ["layer_norm", "rms_norm"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reductions run in at least fp32: bf16/fp16 inputs are upcast, fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _use_kernels(input: torch.Tensor) -> bool:
    """CUDA tensors in a kernel dtype go to Triton; float64 stays on the reference (the oracle)."""
    return (input.is_cuda and input.dtype in _KERNEL_DTYPES
            and importlib.util.find_spec("triton") is not None)


class _LayerNormFunction(torch.autograd.Function):
    """y = LayerNorm(x) with the backward of equation (ln-dx); x is (..., D)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        ct = _compute_dtype(x.dtype)
        w = None if weight is None else weight.to(ct)
        b = None if bias is None else bias.to(ct)
        y, mean, rstd = reference.layer_norm_forward(x.to(ct), w, b, eps)
        # two fp32 scalars per token instead of D values of xhat
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.param_dtypes = (None if weight is None else weight.dtype,
                            None if bias is None else bias.dtype)
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, w, mean, rstd = ctx.saved_tensors
        ct = mean.dtype
        dx, dweight, dbias = reference.layer_norm_backward(dy.to(ct), x.to(ct), w, mean, rstd)
        wdt, bdt = ctx.param_dtypes
        dweight = None if wdt is None else dweight.to(wdt)
        dbias = None if bdt is None else dbias.to(bdt)
        return dx.to(x.dtype), dweight, dbias, None


class _RMSNormFunction(torch.autograd.Function):
    """y = RMSNorm(x) with the backward of equation (rms-dx); x is (..., D)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ct = _compute_dtype(x.dtype)
        w = None if weight is None else weight.to(ct)
        y, rstd = reference.rms_norm_forward(x.to(ct), w, eps)
        ctx.save_for_backward(x, w, rstd)  # one fp32 scalar per token
        ctx.weight_dtype = None if weight is None else weight.dtype
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        ct = rstd.dtype
        dx, dweight = reference.rms_norm_backward(dy.to(ct), x.to(ct), w, rstd)
        dweight = None if ctx.weight_dtype is None else dweight.to(ctx.weight_dtype)
        return dx.to(x.dtype), dweight, None


def _flatten(input, shape, *params):
    """(..., *normalized_shape) -> (..., D) and each parameter -> (D,)."""
    D = math.prod(shape)
    x = input.reshape(*input.shape[: input.dim() - len(shape)], D)
    return (x, *(None if p is None else p.reshape(D) for p in params))


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """LayerNorm over the trailing ``normalized_shape`` dims, as ``torch.nn.functional.layer_norm``.

    Implements equations (ln-mean) to (ln-y) of the chapter "One token's vector":
    y = (x - mean) / sqrt(var + eps) * weight + bias, with mean and the biased variance
    (dividing by D) taken over the trailing dims of each token separately. Its gradient is
    (ln-dparams) and (ln-dx) of "The backward pass".

    Args:
        input: ``(*, *normalized_shape)`` floating tensor.
        normalized_shape: int or sequence of ints, the trailing dims to normalize over
            (D = their product).
        weight: optional ``(*normalized_shape)`` scale gamma.
        bias: optional ``(*normalized_shape)`` shift beta.
        eps: added to the variance inside the square root.

    Returns:
        Tensor of input's shape and dtype. CUDA inputs use the Triton kernels when Triton is
        installed; all others the reference autograd Function (fp32 reductions for bf16/fp16).
    """
    shape = _validate.check_norm_args(input, normalized_shape, {"weight": weight, "bias": bias}, eps)
    x, w, b = _flatten(input, shape, weight, bias)
    if _use_kernels(input):
        from normbook import kernels

        y = kernels.layer_norm(x, (x.shape[-1],), w, b, eps)
    else:
        y = _LayerNormFunction.apply(x, w, b, float(eps))
    return y.reshape(input.shape)


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """RMSNorm over the trailing ``normalized_shape`` dims, as ``torch.nn.functional.rms_norm``.

    Implements equations (rms-ms) and (rms-y) of the chapter "One token's vector":
    y = x / sqrt(mean(x^2) + eps) * weight, with no centring and no bias. Its gradient is
    (rms-dx) of "RMSNorm".

    Args:
        input: ``(*, *normalized_shape)`` floating tensor.
        normalized_shape: int or sequence of ints, the trailing dims to normalize over.
        weight: optional ``(*normalized_shape)`` scale gamma.
        eps: added to the mean square inside the square root; None means
            ``torch.finfo(input.dtype).eps``, as in torch.

    Returns:
        Tensor of input's shape and dtype.
    """
    eps = _validate.default_eps(input, eps)
    shape = _validate.check_norm_args(input, normalized_shape, {"weight": weight}, eps)
    x, w = _flatten(input, shape, weight)
    if _use_kernels(input):
        from normbook import kernels

        y = kernels.rms_norm(x, (x.shape[-1],), w, eps)
    else:
        y = _RMSNormFunction.apply(x, w, float(eps))
    return y.reshape(input.shape)
