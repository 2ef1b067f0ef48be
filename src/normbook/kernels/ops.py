"""The kernels as torch custom ops with autograd, and the four public functions.

Two ops carry everything: ``normbook::norm_forward`` (both norms, with or without the fused
residual add) and ``normbook::norm_backward``. Each has a fake (shape-only) implementation, so
``torch.compile(fullgraph=True)`` traces a model through them without a graph break, and the
forward has an autograd formula that calls the backward op. The public functions validate,
flatten ``(..., *normalized_shape)`` to ``(M, D)``, call the op and restore the shape.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from normbook import _validate
from normbook.functional import _flatten
from normbook.kernels import _backward, _forward

__all__ = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreted() -> bool:
    """True when TRITON_INTERPRET=1 was set before triton was imported: kernels run on the CPU."""
    return isinstance(_forward.norm_fwd_rows_kernel, InterpretedFunction)


def _rows(t: Tensor) -> Tensor:
    """(..., D) -> (M, D) with a unit stride along D. Row strides are kept (a slice of a wider
    tensor is read in place); only a non-contiguous last dim is copied."""
    t = t.reshape(-1, t.shape[-1])
    return t.contiguous() if t.stride(-1) != 1 and t.shape[-1] > 1 else t


# ----------------------------------------------------------------------------- custom ops

@torch.library.custom_op("normbook::norm_forward", mutates_args=())
def norm_forward(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor],
                 bias: Optional[Tensor], eps: float, is_rms: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(ln-y) or (rms-y) on (M, D) rows: returns y, s (empty without residual), mean (empty for RMSNorm), rstd."""
    return _forward.norm_forward(x, residual, weight, bias, eps, is_rms)


@norm_forward.register_fake
def _(x, residual, weight, bias, eps, is_rms):
    M, D = x.shape
    f32 = torch.float32
    return (x.new_empty((M, D)), x.new_empty((M, D) if residual is not None else (0,)),
            x.new_empty((0,) if is_rms else (M,), dtype=f32), x.new_empty((M,), dtype=f32))


@torch.library.custom_op("normbook::norm_backward", mutates_args=())
def norm_backward(dy: Tensor, ds: Optional[Tensor], x: Tensor, weight: Optional[Tensor], mean: Tensor,
                  rstd: Tensor, has_bias: bool, is_rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(ln-dx) or (rms-dx), (ln-dparams) and the (fork-rule): returns dx and fp32 dweight, dbias (empty if absent)."""
    return _backward.norm_backward(dy, ds, x, weight, mean, rstd, has_bias, is_rms)


@norm_backward.register_fake
def _(dy, ds, x, weight, mean, rstd, has_bias, is_rms):
    D = x.shape[1]
    f32 = torch.float32
    return (x.new_empty(x.shape), x.new_empty((D,) if weight is not None else (0,), dtype=f32),
            x.new_empty((D,) if has_bias else (0,), dtype=f32))


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, is_rms = inputs
    _, s, mean, rstd = output
    # backward needs the normalized input (s when the add is fused) and two fp32 scalars per row
    ctx.save_for_backward(s if residual is not None else x, weight, mean, rstd)
    ctx.has_residual = residual is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.is_rms = is_rms


def _grad(ctx, dy, ds, dmean, drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dy = _rows(dy) if dy is not None else torch.zeros_like(x)
    ds = _rows(ds) if ctx.has_residual and ds is not None else None
    dx, dweight, dbias = norm_backward(dy, ds, x, weight, mean, rstd, ctx.bias_dtype is not None, ctx.is_rms)
    # fork rule: s = x + residual, so x and the residual receive the same gradient
    dresidual = dx if ctx.has_residual else None
    dweight = dweight.to(weight.dtype) if weight is not None else None
    dbias = dbias.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
    return dx, dresidual, dweight, dbias, None, None


norm_forward.register_autograd(_grad, setup_context=_setup_context)


# ----------------------------------------------------------------------------- argument checks

def _check_kernel_input(t: Tensor, name: str) -> None:
    _validate.check_input(t, name)
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: the Triton kernels take float16, bfloat16 or float32, got {t.dtype}"
                        " (normbook.layer_norm / normbook.rms_norm compute float64 on the reference path)")
    if t.device.type == "cuda" or (t.device.type == "cpu" and interpreted()):
        return
    if t.device.type == "cpu":
        raise ValueError(f"{name}: expected a CUDA tensor, got a CPU tensor while Triton's interpreter "
                         "is off; set TRITON_INTERPRET=1 in the environment before triton is imported "
                         "to run the kernels on the CPU")
    raise ValueError(f"{name}: expected a CUDA tensor (or a CPU tensor under TRITON_INTERPRET=1), "
                     f"got device {t.device}")


def _prepare(input, normalized_shape, eps, params: dict, residual=None, name="input"):
    """Validate; return (x, residual, *params) as (M, D) rows and (D,) vectors."""
    _check_kernel_input(input, name)
    shape = _validate.check_norm_args(input, normalized_shape, params, eps, name, SUPPORTED_DTYPES)
    x, *flat = _flatten(input, shape, *params.values())
    x = _rows(x)
    if residual is not None:
        _validate.check_input(residual, "residual")
        if residual.shape != input.shape:
            raise ValueError(f"residual: expected x's shape {tuple(input.shape)}, got {tuple(residual.shape)}")
        if residual.dtype != input.dtype:
            raise TypeError(f"residual: expected x's dtype {input.dtype}, got {residual.dtype}")
        if residual.device != input.device:
            raise ValueError(f"residual: expected x's device {input.device}, got {residual.device}")
        residual = _rows(_flatten(residual, shape)[0])
    return x, residual, *(None if p is None else p.contiguous() for p in flat)


# ----------------------------------------------------------------------------- public API

def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """(ln-y): LayerNorm by the fused Triton kernels, as ``torch.nn.functional.layer_norm``.

    Forward (ln-mean) to (ln-y) of "One token's vector"; gradient (ln-dx) and (ln-dparams) of
    "The backward pass". Statistics in fp32 (biased variance, eps inside the root).
    float64 is refused: use :func:`normbook.layer_norm`, whose reference path computes in it.

    Args:
        input: ``(*, *normalized_shape)`` float16, bfloat16 or float32; CUDA, or CPU under
            TRITON_INTERPRET=1.
        normalized_shape: int or sequence, the trailing dims to normalize over (D = product).
        weight, bias: optional, of shape ``normalized_shape``, any of the three dtypes.
        eps: added to the variance inside the square root.

    Returns:
        Tensor of input's shape and dtype (also when weight is fp32 and input bf16).
    """
    x, _, w, b = _prepare(input, normalized_shape, eps, {"weight": weight, "bias": bias})
    y = norm_forward(x, None, w, b, float(eps), False)[0]
    return y.reshape(input.shape)


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """(rms-y): RMSNorm by the fused Triton kernels, as ``torch.nn.functional.rms_norm``.

    Forward (rms-ms), (rms-y) of "One token's vector"; gradient (rms-dx) of "RMSNorm".

    Args:
        input: ``(*, *normalized_shape)`` float16, bfloat16 or float32.
        normalized_shape: int or sequence, the trailing dims to normalize over.
        weight: optional, of shape ``normalized_shape``.
        eps: inside the square root; None means ``torch.finfo(input.dtype).eps``, as in torch.

    Returns:
        Tensor of input's shape and dtype.
    """
    eps = _validate.default_eps(input, eps)
    x, _, w = _prepare(input, normalized_shape, eps, {"weight": weight})
    y = norm_forward(x, None, w, None, float(eps), True)[0]
    return y.reshape(input.shape)


def add_layer_norm(x, residual, weight, bias, eps=1e-5):
    """(fork-rule): s = x + residual, y = LayerNorm(s) over the last dim, in one pass.

    x and the residual are each read once, s is written once. In backward, s forks into the
    norm and the next residual branch, so its gradient is the sum of both, and that sum is the
    gradient of x and of the residual alike ("Residual connections").

    Args:
        x, residual: ``(..., D)``, of one dtype and device.
        weight, bias: (D,) or None.
        eps: added to the variance inside the square root.

    Returns:
        (y, s), both of x's shape and dtype.
    """
    D = x.shape[-1] if isinstance(x, Tensor) and x.dim() > 0 else 0
    xs, r, w, b = _prepare(x, D, eps, {"weight": weight, "bias": bias}, residual=residual, name="x")
    y, s, _, _ = norm_forward(xs, r, w, b, float(eps), False)
    return y.reshape(x.shape), s.reshape(x.shape)


def add_rms_norm(x, residual, weight, eps=None):
    """(fork-rule): s = x + residual, y = RMSNorm(s) over the last dim, in one pass.

    Forward (rms-ms), (rms-y) on s; gradient (rms-dx) plus the gradient arriving at s. As
    :func:`add_layer_norm` without the mean and the bias.

    Args:
        x, residual: ``(..., D)``, of one dtype and device.
        weight: (D,) or None.
        eps: added to the mean square inside the square root; None means
            ``torch.finfo(x.dtype).eps``, as in torch.

    Returns:
        (y, s), both of x's shape and dtype.
    """
    eps = _validate.default_eps(x, eps)
    D = x.shape[-1] if isinstance(x, Tensor) and x.dim() > 0 else 0
    xs, r, w = _prepare(x, D, eps, {"weight": weight}, residual=residual, name="x")
    y, s, _, _ = norm_forward(xs, r, w, None, float(eps), True)
    return y.reshape(x.shape), s.reshape(x.shape)
