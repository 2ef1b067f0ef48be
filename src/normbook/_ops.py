"""The kernels' custom ops, ``torch.ops.normbook.norm_forward`` and ``norm_backward``, defined
without Triton.

``import normbook`` defines them (it never imports triton): a program exported with
``torch.export`` on the kernel backend names them, and ``torch.export.load`` finds them after
``import normbook`` alone. Their implementations import the launchers
(:mod:`normbook.kernels`, and so Triton) when first run on a CUDA tensor (or under Triton's
interpreter); on other tensors they compute the torch backend's formulas, so that a program
exported on a GPU also runs on a CPU. Each op has a fake (shape-only)
implementation, so that ``torch.compile`` traces through it, and sharding rules for DTensor
(:mod:`normbook.kernels._dtensor`). In eager mode and under ``torch.compile`` autograd is
:class:`normbook.functional.NormFunction`'s, which calls these ops inside its forward and
backward; ``norm_forward`` also has a formula of its own (``norm_backward``), for graphs that
hold the op itself: an exported program run with gradients.

Why opaque ops with fake implementations, and not ``torch.library.triton_op`` (kernels that
Inductor sees): Inductor does not fuse its own code into a user's Triton kernel, so seeing them
would buy no fusion, while the launchers decide at run time what a traced launch could not
express (the grid from the device's SM count and the compiled kernel's measured occupancy, a
cooperative launch for shared rows, a finish kernel only when several groups kept partials).
And the opaque op is fast where it is: on the H200, M = 32768, D = 4096, bf16, forward and
backward under torch.compile took 0.610 ms with these ops against 0.918 ms for a compiled
``torch.nn.LayerNorm`` (the H200 run of 2026-12-04, at 98327f3). Autocast is not registered on the
ops either: the front door applies torch's float32 rule for the norms (``functional.
_AUTOCAST_FP32``) before choosing a backend, so that the torch backend, whose composed ops
autocast does not list, follows it too, and one rule serves both backends.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["norm_forward", "norm_backward"]


def own_dispatch(t) -> bool:
    """A tensor subclass with a dispatch of its own (a DTensor; under tracing, a FakeTensor),
    not a Parameter nor a subclass that only wraps results (``__torch_function__``)."""
    return (type(t) is not Tensor and isinstance(t, Tensor)
            and type(t).__torch_dispatch__ is not Tensor.__torch_dispatch__)


def _rows(t: Tensor) -> Tensor:
    """(..., D) -> (M, D) with a unit stride along D. Row strides are kept (a slice of a wider
    tensor is read in place); only a non-contiguous last dim is copied. A tensor subclass with
    a dispatch of its own (a DTensor) keeps its leading dims (flattening (B, T) sharded over
    T would all-gather it)."""
    if t.dim() != 2 and not own_dispatch(t):
        D = t.shape[-1]
        t = t.reshape(-1, D) if D else t.reshape(math.prod(t.shape[:-1]), 0)
    return t.contiguous() if t.stride(-1) != 1 and t.shape[-1] > 1 else t


def _launches(x: Tensor) -> bool:
    """Whether the ops launch the kernels for x: a CUDA tensor, or any under Triton's
    interpreter. Elsewhere (a program exported on the kernel backend, run on a CPU without the
    interpreter, or where Triton is not installed) they compute the torch backend's formulas,
    as the front door does for such a tensor: the same equations and outputs, summed in
    another order."""
    if x.is_cuda:
        return True
    try:
        from normbook.kernels import ops
    except ImportError:       # no Triton
        return False
    return ops.interpreted()


@torch.library.custom_op("normbook::norm_forward", mutates_args=())
def norm_forward(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor],
                 bias: Optional[Tensor], eps: float, is_rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(ln-y) or (rms-y) over the last dim of x, (..., D): returns y, h (empty without
    residual) and the fp32 stats, (2, ...) mean and rstd, or (1, ...) rstd for RMSNorm.
    The public functions pass (M, D) rows; a DTensor keeps its leading dims (its sharding
    rules, ``_dtensor``, keep each token's row whole on one rank)."""
    lead = x.shape[:-1]
    r = None if residual is None else _rows(residual)
    if _launches(x):
        from normbook.kernels import _forward

        y, h, stats = _forward.norm_forward(_rows(x), r, weight, bias, eps, is_rms)
    else:
        from normbook.functional import _torch_forward

        y, h, stats = _torch_forward(_rows(x), r, weight, bias, eps, is_rms)
        stats = stats.contiguous()        # (as the fake's: the half rows' is a transposed view)
    if len(lead) != 1:
        # (k, *lead), k named: an empty batch's -1 would be ambiguous
        y, h = y.view(x.shape), None if h is None else h.view(x.shape)
        stats = stats.view(stats.shape[0], *lead)
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
    rows = (_rows(dy), None if dh is None else _rows(dh), _rows(x), weight,
            stats.reshape(stats.shape[0], -1))
    if _launches(x):
        from normbook.kernels import _backward

        # (new zeroed slots for rows shared among programs: a compiled graph's CUDA graph tree
        # warms up in a memory pool it may reclaim, where no buffer kept across calls may live)
        dx, dweight, dbias = _backward.norm_backward(*rows, bias_dtype, is_rms,
                                                     kept_slots=False)
    else:      # (eps only recomputes the statistics, which are given here)
        from normbook.functional import _torch_backward

        dx, dweight, dbias = _torch_backward(*rows, 0.0, is_rms, bias_dtype, False)
    empty = x.new_empty((0,))
    return (dx if x.dim() == 2 else dx.view(x.shape), empty.clone() if dweight is None else dweight,
            empty if dbias is None else dbias)


@norm_backward.register_fake
def _(dy, dh, x, weight, stats, bias_dtype, is_rms):
    D = x.shape[-1]
    return (x.new_empty(x.shape), x.new_empty((0,)) if weight is None else weight.new_empty((D,)),
            x.new_empty((0,)) if bias_dtype is None else x.new_empty((D,), dtype=bias_dtype))


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, _, is_rms = inputs
    _, h, stats = output
    ctx.save_for_backward(x if residual is None else h, weight, stats)
    ctx.cfg = (residual is not None, None if bias is None else bias.dtype, is_rms)


def _backward_formula(ctx, dy, dh, dstats):
    """norm_forward's gradient: (ln-dx) / (rms-dx) and (ln-dparams) by ``norm_backward``, the
    fork rule's dh added to dx, which x and the residual both receive."""
    has_residual, bias_dtype, is_rms = ctx.cfg
    saved, weight, stats = ctx.saved_tensors
    dh = dh if has_residual else None
    if dy is None:                       # only h was used: nothing flows through y
        return dh, dh, None, None, None, None
    dx, dweight, dbias = norm_backward(dy, dh, saved, weight, stats, bias_dtype, is_rms)
    return (dx, dx if has_residual else None, None if weight is None else dweight,
            None if bias_dtype is None else dbias, None, None)


norm_forward.register_autograd(_backward_formula, setup_context=_setup_context)
