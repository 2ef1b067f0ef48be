"""The kernels with autograd: an eager path as light as torch's, and custom ops for torch.compile.

Two routes reach the same launchers (``_forward.norm_forward``, ``_backward.norm_backward``):

- **eager** (the usual case): :class:`NormFunction`, a ``torch.autograd.Function`` whose
  forward and backward call the launchers directly. Host cost per call is what matters here
  (a small batch is over on the GPU in microseconds), so the path is kept short:
  checks of a few attribute reads, cached launch configurations, no Triton helper objects.
- **torch.compile** (``torch.compiler.is_compiling()``): the custom ops
  ``normbook::norm_forward`` and ``normbook::norm_backward``, each with a fake (shape-only)
  implementation and the forward with an autograd formula, so ``torch.compile(fullgraph=True)``
  traces a model through them without a graph break.

Both routes share ``_setup_context`` and ``_grad``; the public functions validate, flatten
``(..., *normalized_shape)`` to ``(M, D)``, pick the route and restore the shape.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.autograd.forward_ad as _fwAD
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from normbook import _math, _validate
from normbook.kernels import _backward, _forward

__all__ = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "NormFunction", "EagerNormFunction"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

try:   # DTensor inputs take the custom ops, whose sharding rules live in _dtensor
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:   # pragma: no cover - a torch built without torch.distributed
    _DTensor = None
_SUBCLASSES = () if _DTensor is None else (_DTensor,)   # tensor types that take the custom ops

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


def _save(ctx, x, residual, weight, bias, eps, is_rms, h, stats):
    """What backward needs: the normalized input (h when the add is fused) and two fp32 scalars
    per row (one for RMSNorm) instead of the D values of xhat. Returns what it saved."""
    saved = (h if residual is not None else x, weight, stats)
    ctx.save_for_backward(*saved)
    if residual is not None:   # an unused h gets None, not a tensor of zeros to read
        ctx.set_materialize_grads(False)
    ctx.meta = (residual is not None, None if bias is None else bias.dtype, is_rms, eps)
    return saved


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, is_rms = inputs
    _, h, stats = output
    saved = _save(ctx, x, residual, weight, bias, eps, is_rms, h, stats)
    if _fwAD._current_level >= 0 or torch._C._are_functorch_transforms_active():
        ctx.save_for_forward(*saved)   # forward-mode AD (jvp) reads them too
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)   # nor zeros for the statistics' gradient


def _math_grad(dy, dh, x, weight, stats, bias_dtype, is_rms, eps):
    """The backward in differentiable torch ops (normbook._math) instead of the kernels, for a
    backward that is itself differentiated (double backward, torch.func): the statistics are
    recomputed from x so that their dependence on x is part of the graph. fp32 inside."""
    xf = x.float()
    wf = None if weight is None else weight.float()
    mean, rstd = _math.stats(xf, eps, is_rms)
    dx, dweight, dbias = _math.backward(dy.float(), xf, wf, mean, rstd, bias_dtype is not None)
    if dh is not None:
        dx = dx + dh                                    # fork rule
    return (dx.to(x.dtype), None if weight is None else dweight.to(weight.dtype),
            None if bias_dtype is None else dbias.to(bias_dtype))


def _grad(ctx, dy, dh, backward):
    """Gradients of (x, residual, weight, bias, eps, is_rms) from those of (y, h)."""
    x, weight, stats = ctx.saved_tensors
    has_residual, bias_dtype, is_rms, eps = ctx.meta
    if torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
        # a graph of the backward is being built, or a transform wraps the tensors: torch ops
        dy = torch.zeros_like(x) if dy is None else dy
        dh = dh if has_residual else None
        dx, dweight, dbias = _math_grad(dy, dh, x, weight, stats, bias_dtype, is_rms, eps)
        return dx, dx if has_residual else None, dweight, dbias, None, None
    if dy is None:                      # only h was used downstream
        dy = torch.zeros_like(x)
    elif dy.stride(-1) != 1:            # incoming gradients may be any view (an expand, say)
        dy = _rows(dy) if x.dim() == 2 else dy.contiguous()
    dh = (_rows(dh) if x.dim() == 2 else dh) if has_residual and dh is not None else None
    dx, dweight, dbias = backward(dy, dh, x, weight, stats, bias_dtype, is_rms)
    # fork rule: h = x + residual, so x and the residual receive the same gradient
    return (dx, dx if has_residual else None, dweight if weight is not None else None,
            dbias if bias_dtype is not None else None, None, None)


def _op_grad(ctx, dy, dh, dstats):
    return _grad(ctx, dy, dh, norm_backward)


norm_forward.register_autograd(_op_grad, setup_context=_setup_context)


class NormFunction(torch.autograd.Function):
    """The eager route: the same forward and backward as the custom ops, without the dispatcher.

    ``apply(x, residual, weight, bias, eps, is_rms) -> (y, h, stats)`` on (M, D) rows; h is
    None without a residual.
    """

    forward = staticmethod(_forward.norm_forward)
    setup_context = staticmethod(_setup_context)

    @staticmethod
    def backward(ctx, dy, dh, dstats):
        return _grad(ctx, dy, dh, _backward.norm_backward)

    @staticmethod
    def jvp(ctx, tx, tresidual, tweight, tbias, teps, tis_rms):
        """Forward-mode tangents of (y, h): th = tx + tresidual, ty = J th (ln-jac) plus the
        parameters' terms, in torch ops on the saved statistics."""
        x, weight, stats = ctx.saved_tensors
        has_residual, _, is_rms, _ = ctx.meta
        th = tx
        if has_residual and tresidual is not None:
            th = tresidual if th is None else th + tresidual
        mean = None if is_rms else stats[0][:, None]
        rstd = stats[-1][:, None]
        ty = _math.jvp(None if th is None else th.float(), None if tweight is None else tweight.float(),
                       None if tbias is None else tbias.float(), x.float(),
                       None if weight is None else weight.float(), mean, rstd)
        th_out = None if not has_residual else (torch.zeros_like(x) if th is None else th)
        return ty.to(x.dtype), th_out, None

    @staticmethod
    def vmap(info, in_dims, x, residual, weight, bias, eps, is_rms):
        """vmap: the norm is per row, so a batch of inputs is more rows. With unbatched
        parameters the batch folds into M and the kernels run once; batched parameters (rare:
        per-sample weights) take torch ops."""
        B = info.batch_size
        xd, rd, wd, bd = in_dims[:4]
        x = _batch_first(x, xd, B)                          # (B, M, D)
        residual = None if residual is None else _batch_first(residual, rd, B)
        _, M, D = x.shape
        k = 1 if is_rms else 2
        if wd is None and bd is None:
            y, h, stats = NormFunction.apply(
                x.reshape(B * M, D), None if residual is None else residual.reshape(B * M, D),
                weight, bias, eps, is_rms)
            return ((y.view(B, M, D), None if h is None else h.view(B, M, D), stats.view(k, B, M)),
                    (0, None if h is None else 0, 1))
        weight = None if weight is None else _batch_first(weight, wd, B)[:, None, :]   # (B, 1, D)
        bias = None if bias is None else _batch_first(bias, bd, B)[:, None, :]
        h = x if residual is None else x + residual
        y, mean, rstd = _math.forward(h.float(), None if weight is None else weight.float(),
                                      None if bias is None else bias.float(), eps, is_rms)
        stats = rstd[..., 0][None] if is_rms else torch.stack([mean[..., 0], rstd[..., 0]])
        return ((y.to(x.dtype), None if residual is None else h, stats),
                (0, None if residual is None else 0, 1))


class EagerNormFunction(torch.autograd.Function):
    """:class:`NormFunction` in torch's original form, for plain eager calls.

    ``apply(x, residual, weight, bias, eps, is_rms) -> (y, h)``. The forward takes ``ctx`` and
    saves what backward needs itself, and the statistics are not an output: one Python call and
    one output fewer, about 1 us of the 3 us a norm costs beyond torch's own
    (``python -m normbook.bench host``). torch.func transforms and forward-mode AD need the
    modern form (setup_context, jvp, vmap), so :func:`_route` sends those calls to
    :class:`NormFunction`; the backward is the same function.
    """

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, is_rms):
        y, h, stats = _forward.norm_forward(x, residual, weight, bias, eps, is_rms)
        _save(ctx, x, residual, weight, bias, eps, is_rms, h, stats)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        return _grad(ctx, dy, dh, _backward.norm_backward)


# torch's Function.apply binds arguments with inspect.signature only for the modern form, and
# unwraps dead torch.func wrappers only for a transform's leftovers: the C++ apply is enough here
_eager_apply = super(torch.autograd.Function, EagerNormFunction).apply


def _batch_first(t, dim, B):
    """t with its vmapped dim first, or expanded to B copies when it is not batched."""
    return t.expand(B, *t.shape) if dim is None else t.movedim(dim, 0)


def _route(x=None):
    """What runs a norm on (M, D) rows, ``(x, residual, weight, bias, eps, is_rms) -> (y, h, ...)``:
    the custom op under torch.compile and for a DTensor ``x`` (whose sharding rules DTensor
    looks up by op), :class:`NormFunction` under torch.func transforms and forward-mode AD,
    :class:`EagerNormFunction` otherwise (the usual, host-time-bound case)."""
    if torch.compiler.is_compiling() or (type(x) is not Tensor and isinstance(x, _SUBCLASSES)):
        return norm_forward
    if _fwAD._current_level >= 0 or torch._C._are_functorch_transforms_active():
        return NormFunction.apply
    return _eager_apply


# ----------------------------------------------------------------------------- argument checks

def _check_device(t: Tensor, name: str) -> None:
    if t.is_cuda or (_INTERPRETED and t.device.type == "cpu"):
        return
    if t.device.type == "cpu":
        raise ValueError(f"{name}: expected a CUDA tensor, got a CPU tensor while Triton's interpreter "
                         "is off; set TRITON_INTERPRET=1 in the environment before triton is imported "
                         "to run the kernels on the CPU")
    raise ValueError(f"{name}: expected a CUDA tensor (or a CPU tensor under TRITON_INTERPRET=1), "
                     f"got device {t.device}")


def _check_kernel_input(t, name: str) -> None:
    _validate.check_input(t, name)
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: the Triton kernels take float16, bfloat16 or float32, got {t.dtype}"
                        " (normbook.layer_norm / normbook.rms_norm compute float64 on the reference path)")
    _check_device(t, name)


def _prepare(input, normalized_shape, eps, weight, bias, residual=None, name="input"):
    """Validate; return (x, residual, weight, bias) as (M, D) rows and contiguous (D,) vectors.

    The common case is recognised in a few attribute reads: a kernel-dtype tensor on a kernel
    device whose last dim is D, parameters None or (D,) on its device, eps a float. Anything
    else goes through the full checks, which raise with a message or accept the rare case.
    """
    t = type(normalized_shape)
    D = normalized_shape if t is int else (
        normalized_shape[0] if t in (tuple, list, torch.Size) and len(normalized_shape) == 1 else None)
    fast = (D is not None and isinstance(input, Tensor) and input.dtype in SUPPORTED_DTYPES
            and input.ndim and input.shape[-1] == D and type(eps) is float
            and (input.is_cuda or (_INTERPRETED and input.is_cpu)))
    if fast:
        for p in (weight, bias):
            if p is not None and p is not _NO_BIAS and not (
                    isinstance(p, Tensor) and p.ndim == 1 and p.shape[0] == D
                    and p.dtype in SUPPORTED_DTYPES and p.device == input.device):
                fast = False
    if not fast:
        _check_kernel_input(input, name)
        params = {"weight": weight} if bias is _NO_BIAS else {"weight": weight, "bias": bias}
        shape = _validate.check_norm_args(input, normalized_shape, params, eps, name, SUPPORTED_DTYPES)
        D = math.prod(shape)
        input = input.reshape(*input.shape[: input.dim() - len(shape)], D)
        weight = None if weight is None else weight.reshape(D)
        bias = None if bias is None or bias is _NO_BIAS else bias.reshape(D)
    if residual is not None:
        if not (isinstance(residual, Tensor) and residual.shape == input.shape
                and residual.dtype == input.dtype and residual.device == input.device):
            _check_residual(residual, input)
        residual = _rows_or_self(residual)
    x = input if input.ndim == 2 and input.stride(1) == 1 else _rows_or_self(input)
    return (x, residual, None if weight is None else weight.contiguous(),
            None if bias is None or bias is _NO_BIAS else bias.contiguous())


_NO_BIAS = object()   # RMSNorm has no bias argument at all (so none is named in its errors)


def _check_residual(residual, input) -> None:
    _validate.check_input(residual, "residual")
    if residual.shape != input.shape:
        raise ValueError(f"residual: expected x's shape {tuple(input.shape)}, got {tuple(residual.shape)}")
    if residual.dtype != input.dtype:
        raise TypeError(f"residual: expected x's dtype {input.dtype}, got {residual.dtype}")
    if residual.device != input.device:
        raise ValueError(f"residual: expected x's device {input.device}, got {residual.device}")


# ----------------------------------------------------------------------------- public API

def _rows_or_self(t: Tensor) -> Tensor:
    """:func:`_rows` of a plain tensor; a DTensor keeps its leading dims (flattening (B, T)
    sharded over T would all-gather it), and the custom op flattens each rank's shard."""
    return t if type(t) is not Tensor and isinstance(t, _SUBCLASSES) else _rows(t)


def _restore(out: Tensor, input: Tensor) -> Tensor:
    """(M, D) rows back to input's shape (a view; none needed for a 2-D input)."""
    return out if input.dim() == 2 else out.view(input.shape)



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
    eps = eps if type(eps) is float else _validate.as_eps(eps)
    x, _, w, b = _prepare(input, normalized_shape, eps, weight, bias)
    y = _route(x)(x, None, w, b, eps, False)[0]
    return y if x is input else y.view(input.shape)   # (M, D) rows back to the input's shape


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
    if type(eps) is not float:
        eps = _validate.as_eps(_validate.default_eps(input, eps))
    x, _, w, _ = _prepare(input, normalized_shape, eps, weight, _NO_BIAS)
    y = _route(x)(x, None, w, None, eps, True)[0]
    return y if x is input else y.view(input.shape)   # (M, D) rows back to the input's shape


def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5):
    """(fork-rule): h = x + residual, y = LayerNorm(h) over the last dim, in one pass.

    x and the residual are each read once, h is written once. In backward, h forks into the
    norm and the next residual branch, so its gradient is the sum of both, and that sum is the
    gradient of x and of the residual alike ("Residual connections").

    Args:
        x, residual: ``(..., D)``, of one dtype and device.
        weight, bias: (D,) or None.
        eps: added to the variance inside the square root.

    Returns:
        (y, h), both of x's shape and dtype.
    """
    eps = eps if type(eps) is float else _validate.as_eps(eps)
    D = x.shape[-1] if isinstance(x, Tensor) and x.dim() > 0 else 0
    xs, r, w, b = _prepare(x, D, eps, weight, bias, residual=residual, name="x")
    out = _route(xs)(xs, r, w, b, eps, False)
    return _restore(out[0], x), _restore(out[1], x)


def add_rms_norm(x, residual, weight=None, eps=None):
    """(fork-rule): h = x + residual, y = RMSNorm(h) over the last dim, in one pass.

    Forward (rms-ms), (rms-y) on h; gradient (rms-dx) plus the gradient arriving at h. As
    :func:`add_layer_norm` without the mean and the bias.

    Args:
        x, residual: ``(..., D)``, of one dtype and device.
        weight: (D,) or None.
        eps: added to the mean square inside the square root; None means
            ``torch.finfo(x.dtype).eps``, as in torch.

    Returns:
        (y, h), both of x's shape and dtype.
    """
    if type(eps) is not float:
        eps = _validate.as_eps(_validate.default_eps(x, eps))
    D = x.shape[-1] if isinstance(x, Tensor) and x.dim() > 0 else 0
    xs, r, w, _ = _prepare(x, D, eps, weight, _NO_BIAS, residual=residual, name="x")
    out = _route(xs)(xs, r, w, None, eps, True)
    return _restore(out[0], x), _restore(out[1], x)


if _DTensor is not None:
    from normbook.kernels import _dtensor  # noqa: E402,F401  (registers the sharding rules)
