"""The public functional API: ``normbook.layer_norm``, ``normbook.rms_norm`` and the fused
``normbook.add_layer_norm``, ``normbook.add_rms_norm``.

Signatures, defaults and accepted inputs mirror ``torch.nn.functional``. This is the one front
door: each call is validated and flattened to (M, D) rows here, once, and handed to one
autograd Function, :class:`NormFunction`, with the backend that computes it (see
:func:`backend`):

- **torch**: the book's formulas in torch ops (:mod:`normbook._math`): the forward (ln-y) /
  (rms-y) and the hand-derived backward (ln-dx) / (rms-dx), so a reader on a CPU trains through
  the book's own equations; any dtype (float64 too), any device, every transform;
- **kernels**: the fused Triton kernels of :mod:`normbook.kernels` (CUDA tensors, or CPU
  tensors in Triton's interpreter).

Both save the same statistics, ``stats`` of shape (k, M): (mean, rstd) for LayerNorm (k = 2),
rstd for RMSNorm (k = 1), in the compute dtype (at least fp32). Under torch.compile the kernel
backend runs as the custom ops ``torch.ops.normbook.norm_forward`` / ``norm_backward``
(:mod:`normbook.kernels.ops`, with their DTensor sharding rules beside them), which Dynamo
traces through the Function without a graph break. Under torch.export, whose programs keep no
autograd Function, the door records the torch backend's formulas (which autograd then
differentiates) or the kernels' custom op (whose gradient formula is registered with it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import threading
import warnings
from typing import Any, Iterator, NamedTuple, Sequence   # typing's: the book's API page resolves these names

import torch
import torch.autograd.forward_ad as _fwAD
from torch import Tensor

from normbook import _math, _ops, _validate
_cast = _math._cast

__all__ = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "backend", "NormFunction"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HALF = (torch.float16, torch.bfloat16)
_BACKENDS = ("auto", "kernels", "torch")
_backend = "auto"          # see backend()
_FUSED_D = 8192            # rows up to this wide always fit the kernels (kernels._take.kernels_take)


# ----------------------------------------------------------------------------- backends

@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_kernels(input) -> bool:
    """Whether the Triton kernels compute this call (see :func:`backend`): by default CUDA
    tensors in a kernel dtype, when Triton is installed; float64 stays on the torch ops (the
    oracle's precision)."""
    if _backend == "auto":
        return (isinstance(input, Tensor) and input.is_cuda
                and input.dtype in _KERNEL_DTYPES and _triton_installed())
    return _backend == "kernels"


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Choose, inside a ``with`` block, what computes :func:`normbook.layer_norm`,
    :func:`normbook.rms_norm`, the fused ``add_*`` and the modules :class:`normbook.LayerNorm`,
    :class:`normbook.RMSNorm`.

    Args:
        name: ``"auto"`` (the default outside any block): the Triton kernels for CUDA tensors
            in float16, bfloat16 or float32 when Triton is installed, the book's formulas in
            torch ops for everything else; ``"kernels"``: always the kernels (as
            :mod:`normbook.kernels` is called; on CPU tensors only under TRITON_INTERPRET=1,
            in Triton's interpreter); ``"torch"``: always the torch ops, which also compute
            float64 and every transform.

    The choice is process-wide while the block runs (not per thread): the block entered last
    of those still running decides, and when the last one ends the choice from before the
    first comes back, also where blocks in several threads overlap (each ends its own, not
    the one running when it started). Example::

        with normbook.backend("torch"):
            y = model(x)    # the torch ops on a GPU too, to compare
    """
    global _backend, _outside
    if name not in _BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, _BACKENDS))}, got {name!r}")
    block = object()
    with _blocks_lock:
        if not _blocks:
            _outside = _backend
        _blocks[block] = name
        _backend = name
    try:
        yield
    finally:
        with _blocks_lock:
            del _blocks[block]
            _backend = next(reversed(_blocks.values())) if _blocks else _outside


_blocks: dict = {}      # the backend() blocks running, in the order they were entered: name
_blocks_lock = threading.Lock()
_outside = "auto"       # the choice before the first of them


_K = None   # normbook.kernels' launchers and ops (a _Kernels), imported on the first kernel call
_READY: dict = {}   # the fast path's ready signatures: normbook.kernels._launch.READY, once imported
_TORCH, _LAUNCH, _OPS = 0, 1, 2   # what computes a call: NormFunction's ``kernels`` argument
# torch's predicates, bound once (each is read on every call; torch.compile knows them by
# identity, whatever the name)
_grad_enabled = torch.is_grad_enabled
_transformed = torch._C._are_functorch_transforms_active
_compiling = torch.compiler.is_compiling
_legacy_batched = _math._is_legacy_batched   # autograd's batched gradients (is_grads_batched)
_tracing = torch._C._is_tracing              # torch.jit.trace
# torch.export (a torch without is_exporting exports by the torch.compile route)
_exporting = getattr(torch.compiler, "is_exporting", lambda: False)
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _onnx_exporting() -> bool:
    """torch.onnx.export is running (torch.onnx is imported at the first export, not with
    normbook: it added 20 ms to ``import normbook``)."""
    return torch.onnx.is_in_onnx_export()


def _unsafe_view(y, shape):
    """y as a tensor of its own in ``shape``: aten's ``_unsafe_view``, a reshape that autograd
    does not track as a view. Under torch.jit.trace (and so the TorchScript ONNX exporter) a
    plain reshape: a trace records ``_unsafe_view``'s sizes as constants (the traced norm then
    refused any other batch), and ONNX has no ``_unsafe_view``."""
    if torch.jit.is_tracing():
        return y.reshape(shape)
    return torch.ops.aten._unsafe_view(y, shape)


class _Kernels(NamedTuple):
    """What the door and the Function call of the kernel layer."""
    norm_forward: Any       # the launchers, kernels._forward.norm_forward and
    norm_backward: Any      # kernels._backward.norm_backward
    ops: Any                # kernels.ops: the custom ops
    take: Any               # kernels._take: which rows the kernels take
    ready: Any              # kernels._ready.ready
    plain: Any              # kernels._launch.plain


def _kernels():
    """The kernel layer (imports triton on first use: ``import normbook`` never does)."""
    if _compiling() or _K is None:
        # (under torch.compile, without reading _K first: a trace that found it None would
        # guard on that, and the next call, _K set, would compile again)
        return _load_kernels()
    return _K


def _load_kernels():
    global _K, _READY
    from normbook.kernels import _backward, _forward, _launch, _ready, _take, ops

    _READY = _launch.READY
    _K = _Kernels(_forward.norm_forward, _backward.norm_backward, ops, _take, _ready.ready,
                  _launch.plain)
    return _K


# ----------------------------------------------------------------------------- the Function

def _torch_forward(x, residual, weight, bias, eps, is_rms, with_stats=True):
    """The torch backend's forward: h = x + residual (in x's dtype), then (ln-y) / (rms-y) of h
    in the compute dtype; returns (y, h, stats), h None without a residual, stats (k, ...)
    (None without ``with_stats``: a call that no backward will follow)."""
    h = x if residual is None else x + residual
    if not h.is_contiguous() and (h.dim() != 2 or h.stride(1) != 1):
        # a strided x (transposed, permuted, a slice) comes as the caller gave it, so that the
        # Function saves that tensor and not a dense copy of it, as torch's kernel saves its
        # input: the copy lives while y is formed, and y is dense, as torch's. ((M, D) rows
        # with a unit last stride are read in place: their y is dense without it)
        h = h.contiguous()
    ct = _validate.compute_dtype(h.dtype)
    if not is_rms and h.dtype in _HALF and h.shape[-1] and _math._eager(h, weight, bias):
        # torch's fused kernel reads bf16/fp16 rows as they are and reduces in fp32, the
        # statistics (ln-mean), (ln-rstd) in fp32 given fp32 parameters: no fp32 copy of the rows
        D = h.shape[-1]
        w = h.new_ones(D, dtype=ct) if weight is None else _cast(weight, ct)
        b = h.new_zeros(D, dtype=ct) if bias is None else _cast(bias, ct)
        y, mean, rstd = torch.native_layer_norm(h, (D,), w, b, eps)
        if _math._all_positive(rstd):           # False for NaN: those rows take the formulas
            stats = torch.cat([mean, rstd], -1).movedim(-1, 0) if with_stats else None
            return y, None if residual is None else h, stats
    y, mean, rstd = _math.forward(_cast(h, ct), _cast(weight, ct), _cast(bias, ct), eps, is_rms)
    if not with_stats:
        stats = None
    elif is_rms:
        stats = rstd.movedim(-1, 0)
    else:
        stats = torch.cat([mean, rstd], -1).movedim(-1, 0)
    return _cast(y, x.dtype), None if residual is None else h, stats


def _torch_backward(dy, dh, x, weight, stats, eps, is_rms, bias_dtype, recompute):
    """(ln-dx) / (rms-dx) and (ln-dparams) in torch ops, plus the fork rule's dh. ``recompute``:
    the statistics are taken again from x, inside the graph autograd is building of this
    backward, so that a second derivative sees how they depend on x."""
    ct = _validate.compute_dtype(x.dtype)
    w = _cast(weight, ct)
    by_blocks = None
    if x.dtype in _HALF and dy.dtype == x.dtype and w is not None and not recompute:
        # bf16/fp16 rows read a block at a time into fp32 (no fp32 copy of the whole rows)
        mean, rstd = None if is_rms else stats[0].unsqueeze(-1), stats[-1].unsqueeze(-1)
        if not is_rms and _math._takes_fused(dy, x, w, mean, rstd):
            by_blocks = _math._backward_fused
        elif _math._takes_blocks(dy, x, w, stats):
            by_blocks = _math._backward_eager
    if by_blocks is not None:
        dx, dweight, dbias = by_blocks(dy, x, w, mean, rstd, bias_dtype is not None)
        if dh is not None:
            dx = dx + dh                                    # fork rule
        return (dx, _cast(dweight, weight.dtype),
                None if bias_dtype is None else _cast(dbias, bias_dtype))
    xc = _cast(x, ct)
    if recompute:
        mean, rstd = _math.stats(xc, eps, is_rms)
    else:
        rstd = _cast(stats[-1].unsqueeze(-1), ct)
        mean = None if is_rms else _cast(stats[0].unsqueeze(-1), ct)
    dx, dweight, dbias = _math.backward(_cast(dy, ct), xc, w, mean, rstd, bias_dtype is not None)
    if dh is not None:
        dx = dx + dh                                        # fork rule
    return (_cast(dx, x.dtype), None if weight is None else _cast(dweight, weight.dtype),
            None if bias_dtype is None else _cast(dbias, bias_dtype))


def _forward_rows(x, residual, weight, bias, eps, is_rms, kernels):
    """(y, h, stats) of (M, D) rows by the backend ``kernels`` names (see :class:`NormFunction`);
    h None without a residual."""
    if kernels == _LAUNCH:       # eager, plain tensors: the launcher itself
        return _launched(x, residual, weight, bias, eps, is_rms)
    if kernels:                  # _OPS: the custom op, which tracers and DTensor see
        y, h, stats = _K[2].norm_forward(x, residual, weight, bias, eps, is_rms)
        return y, None if residual is None else h, stats
    return _torch_forward(x, residual, weight, bias, eps, is_rms)


def _launched(x, residual, weight, bias, eps, is_rms):
    """(y, h, stats) from the launchers, which take (M, D) rows: x and the residual (..., D)
    flattened (see :func:`_whole`), y and h given x's shape back, stats (k, M)."""
    if x.dim() == 2 and x.stride(1) == 1:
        return _K[0](x, residual, weight, bias, eps, is_rms)
    y, h, stats = _K[0](_rows(x), None if residual is None else _rows(residual), weight, bias,
                        eps, is_rms)
    return _shaped(y, x.shape), None if h is None else _shaped(h, x.shape), stats


class NormFunction(torch.autograd.Function):
    """Both norms, both backends, with the fused residual add: the one autograd Function.

    ``apply(x, residual, weight, bias, cfg) -> y``, or ``(y, h)`` with a residual: x and the
    residual (M, D) rows (a DTensor keeps its leading dims), weight and bias (D,) or None, and
    the rest one tuple, ``cfg = (eps, is_rms, kernels, bias_dtype, has_residual, ready)``, kept
    as it is for backward (each argument of an apply, and each object built for backward, costs
    some work per call: see :func:`_cfg`). ``kernels`` is the backend: ``_TORCH`` (0) the torch
    ops, ``_LAUNCH`` (1) the Triton kernels' launchers, or their kept kernels through ``ready``
    (a :class:`~normbook.kernels._ready.Ready`, from :func:`_norm`), ``_OPS`` (2) the kernels
    through their custom ops (under a tracer, or for a DTensor; :func:`_apply` chooses). y = norm(h) with h = x + residual (h = x
    without one, and then not returned). The statistics, (k, M), are saved for backward, not
    returned: a Function with one output, and with ``ctx`` in its forward, costs about 1.5 us
    less per call than one whose ``setup_context`` receives them as a second output (measured,
    ``python -m normbook.bench host``).

    The backward is (ln-dx) / (rms-dx) and (ln-dparams), with the gradient arriving at h added
    to x's and the residual's (the fork rule). When autograd is building a graph of the backward
    (``create_graph=True``), or a torch.func transform wraps the tensors, it is computed in
    torch ops with the statistics recomputed from x, so that second derivatives are right on
    either backend. This class has no jvp, so that torch.compile traces it (Dynamo refuses a
    Function with a custom jvp); ``_NormFunctionAD`` (a subclass) adds forward-mode AD and vmap.
    """

    @staticmethod
    def forward(ctx, x, residual, weight, bias, cfg):
        eps, is_rms, kernels, _, _, ready = cfg
        if ready is not None:    # the fast path's (see _norm)
            y, h, stats = ready.forward(x, residual, weight, bias, eps)
        elif kernels == _LAUNCH:   # (see _forward_rows)
            y, h, stats = _launched(x, residual, weight, bias, eps, is_rms)
        else:
            y, h, stats = _forward_rows(x, residual, weight, bias, eps, is_rms, kernels)
        ctx.cfg = cfg
        if residual is None:
            ctx.save_for_backward(x, weight, stats)
            return y
        ctx.save_for_backward(h, weight, stats)
        ctx.set_materialize_grads(False)      # no zeros for whichever of y and h is unused
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            ctx.mark_non_differentiable(h)    # h = x + residual: a constant, as in torch
        return y, h

    @staticmethod
    def backward(ctx, dy, *rest):
        eps, is_rms, kernels, bias_dtype, has_residual, ready = ctx.cfg
        dh = rest[0] if has_residual else None
        if dy is None:
            # only h was used downstream: nothing reaches the norm's inputs through y, and h =
            # x + residual hands dh to both (the saved h, which may since have been changed
            # in place, is not read, as torch's x + residual would not)
            return dh, dh, None, None, None
        x, weight, stats = ctx.saved_tensors
        if kernels == _LAUNCH and not _compiling():   # (see _values; Dynamo cannot trace is_neg)
            dy, dh = _values(dy, dh)
        if ready is not None and ready.live and not (
                _grad_enabled() or _transformed() or _compiling() or _fwAD._current_level >= 0
                or _legacy_batched(dy) or not _K.plain()):
            grads = ready.backward(dy, dh, x, weight, stats, bias_dtype)
            if grads is not None:       # (None: dy or dh not dense, or not kept yet)
                dx = grads[0]
                return dx, dx if has_residual else None, grads[1], grads[2], None
        shape = None
        if kernels == _LAUNCH and (x.dim() != 2 or x.stride(1) != 1):   # see _launched
            shape = x.shape
            x, dy = _rows(x), _rows(dy)
            dh = None if dh is None else _rows(dh)
        dual = _fwAD._current_level >= 0       # forward-over-reverse: tangents through it
        eager = kernels == _LAUNCH and not (_grad_enabled() or _transformed() or _compiling())
        if eager and not dual and not _legacy_batched(dy):
            dx, dweight, dbias = _K[1](dy, dh, x, weight, stats, bias_dtype, is_rms)
        elif not kernels or _grad_enabled() or _transformed() or dual or eager:
            # torch ops; the statistics taken again from x where a graph or a tangent of the
            # backward must see how they depend on it
            dx, dweight, dbias = _torch_backward(dy, dh, x, weight, stats, eps, is_rms,
                                                 bias_dtype, _grad_enabled() or dual)
        else:   # traced (compiled autograd too) or a DTensor: the custom op
            dx, dweight, dbias = _K[2].norm_backward(dy, dh, x, weight, stats, bias_dtype, is_rms)
            dweight = None if weight is None else dweight
            dbias = None if bias_dtype is None else dbias
        if shape is not None:
            dx = dx.view(shape)
        # fork rule: h = x + residual, so x and the residual receive the same gradient (one
        # tensor for both: autograd copies it before it could become two leaves' .grad)
        return dx, dx if has_residual else None, dweight, dbias, None


class _NormFunctionAD(NormFunction):
    """:class:`NormFunction` with the forward-mode tangent (jvp) and a generated vmap rule, for
    forward-mode AD and torch.func (which run the torch backend, see :func:`_apply`). torch.func
    needs a ``setup_context``, so here the statistics are an output: ``apply(...) -> (y,
    stats)`` or ``(y, h, stats)``; the backward is :class:`NormFunction`'s."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, residual, weight, bias, cfg):
        y, h, stats = _forward_rows(x, residual, weight, bias, *cfg[:3])
        return (y, stats) if residual is None else (y, h, stats)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, residual, weight, bias, cfg = inputs
        stats = output[-1]
        saved = (x if residual is None else output[1], weight, stats)
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*saved)          # the jvp reads them too
        # Nothing is marked non-differentiable: h stays differentiable here, where tangents of
        # x and the residual flow into it whether or not they require grad (NormFunction marks
        # a constant h); the statistics, which no caller sees, get a zero tangent (see jvp)
        ctx.set_materialize_grads(False)      # no zeros for unused outputs
        ctx.cfg = cfg

    @staticmethod
    def jvp(ctx, tx, tresidual, tweight, tbias, tcfg):
        """Tangents of (y, h): th = tx + tresidual, ty = weight * J th (ln-jac) plus the
        parameters' terms, in torch ops on the saved statistics."""
        x, weight, stats = ctx.saved_tensors
        _, is_rms, _, _, has_residual, _ = ctx.cfg
        th = tx
        if has_residual and tresidual is not None:
            th = tresidual if th is None else th + tresidual
        ct = _validate.compute_dtype(x.dtype)
        # (k, ...) from the torch backend, (k, M) from the launchers: in x's leading shape
        lead = (*x.shape[:-1], 1)
        rstd = stats[-1].reshape(lead).to(ct)
        mean = None if is_rms else stats[0].reshape(lead).to(ct)
        ty = _math.jvp(None if th is None else th.to(ct), None if tweight is None else tweight.to(ct),
                       None if tbias is None else tbias.to(ct), x.to(ct),
                       None if weight is None else weight.to(ct), mean, rstd)
        # the statistics' tangent: zeros (the door discards them), not None. Marked
        # non-differentiable, with None here, they broke jvp(vmap(...)) and jacfwd(vmap(...)):
        # the generated vmap rule's setup_context hands mark_non_differentiable the batched
        # stats, not the output its Function returns, so they stayed differentiable there, and
        # torch's forward-mode AD failed an internal assert on the None ("Expected both tensor
        # and its forward grad to be floating point or complex", torch 2.13)
        tstats = torch.zeros_like(stats)
        if not has_residual:
            return ty.to(x.dtype), tstats
        return ty.to(x.dtype), torch.zeros_like(x) if th is None else th, tstats


# torch's Function.apply binds its arguments with inspect.signature on every call (about 12 us
# here) when the Function has setup_context; the C++ apply underneath does the same work when
# every argument is given positionally, as it always is here. _ad_apply also runs the jvp under
# forward-mode AD.
_eager_apply = super(torch.autograd.Function, NormFunction).apply
_ad_apply = super(torch.autograd.Function, _NormFunctionAD).apply


def _cfg(eps, is_rms, kernels, bias, residual) -> tuple:
    """:class:`NormFunction`'s last argument: (eps, is_rms, kernels, bias_dtype, has_residual,
    ready), ready None (the fast path's calls bring their :class:`~normbook.kernels._ready.Ready`).
    One tuple, built once by the door and kept by the Function as ``ctx.cfg``: it is what
    backward needs besides the saved tensors, and a tuple built again in forward (or two
    arguments more) costs about a microsecond per call in the host benchmark."""
    return eps, is_rms, kernels, None if bias is None else bias.dtype, residual is not None, None


def _apply(x, residual, weight, bias, eps, is_rms, kernels):
    """:class:`NormFunction` on (M, D) rows by whichever ``apply`` the context needs, and the
    kernels by whichever route (``kernels`` True or False: the backend); returns (y, h), h None
    without a residual. Under torch.compile, torch's apply of the jvp-free class (Dynamo
    traces the Function) and the kernels' custom ops (the torch backend's formulas where
    forward-mode AD is traced too: the ops have no forward formula); under torch.export, no
    Function (no exported program keeps one): the formulas in torch ops, or the kernels' custom op with
    its own gradient formula (under torch.onnx.export, torch's norms: :func:`_onnx_forward`); under torch.func
    transforms (which wrap tensors no kernel can read), torch's apply of
    :class:`_NormFunctionAD` on the torch backend; under forward-mode AD, the C++ apply of
    :class:`_NormFunctionAD`; otherwise that of :class:`NormFunction`, with the custom ops for
    a DTensor and the launchers for the rest. Under torch.jit.trace, the formulas in torch's
    own ops, no Function: a trace holds what it records, and a Python Function in its graph
    could neither be saved (``torch.jit.save``) nor run where normbook is not imported."""
    if torch.jit.is_tracing():
        y, h, _ = _torch_forward(x, residual, weight, bias, eps, is_rms, False)
        return y, h
    if torch.compiler.is_compiling():
        if _fwAD._current_level >= 0:
            # forward-mode AD (func.jvp, jacfwd, hessian, a dual_level traced by torch.compile):
            # the formulas in torch ops, whose traced ops carry tangents. The kernels' custom
            # op has no forward formula: its tangents came out zero, silently (fwAD's None).
            # (First: torch 2.11's Dynamo answers is_exporting() True under torch.compile too)
            return _torch_forward(x, residual, weight, bias, eps, is_rms, False)[:2]
        if _exporting():
            # torch.export keeps no autograd.Function that its program can differentiate: strict
            # export ran the Function's forward with grad mode off (the exported outputs had no
            # gradient), non-strict keeps its forward's ops and drops its backward. So: the
            # formulas in torch ops, which autograd differentiates, without the statistics only
            # the Function would have read; or the kernels' custom op, whose gradient formula
            # is registered with it (normbook._ops). For ONNX, torch's own norm (see _onnx_forward)
            if _onnx_exporting():
                return _onnx_forward(x, residual, weight, bias, eps, is_rms)
            if kernels:
                return _forward_rows(x, residual, weight, bias, eps, is_rms, _OPS)[:2]
            return _torch_forward(x, residual, weight, bias, eps, is_rms, False)[:2]
        cfg = _cfg(eps, is_rms, _OPS if kernels else _TORCH, bias, residual)
        out = NormFunction.apply(*_distinct(x, residual, weight, bias), cfg)
        return (out, None) if residual is None else out
    if torch._C._are_functorch_transforms_active():
        cfg = _Leaf(_cfg(eps, is_rms, _TORCH, bias, residual))
        out = _inference_saved(_NormFunctionAD.apply, x, residual, weight, bias, cfg)
        return out[0], None if residual is None else out[1]
    if not kernels and not (_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, residual, weight, bias))) \
            and _fwAD._current_level < 0:
        # no backward will follow: the Function's forward without the Function (its context,
        # and the statistics it would save), the same y and h
        y, h, _ = _torch_forward(x, residual, weight, bias, eps, is_rms, False)
        return y, h
    # a DTensor takes the custom ops, whose sharding rules keep each token's row on one rank
    route = (_OPS if _ops.own_dispatch(x) else _LAUNCH) if kernels else _TORCH
    if _fwAD._current_level >= 0:
        # forward-mode AD: h = x + residual as torch's own add, then the norm of h, so that h's
        # tangent, its requires_grad and y's dependence on h are exactly those of x + residual
        # followed by the norm (one output h of the Function required grad and carried a
        # tangent whenever the weight did, and autograd.grad(y, h) found h unused)
        h = None if residual is None else x + residual
        cfg = _cfg(eps, is_rms, route, bias, None)
        y = _inference_saved(_ad_apply, x if h is None else h, None, weight, bias, cfg)[0]
        return y, h
    cfg = _cfg(eps, is_rms, route, bias, residual)
    out = _inference_saved(_eager_apply, x, residual, weight, bias, cfg)
    return (out, None) if residual is None else out


def _onnx_forward(x, residual, weight, bias, eps, is_rms):
    """(y, h) under ``torch.onnx.export(..., dynamo=True)``: torch's ``layer_norm`` /
    ``rms_norm`` of h = x + residual, which ONNX has as one operator each (LayerNormalization;
    RMSNormalization from opset 23, a few operators before). The kernels' custom op has no ONNX
    translation (the export failed), and the torch backend's formulas, overflow-safe, became
    about 30 operators a norm that onnxruntime does not fuse back (a LayerNorm and an RMSNorm of
    16 x 256 x 1024 fp32 rows: 12.9 ms against torch's norms' 2.0 ms, best of 200 runs on a
    2-core CPU). The exported model computes what ONNX's operators compute, torch's norms: a
    row whose variance overflows fp32 gives what torch gives. ONNX's operators take x's dtype
    for the weight and bias; parameters of another dtype keep the formulas."""
    h = x if residual is None else x + residual
    if not all(p is None or p.dtype == h.dtype for p in (weight, bias)):
        return _torch_forward(x, residual, weight, bias, eps, is_rms, False)[:2]
    D = (h.shape[-1],)
    y = (torch.nn.functional.rms_norm(h, D, weight, eps) if is_rms
         else torch.nn.functional.layer_norm(h, D, weight, bias, eps))
    return y, None if residual is None else h


def _inference_saved(apply, x, residual, weight, bias, cfg):
    """``apply(x, residual, weight, bias, cfg)``; where it raised because x is an inference
    tensor, which autograd refuses to save, again on a copy of x (see _copy_of_inference)."""
    try:
        return apply(x, residual, weight, bias, cfg)
    except RuntimeError:
        return apply(_copy_of_inference(x, residual), residual, weight, bias, cfg)


class _Leaf(tuple):
    """The Function's ``cfg`` under torch.func: the same tuple, which torch's pytree takes as
    one leaf (a tuple subclass that is not a namedtuple). The generated vmap rule's jvp pairs
    the flattened in_dims of the arguments with one tangent per argument
    (``torch._functorch.autograd_function.get_tangents_in_dims``, torch 2.13), so a plain tuple
    argument, flattened to its six items, raised a pytree ValueError under ``jvp(vmap(...))``
    and ``jacfwd(vmap(...))``, where torch's own norms work."""

    __slots__ = ()


def _distinct(*tensors) -> list:
    """The tensors, each one given again (the weight as the bias, x as the weight) replaced by
    a view of itself: Dynamo refuses an autograd.Function that receives one tensor twice
    ("duplicate tensor input"), and the view's gradient reaches the same tensor."""
    out: list = []
    for t in tensors:
        out.append(t.view_as(t) if t is not None and any(t is s for s in out) else t)
    return out


def _copy_of_inference(x, residual):
    """Called as the Function's apply raised: a copy of x where x is an inference tensor
    (made under ``torch.inference_mode``), which autograd refuses to save for backward, and
    the Function saves x for the weight's gradient (torch.nn.RMSNorm, whose composed ops save
    only tensors computed from x, takes one: measured, torch 2.13); else the error raised
    again. With a residual h is saved, a new tensor."""
    if residual is not None or not x.is_inference():
        raise         # (the error being handled)
    return x.clone()


# ----------------------------------------------------------------------------- the front door

_NO_BIAS = object()   # RMSNorm has no bias argument at all (so none is named in its errors)
_SEQUENCES = (tuple, list, torch.Size)   # what normalized_shape may be besides an int
_DIMS = (int, torch.SymInt)              # a dim the shorter paths take as it is
_warned_wide: set[int] = set()


def _traced_size(D) -> bool:
    """Whether D is a size torch.jit.trace gives (``x.size(-1)``: an integer 0-d tensor, while
    tracing), which :func:`_slow` takes as a dim. (Outside a trace such a tensor goes through
    the full checks, which take it as torch does: a key holding a tensor would never match.)"""
    # (isinstance first: D is None for several dims, and torch.compile's Dynamo cannot trace
    # torch._C._is_tracing, a graph break there, an error under fullgraph)
    return (isinstance(D, Tensor) and torch.jit.is_tracing() and D.dim() == 0
            and D.dtype != torch.bool and not (D.is_floating_point() or D.is_complex()))


_rows = _ops._rows   # (..., D) -> (M, D) rows; a DTensor keeps its leading dims


def _shaped(t: Tensor, shape) -> Tensor:
    """A dense (M, D) output made in a forward, given the caller's shape (..., D) in place: the
    same tensor, not a view of it. (An output of a Function that is a view of a tensor made in
    its forward may not be modified in place, and torch's outputs may.)"""
    if t._base is None and t.is_contiguous():
        return t.resize_(shape)
    return t.reshape(shape).clone()


def _whole(input) -> bool:
    """Whether the door passes input (and the fused add's residual) to :class:`NormFunction` in
    its own shape (..., D) rather than flattened to (M, D) rows: the torch backend and the
    custom ops take (..., D) as it is, and the launchers' forward flattens it. The outputs
    then are tensors of their own, as torch's are, not views (``detach_`` works on them), and
    the fused add's x and residual receive one gradient tensor. (Two views made by the door
    received two views of it, which autograd made two leaves' ``.grad`` without a copy: one
    tensor, which the next backward added into twice.) Not for a DTensor, whose leading dims
    the custom ops keep anyway, nor under torch.func transforms (no ``.grad`` there; their
    generated vmap rule sees (M, D) rows). Rows whose last dim is strided (a transposed
    input) are passed as they are too: the Function saves what it is given, and a dense copy
    made here would be kept for backward, (M, D) values more than torch keeps; the torch
    backend and the launchers make theirs inside, for as long as they read it."""
    return ((input.dim() != 2 or input.stride(1) != 1) and not _ops.own_dispatch(input)
            and not _transformed())


_INTERPRETED = None   # whether Triton's interpreter runs the kernels (known on the first kernel call)


def _check_kernel_args(input, weight, bias, name):
    """What only the kernels refuse: float64 (and other dtypes they do not take), and a CPU
    tensor while Triton's interpreter is off."""
    global _INTERPRETED
    if input.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"{name}: the Triton kernels take float16, bfloat16 or float32, got {input.dtype}"
                        " (normbook.layer_norm / normbook.rms_norm compute float64 on the torch backend)")
    for pname, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.dtype not in _KERNEL_DTYPES:
            raise TypeError(f"{pname}: the Triton kernels take float16, bfloat16 or float32, "
                            f"got {p.dtype}")
    if input.is_cuda:
        return
    if _compiling():     # (not read first: a trace that found None would guard on it)
        interpreted = _kernels()[2].interpreted()
    else:
        if _INTERPRETED is None:
            _INTERPRETED = _kernels()[2].interpreted()
        interpreted = _INTERPRETED
    if input.is_cpu and interpreted:
        ops = _kernels().ops   # (_INTERPRETED may be set without them: the stub driver)
        if ops.LATE_INTERPRET:
            raise RuntimeError(f"{name}: {ops.LATE_MESSAGE}")
        return
    # DeviceError: a ValueError, and a RuntimeError as torch's device mistakes are
    if input.is_cpu:
        raise _validate.DeviceError(
            f"{name}: expected a CUDA tensor, got a CPU tensor while Triton's interpreter is "
            "off; set TRITON_INTERPRET=1 in the environment before triton is imported to run "
            "the kernels on the CPU")
    raise _validate.DeviceError(f"{name}: expected a CUDA tensor (or a CPU tensor under "
                                f"TRITON_INTERPRET=1), got device {input.device}")


def _values(*tensors):
    """The tensors with each negative view (``torch._neg_view``: a sign kept as a bit of the
    tensor, not in its memory) made real, since the kernels read memory as it is; the rest
    (and None) as they are."""
    return tuple(t.resolve_neg() if t is not None and t.is_neg() else t for t in tensors)


def _check_residual(residual, input) -> None:
    _validate.check_input(residual, "residual")
    if residual.shape != input.shape:
        raise _validate.ShapeError(f"residual: expected x's shape {tuple(input.shape)}, got {tuple(residual.shape)}")
    if residual.dtype != input.dtype:
        raise TypeError(f"residual: expected x's dtype {input.dtype}, got {residual.dtype}")
    if residual.device != input.device:
        raise _validate.DeviceError(f"residual: expected x's device {input.device}, "
                                    f"got {residual.device}")


def _wide_rows_fit(D: int, itemsize: int, has_residual: bool, device_index: int) -> bool:
    """kernels._take.kernels_take, a value to torch.compile: Dynamo calls it once, while it
    traces, and keeps the answer, rather than tracing the plan builders (their caches, the
    device's properties, the environment switch) into the graph."""
    return _kernels().take.kernels_take(D, itemsize, has_residual, device_index)


# torch.compiler.assume_constant_result(_wide_rows_fit), without importing torch._dynamo (and
# with it triton) at ``import normbook``: the decorator sets this attribute and nothing else
# (torch 2.11-2.13; tests/test_kernels_ops.py checks it against the decorator)
_wide_rows_fit._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _kernels_take(x, residual) -> bool:
    """Whether the kernels compute this call: rows wider than the device's programs can share
    go to the torch backend, with one warning per width; so does every call under
    ``torch.jit.trace``, which records torch's ops and not a Triton launch (its graph would
    hold empty outputs)."""
    if torch.jit.is_tracing():      # (torch.compile knows this one; not _tracing, a C builtin)
        return False
    D = x.shape[-1]
    if D <= _FUSED_D:
        return True
    if _wide_rows_fit(int(D), x.element_size(), residual is not None, x.get_device()):
        return True
    if D not in _warned_wide:
        _warned_wide.add(D)
        warnings.warn(f"normbook: rows of D = {D} are wider than the kernels share among the "
                      "programs this device holds; they are computed by the torch backend "
                      "(same results, more passes over memory)", RuntimeWarning, stacklevel=4)
    return False


def _autocast_fp32_devices(op: str) -> frozenset:
    """The device types whose autocast has a kernel for ``op``: for the two norms that kernel
    is always torch's float32 policy (inputs cast to fp32, an fp32 output). Read from the
    running torch's dispatcher, since it changes between versions: torch 2.13 casts
    F.rms_norm on CUDA and XPU, torch 2.11 leaves it in the input's dtype."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return frozenset(device for device, key in (("cuda", "AutocastCUDA"), ("xpu", "AutocastXPU"),
                                                ("mps", "AutocastMPS"), ("cpu", "AutocastCPU"))
                     if has(op, key))


# Where torch's autocast runs F.layer_norm / F.rms_norm in float32, by device type; index 0
# LayerNorm, 1 RMSNorm (torch 2.13: cuda, xpu and mps; cuda and xpu; torch 2.11: no device for
# RMSNorm). tests/test_functional.py checks it against what torch returns, op by op on fake
# tensors of each device under its autocast.
_AUTOCAST_FP32 = (_autocast_fp32_devices("aten::layer_norm"), _autocast_fp32_devices("aten::rms_norm"))
_any_autocast = torch._C._is_any_autocast_enabled   # (not MPS's: the fast path leaves it)


def _fp32(t):
    """What autocast's float32 policy does to an argument: a floating tensor other than
    float64 in float32 (a differentiable cast); anything else as it is."""
    if t is None or not t.is_floating_point() or t.dtype in (torch.float32, torch.float64):
        return t
    return t.float()


def _autocast_fp32(original, input, D, weight, bias, eps, is_rms, residual, name, kernels):
    """The norm as torch computes it under autocast on a device whose policy for it is float32
    (see :data:`_AUTOCAST_FP32`): its arguments in fp32, autocast off inside, a float32 y. The
    fused add is torch's composition there: h = x + residual (which autocast leaves alone), y
    the fp32 norm of h; h and y are then not formed in one pass."""
    h = input if residual is None else input + residual
    with torch.autocast(input.device.type, enabled=False):
        y, _ = _norm(_fp32(h), D, _fp32(weight), _fp32(bias), eps, is_rms, None, name, kernels)
    if y.shape != original.shape:
        y = _unsafe_view(y, original.shape)     # (see _checked)
    return y, None if residual is None else h


def _norm(input, normalized_shape, weight, bias, eps, is_rms, residual=None, name="input",
          kernels=None):
    """Validate and flatten once, choose the backend, apply :class:`NormFunction`; returns
    (y, h) in input's shape (h None without a residual). ``kernels``: None to follow
    :func:`backend`, True to force the kernels (:mod:`normbook.kernels`).

    This is the eager fast path of the kernel backend; everything else goes on to
    :func:`_slow`. A call is known by its signature: the input's shape, dtype and device, the
    parameters' and the residual's dtypes, the norm, the backend, D. The first call of a
    signature takes the slow path: the full checks and the launchers, which plan it, compile
    or find its kernels and keep them; the signature is then made ready
    (:func:`normbook.kernels._ready.ready`). Later calls check here what the signature does
    not fix (a plain tensor, dense rows and parameters, 16-byte aligned pointers, the
    parameters' length and device, eps, the current CUDA device; no tracer, transform,
    autocast or launch hook) and launch the kept kernels
    (:class:`~normbook.kernels._ready.Ready`), through the autograd Function only when a
    gradient is wanted. Host time per call is what a user of small batches waits for:
    ``python -m normbook.bench host``. The modules go one step shorter (:func:`_module_norm`).
    """
    t = type(normalized_shape)
    D = normalized_shape if t is int else (
        normalized_shape[0] if t in _SEQUENCES and len(normalized_shape) == 1 else None)
    if type(D) not in _DIMS and not _traced_size(D):   # (8.0,) or (True,): the full checks
        D = None                                        # refuse it, as torch's
    b = None if bias is _NO_BIAS else bias
    key = ready = None
    if type(input) is Tensor and D is not None and type(eps) is float and eps == eps and not (
            _compiling() or _transformed() or _any_autocast() or _tracing()
            or _fwAD._current_level >= 0):
        try:    # (a parameter or residual that is not a tensor: the slow path names it)
            key = _signature(input, weight, b, residual, is_rms, D, kernels)
            ready = _READY.get(key)
            if ready and not (
                    input.is_contiguous() and not input.is_neg()
                    and (weight is None or (weight.shape == (D,) and weight.device == key[2]
                                            and weight.is_contiguous() and not weight.is_neg()))
                    and (b is None or (b.shape == (D,) and b.device == key[2]
                                       and b.is_contiguous() and not b.is_neg()))
                    and (residual is None or (residual.shape == key[0]
                                              and residual.device == key[2]
                                              and residual.is_contiguous()
                                              and not residual.is_neg()))
                    and not (input.data_ptr() | (0 if weight is None else weight.data_ptr())
                             | (0 if b is None else b.data_ptr())
                             | (0 if residual is None else residual.data_ptr())) & 15
                    and (ready.device < 0 or _current_device() == ready.device)
                    and _K.plain()):
                ready = None
        except (AttributeError, RuntimeError):    # (RuntimeError: a strided nested tensor)
            key = ready = None
    if not ready:
        return _slow(input, normalized_shape, weight, bias, eps, is_rms, residual, name, kernels,
                     D, key)
    if _grad_enabled() and (input.requires_grad or (weight is not None and weight.requires_grad)
                            or (b is not None and b.requires_grad)
                            or (residual is not None and residual.requires_grad)):
        cfg = (eps, is_rms, _LAUNCH, None if b is None else b.dtype, residual is not None, ready)
        try:
            out = _eager_apply(input, residual, weight, b, cfg)
        except RuntimeError:    # (an inference tensor: see _copy_of_inference)
            out = _eager_apply(_copy_of_inference(input, residual), residual, weight, b, cfg)
        return (out, None) if residual is None else out
    y, h, _ = ready.forward(input, residual, weight, b, eps)   # no gradient: no Function
    return y, h


def _signature(input, weight, bias, residual, is_rms, D, kernels):
    """A call's signature (:func:`_norm`): what its launches were planned and compiled for."""
    return (input.shape, input.dtype, input.device, None if weight is None else weight.dtype,
            None if bias is None else bias.dtype, None if residual is None else residual.dtype,
            is_rms, D, _backend, kernels)


try:    # torch.compile's own C++ check of tensors against those its guard was made from
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:     # (a torch without it: the modules take the front door every call)
    _TensorGuards = None  # type: ignore[misc, assignment]
_NOTHING = torch.empty(0)   # a None parameter, as the guard sees it (no ready call has D = 0)
MAX_MODULE_CALLS = 64       # input shapes a module keeps before it starts again


class _Calls(dict):
    """A module's kept calls, input shape -> (guard, normalized_shape, backend, wants a
    gradient, the Function's cfg). They hold compiled kernels and C++ guards, which no copy of
    the module carries: a copy, deep copy or pickle of this is empty (whichever way the module
    is copied: ``torch.nn.utils.parametrize`` deep-copies its dict itself)."""

    __slots__ = ()

    def __reduce__(self):      # (what pickle and copy.deepcopy rebuild it from)
        return _Calls, ()


def _module_norm(module, input, weight, bias, eps, is_rms, round_xhat=False):
    """y of ``normbook.LayerNorm`` and ``normbook.RMSNorm`` (``bias`` :data:`_NO_BIAS`), for
    a plain tensor; ``round_xhat``: RMSNorm's mode, for a half input (:func:`_round`).

    A module is called again and again with the same parameters on inputs of a few shapes. So
    it keeps, per input shape, the ready signature (:func:`_norm`) its last call of that shape
    launched, with a guard: torch.compile's C++ check (``TensorGuards``) of the shape,
    strides, dtype, device, requires_grad and dispatch keys of the input and the parameters as
    they were, whatever has happened to them since (``.data`` replaced, moved, frozen). A call
    that passes it, and the checks no guard makes (16-byte aligned pointers, the same eps,
    normalized_shape, backend and current CUDA device; no tracer, transform, autocast, forward
    AD or launch hook), launches the kept kernels at once, about 1.2 us sooner than through
    :func:`_norm` (``python -m normbook.bench host``). Any other call goes through
    :func:`_norm`, which checks everything; its signature, if ready, is kept when its tensors
    are what the kept kernels take as they are (dense, neither inference tensors nor
    negative views).
    """
    shape = module.normalized_shape
    if (_compiling() or _transformed() or _any_autocast() or _tracing()
            or _fwAD._current_level >= 0):     # (first: a tracer sees nothing kept)
        if round_xhat:
            return rms_norm(input, shape, weight, eps, round_xhat=True)
        return _norm(input, shape, weight, bias, eps, is_rms)[0]
    b = None if bias is _NO_BIAS else bias
    calls = module.__dict__.get("_normbook_calls")
    if calls:
        call = calls.get(input.shape)
        if call is not None:
            guard, kept_shape, backend, grad, cfg, rounds = call
            ready = cfg[5]
            if (guard.check(input, _NOTHING if weight is None else weight,
                            _NOTHING if b is None else b)
                    and eps == cfg[0] and shape is kept_shape and _backend == backend
                    and rounds is round_xhat and ready.live
                    and not (input.data_ptr() | (0 if weight is None else weight.data_ptr())
                             | (0 if b is None else b.data_ptr())) & 15
                    and (ready.device < 0 or _current_device() == ready.device)
                    and _K.plain()):
                if grad and _grad_enabled():
                    if rounds:
                        return _round_apply(input, weight, eps, ready)
                    return _eager_apply(input, None, weight, b, cfg)
                return ready.forward(input, None, weight, b, eps)[0]
    if round_xhat:
        y = rms_norm(input, shape, weight, eps, round_xhat=True)
    else:
        y = _norm(input, shape, weight, bias, eps, is_rms)[0]
    if _TensorGuards is not None and type(shape) is tuple and len(shape) == 1 and type(eps) is float:
        ready = _READY.get(_round_key(input, weight) if round_xhat
                           else _signature(input, weight, b, None, is_rms, shape[0], None))
        tensors = (input, _NOTHING if weight is None else weight, _NOTHING if b is None else b)
        # kept only for what the kept kernels take as it is (the guard then holds it so):
        # dense rows and parameters, no inference tensor (the Function cannot save it) and no
        # negative view (see _values): the front door copies those
        if ready and all(t.is_contiguous() and not (t.is_inference() or t.is_neg())
                         for t in tensors):
            if calls is None or (len(calls) >= MAX_MODULE_CALLS and input.shape not in calls):
                calls = module.__dict__["_normbook_calls"] = _Calls()
            calls[input.shape] = (
                _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None),
                shape, _backend, any(t.requires_grad for t in tensors),
                (eps, is_rms, _LAUNCH, None if b is None else b.dtype, False, ready), round_xhat)
    return y


def _slow(input, normalized_shape, weight, bias, eps, is_rms, residual, name, kernels, D, key):
    """:func:`_norm` past its fast path: on the torch backend a shorter path for its common
    case (a plain tensor with dense rows, parameters None or (D,) floating tensors on its
    device, eps a float that is not NaN, outside any tracer or transform); everything else
    through the full checks (:func:`_checked`), which raise with a message or accept the rare
    case, so both give the same results. ``key``: the call's signature, made ready when the
    kernels' launchers took it (None: not a signature the fast path knows)."""
    if type(input) is Tensor and input.is_nested:        # torch.nested's strided layout
        return _nested_strided(input, normalized_shape, weight, bias, eps, is_rms, name,
                               kernels), None
    if key is not None and _READY.get(key) is None and type(input) is Tensor and (
            kernels or (kernels is None and _use_kernels(input))):
        out = _checked(input, normalized_shape, weight, bias, eps, is_rms, residual, name,
                       kernels, D)
        if _K.plain():   # (the call is one the fast path checks: key is not None)
            # what the launchers took as it is, made ready (None: not yet; False: never)
            made = _K.ready(input, residual, weight, None if bias is _NO_BIAS else bias, is_rms,
                            D)
            if made is not None:
                _READY[key] = made
        return out
    if (not kernels and type(input) is Tensor and type(eps) is float and eps == eps
            and type(D) is int and D and residual is None and (input.is_cpu or input.is_cuda)
            and not _use_kernels(input) and not _compiling() and _fwAD._current_level < 0
            and not _transformed() and not _any_autocast() and not _tracing()):
        shape, device = input.shape, input.device
        b = None if bias is _NO_BIAS else bias
        try:        # a parameter that is not a tensor: the checks below name it
            if shape and shape[-1] == D and input.dtype in _FLOAT_DTYPES and input.is_contiguous() \
                    and all(p is None or (p.shape == (D,) and p.dtype in _FLOAT_DTYPES
                                          and p.device == device and p.is_contiguous())
                            for p in (weight, b)):
                # (..., D) as it is (see _whole), with or without the Function (_apply decides)
                return _apply(input, None, weight, b, eps, is_rms, False)
        except AttributeError:
            pass
    if torch.jit.is_tracing() and D is not None:   # (torch.compile knows is_tracing)
        # torch.jit.trace holds sizes as values, and warns each time one decides a branch.
        # Over one dim, the checks below only check this call's arguments: the traced
        # Function normalizes the last dim whatever its size, so nothing the trace keeps
        # depends on them, and their warnings are silenced. (Over several dims the trace
        # keeps a reshape to this call's rank, and the tracer's warnings stay.)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return _checked(input, normalized_shape, weight, bias, eps, is_rms, residual, name,
                            kernels, D)
    return _checked(input, normalized_shape, weight, bias, eps, is_rms, residual, name, kernels,
                    D)


def _checked(input, normalized_shape, weight, bias, eps, is_rms, residual, name, kernels, D):
    """:func:`_norm` past its shorter path: the full checks, then :func:`_apply`. ``D``: the
    normalized size when ``normalized_shape`` names one dim, else None."""
    original = input
    fast = (D is not None and isinstance(input, Tensor) and input.dtype in _FLOAT_DTYPES
            and input.ndim and input.shape[-1] == D and type(eps) is float and eps == eps)
    if fast:
        for p in (weight, bias):
            if p is not None and p is not _NO_BIAS and not (
                    isinstance(p, Tensor) and p.ndim == 1 and p.shape[0] == D
                    and p.dtype in _FLOAT_DTYPES and p.device == input.device):
                fast = False
    if not fast:
        params = {"weight": weight} if bias is _NO_BIAS else {"weight": weight, "bias": bias}
        shape = _validate.check_norm_args(input, normalized_shape, params, eps, name)
        D = math.prod(shape)
        if len(shape) != 1:
            input = input.reshape(*input.shape[: input.dim() - len(shape)], D)
            weight = None if weight is None else weight.reshape(D)
            bias = None if bias is None or bias is _NO_BIAS else bias.reshape(D)
    if bias is _NO_BIAS:
        bias = None
    if residual is not None and not (isinstance(residual, Tensor) and residual.shape == input.shape
                                     and residual.dtype == input.dtype
                                     and residual.device == input.device):
        _check_residual(residual, input)
    device = input.device.type
    # (an int index: torch 2.11's Dynamo refuses to index a tuple by a bool, and fails
    # fullgraph compiles of CUDA tensors here; 2.13's accepts it)
    if device in _AUTOCAST_FP32[1 if is_rms else 0] and torch.is_autocast_enabled(device):
        return _autocast_fp32(original, input, D, weight, bias, eps, is_rms, residual, name,
                              kernels)
    if kernels is None:
        kernels = _use_kernels(input)
    if kernels:
        _check_kernel_args(input, weight, bias, name)
        kernels = _kernels_take(input, residual)
        _kernels()
        if not _compiling():   # (Dynamo cannot trace is_neg; a traced op gets real tensors)
            input, residual, weight, bias = _values(input, residual, weight, bias)
    if _whole(input):
        # (..., D) as they are, strided too (see _whole): the torch backend's forward makes
        # strided rows dense, for y's layout (see _torch_forward), the launchers for theirs
        x, r = input, residual
    else:
        x = input if input.ndim == 2 and (input.is_contiguous() or input.stride(1) == 1) else _rows(input)
        r = None if residual is None else _rows(residual)
    if weight is not None and not weight.is_contiguous():
        weight = weight.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    y, h = _apply(x, r, weight, bias, eps, is_rms, kernels)
    if y.shape != original.shape:       # rows, or trailing dims normalized as one
        # y a tensor of its own in the input's shape, as torch's (a view of the Function's
        # output could not be detached in place); nothing else holds y's storage, so nothing
        # needs the version a view shares. h stays a view: backward saved the h it views
        y = _unsafe_view(y, original.shape)
        h = None if h is None else h.view(original.shape)
    return y, h


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


def _nested_strided(input, normalized_shape, weight, bias, eps, is_rms, name, kernels):
    """A nested tensor of torch.nested's default, strided layout (whose sizes cannot be read,
    and which torch's LayerNorm takes): the norm of each of its tensors, nested again, their
    autograd history kept. ``normalized_shape`` None: each tensor's last dim."""
    parts = [_norm(t, t.shape[-1] if normalized_shape is None else normalized_shape, weight,
                   bias, eps, is_rms, None, name, kernels)[0] for t in input.unbind()]
    return torch.nested.as_nested_tensor(parts, layout=torch.strided)


_Proxy = torch.fx.Proxy


def _fx_node(fn, *args, **kwargs):
    """The call ``fn(*args)`` as torch.fx.symbolic_trace records it, one node, for arguments
    that hold a tracer's Proxy (which the door's checks cannot read): fx records torch's norms
    so, as leaf modules or functions, and the traced GraphModule calls ``fn`` when it runs.
    normbook's modules pass a Proxy on to the public functions, so they trace the same way."""
    proxy = next(a for a in args if isinstance(a, _Proxy))
    return proxy.tracer.create_proxy("call_function", fn, args, kwargs)


def _ln_eps(eps):
    return eps if type(eps) is float else _validate.as_eps(eps)


def _rms_eps(input, eps):
    return eps if type(eps) is float else _validate.as_eps(_validate.default_eps(input, eps))


def layer_norm(input: Tensor, normalized_shape: int | Sequence[int],
               weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float | Tensor = 1e-5, *, upcast: bool | str = False) -> Tensor:
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
        upcast: keyword only, not torch's. ``True``: compute as
            ``torch.nn.functional.layer_norm(input.float(), ...).to(input.dtype)`` does, the
            parameters taken in float32: the LayerNorm of Hugging Face's OLMo and of OpenAI's
            CLIP and Whisper, which run torch's float32 kernel on a float32 copy of half rows.
            Without it, half rows go to torch's kernel as they are (as ``torch.nn.LayerNorm``
            in bf16 does): the same formula, in float32 too, but summed in another order, so
            that a few values in 10^5 differ by a unit in the last place (measured on the CPU,
            torch 2.13). A no-op for float32 and float64 inputs. ``"ops"``: the equations
            written out in torch ops over a float32 copy (float64 stays float64), each its own
            op in this order: mean, ``(x - mean).pow(2).mean()``, ``(x - mean) * rsqrt(var +
            eps)``, ``weight * xhat``, ``+ bias``, one rounding to the input's dtype; the
            gradients are autograd's through those ops. That is Cohere's LayerNorm; torch's
            fused kernel sums in another order, so its float32 values differ from these in
            about a third of the places by a unit (measured on the CPU, torch 2.13), float32
            inputs included. Both are no-ops on the kernels, which read half rows and compute
            in float32 whichever way (under autocast too the result keeps the input's dtype).

    Returns:
        Tensor: of input's shape and dtype, computed by the backend :func:`backend` chooses
            (by default the Triton kernels for CUDA tensors when Triton is installed, torch ops
            with fp32 reductions for bf16/fp16 otherwise). Double backward, forward-mode AD,
            torch.func, torch.compile and torch.export work on both. Under autocast on CUDA,
            XPU or MPS, as torch's: half inputs cast to float32, a float32 result.

    Differs from torch on purpose: ``normalized_shape`` may be an int (torch's functional
    wants a tuple, measured on torch 2.13; its modules take an int, and so does this, for
    the same D); weight and bias may have another floating dtype than the
    input (torch's CPU kernel refuses that; on the kernel backend float16, bfloat16 or
    float32, a TypeError otherwise); rows whose variance overflows (fp32 values past
    about 1e19) give the finite, correct answer where torch gives zeros or NaN (measured on
    the CPU, torch 2.13: zeros for [3e19, 1, 2, 0], NaN for [1e20, 2e20, 3e20, 4e20]), as
    long as the row's sum, and so its mean, stays within fp32 (a row whose sum overflows,
    [3e38, 3e38, 1, 2], gives NaN, as torch's); a row holding an infinity gives NaN, as
    torch's; on the kernel backend, with eps 0 (or as small), a row of values below about
    1e-19, whose variance falls into fp32's subnormals or to zero, keeps fp32's accuracy (its
    sums taken again on the row scaled by 2^64), where torch and the torch backend lose digits
    and then give infinities (measured on the CPU, torch 2.13, x = randn(8) * s: largest error
    3e-5 at s = 1e-20, 0.2 at 1e-22, inf at 1e-25; the kernels 1e-7); an eps
    of NaN (ValueError) or a bool (TypeError) is refused, where torch returns NaN or takes
    True as 1.0. Any other eps that is not a number is a TypeError, as in torch.
    """
    if type(input) is not Tensor:
        if isinstance(input, _Proxy):     # torch.fx.symbolic_trace
            modes = {"upcast": upcast} if upcast is not False else {}
            return _fx_node(layer_norm, input, normalized_shape, weight, bias, eps, **modes)
        if isinstance(input, Tensor) and input.is_nested and not upcast:
            return _nested(layer_norm, input, normalized_shape, weight, bias, eps)
    if upcast is not False:
        return _ln_upcast(input, normalized_shape, weight, bias, eps, upcast)
    return _norm(input, normalized_shape, weight, bias, _ln_eps(eps), False)[0]


def _ln_upcast(input, normalized_shape, weight, bias, eps, upcast):
    """:func:`layer_norm` with ``upcast``: half rows on the torch backend, or under autocast,
    as ``layer_norm(input.float(), weight.float(), bias.float()).to(input.dtype)``, composed
    through autograd (so its gradients are those of the same operations); everything else the
    plain call, which computes the same operations in float32 without the copy. ``"ops"``:
    :func:`_ln_ops` where the torch backend computes (every floating dtype), else the same
    plain call."""
    _validate.check_upcast(upcast)
    on_torch = isinstance(input, Tensor) and (not _use_kernels(input) or _any_autocast())
    if upcast == "ops" and on_torch:
        return _ln_ops(input, normalized_shape, weight, bias, eps)
    if on_torch and input.dtype in _HALF:
        weight, bias = (_fp32(p) if isinstance(p, Tensor) else p for p in (weight, bias))
        y = layer_norm(input.float(), normalized_shape, weight, bias, eps)
        return y.to(input.dtype)
    return layer_norm(input, normalized_shape, weight, bias, eps)


def _ln_ops(input, normalized_shape, weight, bias, eps):
    """``layer_norm(..., upcast="ops")`` on the torch backend: (ln-mean) to (ln-y) as separate
    torch ops over a float32 copy (float64 as it is), recorded by autograd, rounded once."""
    params = {"weight": weight, "bias": bias}
    eps = _ln_eps(eps)            # a 0-d tensor, as the other upcasts take it
    shape = _validate.check_norm_args(input, normalized_shape, params, eps)
    dims = tuple(range(-len(shape), 0))
    h = input if input.dtype in (torch.float32, torch.float64) else input.float()
    mean = h.mean(dims, keepdim=True)                                    # (ln-mean)
    var = (h - mean).pow(2).mean(dims, keepdim=True)                     # (ln-var)
    y = (h - mean) * torch.rsqrt(var + eps)                              # (ln-rstd), (ln-xhat)
    if weight is not None:
        y = weight.to(h.dtype) * y                                       # (ln-y)
    if bias is not None:
        y = y + bias.to(h.dtype)
    return y.to(input.dtype)


def rms_norm(input: Tensor, normalized_shape: int | Sequence[int],
             weight: Tensor | None = None, eps: float | Tensor | None = None, *,
             offset: float = 0.0, round_xhat: bool = False) -> Tensor:
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
        offset: gamma = offset + weight, the sum taken in float32 (Gemma's ``1 + weight``:
            offset 1.0); a nonzero offset needs a weight (ValueError without one). Keyword
            only, as is ``round_xhat``; neither is torch's.
        round_xhat: round xhat to the input's dtype before the weight multiplies, and the
            product to it again, y = weight * xhat.to(input.dtype) (Llama's order of
            operations in bf16 and fp16; a weight of a wider dtype than the input's gives
            y in the weight's, as that product promotes: float32 for a bf16 input and a
            float32 weight, as Hugging Face's); by default the product is taken in float32
            and rounded once. A no-op for float32 and float64 inputs. On the kernels, in eager
            mode, rows of up to 8192 values with a weight of their dtype take it in one
            fused pass each way; otherwise it is the norm and then a multiplication.

    Returns:
        Tensor: of input's shape and dtype (with ``round_xhat``, the promoted dtype of input
            and weight, see above); under autocast, as torch's: float32 (half inputs cast to
            float32 first) on the devices whose autocast casts ``F.rms_norm`` in the running
            torch (CUDA and XPU in torch 2.13; none in torch 2.11, which leaves it in the input's
            dtype), read from its dispatcher. Contiguous: torch's composed rms_norm keeps a
            channels-last input's memory format (its values are the same).

    Differs from torch on purpose: ``normalized_shape`` may be an int, as in
    :func:`layer_norm`; complex inputs are refused (torch accepts them); the weight
    may have another floating dtype than the input (on the kernel backend float16, bfloat16
    or float32, a TypeError otherwise), and an integer or bool weight is refused (torch's
    composed rms_norm multiplies by it); rows of finite values whose mean square
    overflows give the finite, correct answer where torch gives zeros (measured on the CPU,
    torch 2.13, for [1e20, 2e20, 3e20, 4e20]; a row holding an infinity gives torch's NaN
    there and 0 elsewhere); with eps 0 (or as small), rows of values below about 1e-19 keep
    fp32's accuracy on the kernel backend, as :func:`layer_norm`'s do (torch 2.13's largest
    error at x = randn(8) * s: 7e-6 at s = 1e-20, 0.3 at 1e-22, inf at 1e-25; the kernels
    2e-7); an eps of NaN or a bool is refused, as by :func:`layer_norm`.
    """
    if type(input) is not Tensor and isinstance(input, _Proxy):     # torch.fx.symbolic_trace
        modes = dict(offset=offset, round_xhat=round_xhat) if offset or round_xhat else {}
        return _fx_node(rms_norm, input, normalized_shape, weight, eps, **modes)
    if round_xhat is not False or type(offset) is not float or offset:
        # checked whenever not the defaults: a falsy None or 0 was taken where 1 was refused
        if _validate.check_modes(offset, round_xhat, weight is not None) or round_xhat:
            return _rms_modes(input, normalized_shape, weight, eps, offset, round_xhat)
    if type(input) is not Tensor:
        if isinstance(input, Tensor) and input.is_nested:
            return _nested(rms_norm, input, normalized_shape, weight, eps)
    return _norm(input, normalized_shape, weight, _NO_BIAS, _rms_eps(input, eps), True)[0]


def _rms_modes(input, normalized_shape, weight, eps, offset, round_xhat):
    """:func:`rms_norm` with an ``offset`` or ``round_xhat``, composed from the plain one (on
    either backend, both directions, through autograd): gamma = weight.float() + offset, a (D,)
    operation; with ``round_xhat`` and a half input, y = gamma * rms_norm(input) (xhat
    rounded to the input's dtype by the norm without a weight, then the product rounded), else
    the plain norm with gamma, its product in float32 rounded once. Those are the operations
    of the Hugging Face norms the modes reproduce (Gemma's ``(xhat * (1.0 +
    weight.float())).type_as(x)``, Llama's ``weight * xhat.to(input_dtype)``). The kernels'
    eager case of ``round_xhat`` is fused instead (:class:`_RoundXhat`): the same operations
    in one pass."""
    offset = _validate.check_modes(offset, round_xhat, weight is not None)
    if (round_xhat and not offset and type(input) is Tensor and input.dtype in _HALF
            and _rounds_fused(input, normalized_shape, weight, eps)):
        # fused, the kernels' eager case (what it takes passes every check below). The
        # kernels read the weight as D dense values: a view (a column of a stacked weight, an
        # expand) is copied, as the door copies it for the plain call
        weight = weight if weight.is_contiguous() else weight.contiguous()
        return _round(input, weight, _rms_eps(input, eps))
    if not (isinstance(input, Tensor) and input.is_nested):   # (a nested input: _nested's)
        # the plain call's checks of the input and the weight, before gamma is formed from
        # it: a weight of the wrong shape was broadcast, an integer or complex one taken
        _validate.check_input(input)
        shape = _validate.as_shape(normalized_shape)
        _validate.check_normalized_shape(input, shape)
        _validate.check_param(weight, "weight", input, shape)
    if offset:
        weight = weight.float() + offset
    if (round_xhat and weight is not None and isinstance(input, Tensor)
            and input.dtype in _HALF):
        return weight * rms_norm(input, normalized_shape, None, eps)
    return rms_norm(input, normalized_shape, weight, eps)


_PLAIN = _math._PLAIN_TYPES   # Tensor or Parameter: a module's weight is a Parameter


def _rounds_fused(input, normalized_shape, weight, eps) -> bool:
    """Whether ``rms_norm(..., round_xhat=True)`` of a half input takes :class:`_RoundXhat`:
    the kernels' eager case, a plain tensor whose rows (D of at most ``_FUSED_D`` values, the
    rows kernels') are normalized over the last dim, a (D,) weight of its dtype and device,
    eps a number that is not NaN (or None), and no tracer, transform, autocast or forward-mode
    AD; anything else (and every refusal) takes the composition."""
    D = input.shape[-1] if input.dim() else 0
    return (type(input) is Tensor and type(weight) in _PLAIN and weight.dtype == input.dtype
            and 0 < D <= _FUSED_D and _just(normalized_shape, D)
            and weight.shape == (D,) and weight.device == input.device
            and (eps is None or (type(eps) is float and eps == eps))
            and _use_kernels(input)
            and not (_compiling() or _transformed() or _any_autocast() or _tracing()
                     or _fwAD._current_level >= 0)
            # (see _values; after the tracers' test: Dynamo cannot trace is_neg)
            and not (input.is_neg() or weight.is_neg()))


def _just(normalized_shape, D: int) -> bool:
    """Whether ``normalized_shape`` is D or (D,) exactly, in ints: ``in (D, (D,), [D])`` took
    8.0, (8.0,), True (D = 1) and tensor(8), which torch refuses (the composition checks)."""
    if type(normalized_shape) in (tuple, list, torch.Size) and len(normalized_shape) == 1:
        normalized_shape = normalized_shape[0]
    return type(normalized_shape) is int and normalized_shape == D


def _round_key(input, weight) -> tuple:
    """The signature of a fused ``round_xhat`` call (:func:`_round`) in the ready table."""
    return _ROUND, input.shape, input.dtype, input.device, weight.dtype, _backend


_ROUND = "round_xhat"


def _round(input, weight, eps: float):
    """``rms_norm(input, D, weight, eps, round_xhat=True)`` on the kernels, fused
    (:func:`_rounds_fused` has said it is; weight dense): :class:`_RoundXhat`, launched as
    :func:`_norm` launches the plain norm. The first call of a signature goes through the
    launchers and makes it ready; later ones launch its kept kernels, checking what the
    signature does not fix (dense rows, 16-byte aligned pointers, the current CUDA device, no
    launch hook), and without the Function when no gradient is wanted."""
    k = _kernels()
    key = _round_key(input, weight)
    ready = _READY.get(key)
    if ready and not (input.is_contiguous()
                      and not (input.data_ptr() | weight.data_ptr()) & 15
                      and (ready.device < 0 or _current_device() == ready.device)
                      and k.plain()):
        ready = None
    if ready and not (_grad_enabled() and (input.requires_grad or weight.requires_grad)):
        return ready.forward(input, None, weight, None, eps)[0]    # no gradient: no Function
    try:
        y = _round_apply(input, weight, eps, ready)
    except RuntimeError:   # (an inference tensor: see _copy_of_inference)
        y = _round_apply(_copy_of_inference(input, None), weight, eps, ready)
    if ready is None and key not in _READY and k.plain():
        made = k.ready(input, None, weight, None, True, input.shape[-1], True)
        if made is not None:       # (None: not yet, this call's layout; False: never)
            _READY[key] = made
    return y


class _RoundXhat(torch.autograd.Function):
    """``rms_norm(input, D, weight, eps, round_xhat=True)`` of half rows on the kernels, fused
    (:func:`_rounds_fused` says when): y = weight * xhat.to(dtype), rounded, in the rows
    kernel's one pass, where the composition, ``weight * rms_norm(input, D)``, writes xhat, reads
    it back and keeps it for backward (``normbook.kernels._config._rounding``). ``apply(input,
    weight, eps) -> y``, input (..., D), weight (D,) of input's dtype, eps a float.

    Backward: dweight = sum over rows of dy * xhat.to(dtype), the rounded xhat the weight
    multiplied; dx is (rms-dx) of ghat = dy * weight in fp32 (the composition's autograd rounds
    that product to the input's dtype first: the two agree within its rounding). When autograd
    is building a graph of the backward (create_graph), it is the composition's, through
    autograd, so that second derivatives are right. ``ready``: the signature's kept kernels
    (a :class:`~normbook.kernels._ready.Ready`, from :func:`_round`), or None for the
    launchers."""

    @staticmethod
    def forward(ctx, x, weight, eps, ready):
        if ready is not None:
            y, _, stats = ready.forward(x, None, weight, None, eps)
        else:
            y, _, stats = _kernels().norm_forward(_rows(x), None, weight, None, eps, True, True)
            y = y.view(x.shape)
        ctx.save_for_backward(x, weight, stats)
        ctx.eps, ctx.ready = eps, ready
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, stats = ctx.saved_tensors
        if _grad_enabled() or _transformed() or _legacy_batched(dy) or _fwAD._current_level >= 0:
            # create_graph, batched gradients (is_grads_batched, a torch.func transform) or
            # tangents: the composition, through autograd, which the launchers are not
            wanted = [t for t, need in zip((x, weight), ctx.needs_input_grad) if need]
            with torch.enable_grad():
                y = weight * rms_norm(x, x.shape[-1], None, ctx.eps)
                grads = iter(torch.autograd.grad(y, wanted, dy, create_graph=True))
            return (*(next(grads) if need else None for need in ctx.needs_input_grad[:2]),
                    None, None)
        (dy,) = _values(dy)     # (see _values: the launcher reads memory)
        ready = ctx.ready
        if ready is not None and ready.live and not (_compiling() or not _K.plain()):
            grads = ready.backward(dy, None, x, weight, stats, None)
            if grads is not None:       # (None: dy not dense, or not kept yet)
                return grads[0], grads[1], None, None
        dx, dweight, _ = _K.norm_backward(_rows(dy), None, _rows(x), weight, stats, None, True,
                                          True)
        return dx.view(x.shape), dweight, None, None


# (the C++ apply, as NormFunction's _eager_apply: _rounds_fused has excluded the transforms
# that torch's Python apply would look for)
_round_apply = super(torch.autograd.Function, _RoundXhat).apply


def _add_norm(x, residual, weight, bias, eps, is_rms, kernels=None):
    """The fused add's door: (y, h) = (norm(x + residual), x + residual) over the last dim,
    for :func:`add_layer_norm`, :func:`add_rms_norm` and their kernel aliases."""
    if residual is None:
        raise TypeError("residual: expected a torch.Tensor, got None")
    if isinstance(x, Tensor) and x.dim() == 0:
        raise _validate.ShapeError("x: expected a tensor of shape (..., D) with at least one "
                                   "dim, got a 0-d tensor")
    if type(x) is not Tensor and isinstance(x, Tensor) and x.is_nested:
        # a jagged nested tensor: torch's add, then the norm of the sum's values (_nested; the
        # custom ops take no nested tensor), on either backend
        h = x + residual
        y = _nested(lambda v, shape: _norm(v, shape, weight, bias, eps, is_rms, None, "x",
                                           kernels)[0], h, h.shape[-1])
        return y, h
    try:
        D = x.shape[-1] if isinstance(x, Tensor) else 0
    except RuntimeError:
        if not x.is_nested:
            raise
        h = x + residual        # torch.nested's strided layout, whose sizes cannot be read
        return _nested_strided(h, None, weight, bias, eps, is_rms, "x", kernels), h
    if type(D) is not int:   # torch.jit.trace gives sizes as tensors: only the checks read D
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            D = int(D)
    return _norm(x, D, weight, bias, eps, is_rms, residual, "x", kernels)


def add_layer_norm(x: Tensor, residual: Tensor, weight: Tensor | None = None,
                   bias: Tensor | None = None,
                   eps: float | Tensor = 1e-5) -> tuple[Tensor, Tensor]:
    """(fork-rule): h = x + residual, y = LayerNorm(h) over the last dim, in one pass.

    x and the residual are each read once, h is written once (on the kernel backend). In
    backward, h forks into the norm and the next residual branch, so its gradient is the sum
    of both, and that sum is the gradient of x and of the residual alike ("Residual
    connections"). Under autocast on CUDA, XPU or MPS it is torch's composition: h = x +
    residual in their dtype, y the float32 norm of h (not one pass). The sum is formed inside
    the one backward: a hook on h, or ``h.grad``
    after ``h.retain_grad()``, sees only the gradient arriving at h from downstream (None
    where h is unused), not the part through y, where torch's ``h = x + residual`` followed
    by the norm would show the sum. Hook x or the residual for the total. For the same
    reason y is not computed from h in autograd's graph: ``torch.autograd.grad(y, h)``
    raises that h was not used (and gives None with ``allow_unused=True``, which is not a
    zero derivative); differentiate with respect to x or the residual, which receive that
    derivative. Under forward-mode AD, h is torch's own ``x + residual`` and y its norm.

    Args:
        x, residual: ``(..., D)``, of one shape, dtype and device: not broadcast or promoted
            as ``x + residual`` would be (h is the stream both feed); a mismatch is an error
            naming residual.
        weight, bias: (D,) or None.
        eps: added to the variance inside the square root.

    Returns:
        tuple: (y, h), both of x's shape and dtype.
    """
    if (type(x) is not Tensor or type(residual) is not Tensor) and (
            isinstance(x, _Proxy) or isinstance(residual, _Proxy)):   # torch.fx.symbolic_trace
        return _fx_node(add_layer_norm, x, residual, weight, bias, eps)
    return _add_norm(x, residual, weight, bias, _ln_eps(eps), False)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None = None,
                 eps: float | Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(fork-rule): h = x + residual, y = RMSNorm(h) over the last dim, in one pass.

    Forward (rms-ms), (rms-y) on h; gradient (rms-dx) plus the gradient arriving at h. As
    :func:`add_layer_norm` without the mean and the bias.

    Args:
        x, residual: ``(..., D)``, of one shape, dtype and device: not broadcast or promoted
            as ``x + residual`` would be (h is the stream both feed); a mismatch is an error
            naming residual.
        weight: (D,) or None.
        eps: added to the mean square inside the square root; None means fp32's machine
            epsilon for half and fp32 inputs (as :func:`rms_norm`).

    Returns:
        tuple: (y, h), both of x's shape and dtype.
    """
    if (type(x) is not Tensor or type(residual) is not Tensor) and (
            isinstance(x, _Proxy) or isinstance(residual, _Proxy)):   # torch.fx.symbolic_trace
        return _fx_node(add_rms_norm, x, residual, weight, eps)
    return _add_norm(x, residual, weight, _NO_BIAS, _rms_eps(x, eps), True)
