"""The public functional API: ``normbook.layer_norm`` and ``normbook.rms_norm``.

Signatures, defaults and accepted inputs mirror ``torch.nn.functional``. A CUDA tensor, with
Triton installed, goes to the fused kernels in :mod:`normbook.kernels`; everything else goes to
an autograd Function whose backward is the book's hand-derived one, (ln-dx) and (rms-dx), so a
reader on a CPU trains through the book's own equations. It computes them with
:mod:`normbook._math`: the formulas of :mod:`normbook.reference` with torch's vectorised
reductions in place of its einsum strings (accurate in fp32 at any D) and a variance that does
not overflow.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math

import torch
from normbook import _math, _validate

__all__ = ["layer_norm", "rms_norm", "backend"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reductions run in at least fp32: bf16/fp16 inputs are upcast, fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BACKENDS = ("auto", "kernels", "torch")
_backend = "auto"          # see backend()


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_kernels(input) -> bool:
    """Whether the Triton kernels compute this call (see :func:`backend`): by default CUDA
    tensors in a kernel dtype, when Triton is installed; float64 stays on the torch ops (the
    oracle's precision)."""
    if _backend == "auto":
        return (isinstance(input, torch.Tensor) and input.is_cuda
                and input.dtype in _KERNEL_DTYPES and _triton_installed())
    return _backend == "kernels"


@contextlib.contextmanager
def backend(name: str):
    """Choose, inside a ``with`` block, what computes :func:`normbook.layer_norm`,
    :func:`normbook.rms_norm` and the modules :class:`normbook.LayerNorm`,
    :class:`normbook.RMSNorm`.

    Args:
        name: ``"auto"`` (the default outside any block): the Triton kernels for CUDA tensors
            in float16, bfloat16 or float32 when Triton is installed, the book's formulas in
            torch ops for everything else; ``"kernels"``: always the kernels (as
            :mod:`normbook.kernels` is called; on CPU tensors only under TRITON_INTERPRET=1,
            in Triton's interpreter); ``"torch"``: always the torch ops, which also compute
            float64 and every transform.

    The choice is process-wide while the block runs (not per thread), and the previous one
    comes back when it ends. Example::

        with normbook.backend("torch"):
            y = model(x)        # the hand-derived backward on a GPU too, for comparison
    """
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, _BACKENDS))}, got {name!r}")
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


class _NormFunction(torch.autograd.Function):
    """The CPU (and float64) path of both norms: forward and backward, in torch ops.

    ``apply(x, weight, bias, eps, is_rms) -> (y, stats)`` with x (..., D) and stats
    (..., 2) = (mean, rstd) for LayerNorm, (..., 1) = rstd for RMSNorm, in the compute dtype
    (at least fp32). The backward is (ln-dx) / (rms-dx) and (ln-dparams) from the saved stats;
    when autograd is building a graph of the backward (``create_graph=True``) the stats are
    recomputed from x inside it, so that second derivatives see how they depend on x. This is
    the class torch.compile and torch.export trace (Dynamo refuses a Function with a custom
    jvp); :class:`_NormFunctionAD` adds forward-mode AD and vmap for torch.func.
    """

    @staticmethod
    def forward(x, weight, bias, eps, is_rms):
        ct = _compute_dtype(x.dtype)
        w = None if weight is None else weight.to(ct)
        b = None if bias is None else bias.to(ct)
        y, mean, rstd = _math.forward(x.to(ct), w, b, eps, is_rms)
        stats = rstd if is_rms else torch.cat([mean, rstd], -1)   # one or two scalars per token
        return y.to(x.dtype), stats

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, eps, is_rms = inputs
        _, stats = output
        ctx.save_for_backward(x, weight, stats)
        ctx.save_for_forward(x, weight, stats)
        ctx.mark_non_differentiable(stats)
        ctx.meta = (eps, is_rms, None if weight is None else weight.dtype,
                    None if bias is None else bias.dtype)

    @staticmethod
    def _unpack(ctx):
        x, weight, stats = ctx.saved_tensors
        eps, is_rms, wdt, bdt = ctx.meta
        ct = _compute_dtype(x.dtype)
        xc = x.to(ct)
        w = None if weight is None else weight.to(ct)
        return xc, w, stats, eps, is_rms, wdt, bdt

    @staticmethod
    def backward(ctx, dy, dstats):
        xc, w, stats, eps, is_rms, wdt, bdt = _NormFunction._unpack(ctx)
        if torch.is_grad_enabled():   # a graph of the backward is being built: stats from x
            mean, rstd = _math.stats(xc, eps, is_rms)
        else:
            mean, rstd = _split(stats, is_rms)
        dx, dweight, dbias = _math.backward(dy.to(xc.dtype), xc, w, mean, rstd, bdt is not None)
        return (dx.to(ctx.saved_tensors[0].dtype), None if wdt is None else dweight.to(wdt),
                None if bdt is None else dbias.to(bdt), None, None)



class _NormFunctionAD(_NormFunction):
    """:class:`_NormFunction` in torch.func's form: with the forward-mode tangent (jvp) and a
    generated vmap rule, for forward-mode AD and torch.func transforms."""

    generate_vmap_rule = True

    @staticmethod
    def jvp(ctx, tx, tw, tb, teps, tis_rms):
        xc, w, stats, eps, is_rms, wdt, bdt = _NormFunction._unpack(ctx)
        mean, rstd = _split(stats, is_rms)
        ct = xc.dtype
        ty = _math.jvp(None if tx is None else tx.to(ct), None if tw is None else tw.to(ct),
                       None if tb is None else tb.to(ct), xc, w, mean, rstd)
        return ty.to(ctx.saved_tensors[0].dtype), None


# torch's Function.apply binds its arguments with inspect.signature on every call (about 12 us
# here) because the Function has setup_context; the C++ apply underneath does the same work
# when every argument is given positionally, as it always is here. It also runs the jvp under
# forward-mode AD.
_fast_apply = super(torch.autograd.Function, _NormFunctionAD).apply


def _apply(x, weight, bias, eps, is_rms):
    """The norm's Function on (..., D) rows, by whichever ``apply`` the context needs: torch's,
    of the jvp-free class, for torch.compile and torch.export (their tracers see the Function);
    torch's, of :class:`_NormFunctionAD`, under torch.func transforms; the C++ one otherwise."""
    if torch.compiler.is_compiling():
        return _NormFunction.apply(x, weight, bias, eps, is_rms)
    if torch._C._are_functorch_transforms_active():
        return _NormFunctionAD.apply(x, weight, bias, eps, is_rms)
    return _fast_apply(x, weight, bias, eps, is_rms)


def _split(stats, is_rms):
    """stats (..., 2) or (..., 1) -> mean (..., 1) or None, rstd (..., 1)."""
    return (None, stats) if is_rms else (stats[..., :1], stats[..., 1:])


def _flatten(input, shape, *params):
    """(..., *normalized_shape) -> (..., D) and each parameter -> (D,)."""
    D = math.prod(shape)
    x = input.reshape(*input.shape[: input.dim() - len(shape)], D)
    return (x, *(None if p is None else p.reshape(D) for p in params))


def _nested(fn, input, normalized_shape, *args):
    """A nested jagged tensor: the norm of its values, (sum of lengths, *normalized_shape),
    rebuilt on the same offsets. Only trailing dims past the ragged one can be normalized."""
    shape = _validate.as_shape(normalized_shape)
    if len(shape) >= input.dim() - input._ragged_idx:
        raise ValueError(f"normalized_shape: a nested jagged input can be normalized over its "
                         f"regular trailing dims only, at most {input.dim() - input._ragged_idx - 1}, "
                         f"got {shape}")
    values = fn(input.values(), shape, *args)
    return torch.nested.nested_tensor_from_jagged(values, input.offsets(), lengths=input.lengths())


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """LayerNorm over the trailing ``normalized_shape`` dims, as ``torch.nn.functional.layer_norm``.

    Implements equations (ln-mean) to (ln-y) of the chapter "One token's vector":
    y = (x - mean) / sqrt(var + eps) * weight + bias, with mean and the biased variance
    (dividing by D) taken over the trailing dims of each token separately. Its gradient is
    (ln-dparams) and (ln-dx) of "The backward pass".

    Args:
        input: ``(*, *normalized_shape)`` floating tensor (a nested jagged tensor too, over its
            regular trailing dims).
        normalized_shape: int or sequence of ints, the trailing dims to normalize over
            (D = their product; D = 0 gives an empty result, as in torch).
        weight: optional ``(*normalized_shape)`` scale gamma.
        bias: optional ``(*normalized_shape)`` shift beta.
        eps: a number or a 0-d tensor, added to the variance inside the square root.

    Returns:
        Tensor of input's shape and dtype. CUDA inputs use the Triton kernels when Triton is
        installed; all others an autograd Function in torch ops (fp32 reductions for
        bf16/fp16), which supports double backward, forward-mode AD and torch.func.

    Differs from torch on purpose: weight and bias may have another floating dtype than the
    input (torch's CPU kernel refuses that); rows whose variance overflows (fp32 values past
    about 1e19) give the finite, correct answer where torch gives NaN.
    """
    if isinstance(input, torch.Tensor) and input.is_nested:
        return _nested(layer_norm, input, normalized_shape, weight, bias, eps)
    if _use_kernels(input):   # one door: the kernels validate and flatten, once
        from normbook.kernels import ops

        return ops.layer_norm(input, normalized_shape, weight, bias, eps)
    eps = _validate.as_eps(eps)
    shape = _validate.check_norm_args(input, normalized_shape, {"weight": weight, "bias": bias}, eps)
    x, w, b = _flatten(input, shape, weight, bias)
    return _apply(x, w, b, eps, False)[0].reshape(input.shape)


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """RMSNorm over the trailing ``normalized_shape`` dims, as ``torch.nn.functional.rms_norm``.

    Implements equations (rms-ms) and (rms-y) of the chapter "One token's vector":
    y = x / sqrt(mean(x^2) + eps) * weight, with no centring and no bias. Its gradient is
    (rms-dx) of "RMSNorm".

    Args:
        input: ``(*, *normalized_shape)`` floating tensor (a nested jagged tensor too).
        normalized_shape: int or sequence of ints, the trailing dims to normalize over.
        weight: optional ``(*normalized_shape)`` scale gamma.
        eps: a number or 0-d tensor added to the mean square inside the square root; None
            means the machine epsilon of the type torch computes in: fp32's for float16,
            bfloat16 and float32 inputs (measured: not the input dtype's), fp64's for float64.

    Returns:
        Tensor of input's shape and dtype.

    Differs from torch on purpose: complex inputs are refused (torch accepts them); the weight
    may have another floating dtype than the input; rows whose mean square overflows give the
    finite, correct answer where torch gives NaN.
    """
    if isinstance(input, torch.Tensor) and input.is_nested:
        return _nested(rms_norm, input, normalized_shape, weight, eps)
    if _use_kernels(input):   # one door: the kernels validate and flatten, once
        from normbook.kernels import ops

        return ops.rms_norm(input, normalized_shape, weight, eps)
    eps = _validate.as_eps(_validate.default_eps(input, eps))
    shape = _validate.check_norm_args(input, normalized_shape, {"weight": weight}, eps)
    x, w = _flatten(input, shape, weight)
    return _apply(x, w, None, eps, True)[0].reshape(input.shape)
