# mypy: disable-error-code="union-attr,attr-defined"
"""Norms across devices, chapter "Norms across devices".

Two ways a norm's input can be split over ranks, and what each needs:

- **Over tokens** (data or sequence parallel): each rank holds whole rows, so the statistics,
  y and dx are local. Only the parameter gradients, sums over every token ``"nd->d"``
  (ln-dparams), are partial on each rank and need an all-reduce. DTensor does this for the
  modules and for the kernels (``normbook.kernels._dtensor``); :func:`all_reduce_param_grads`
  is the same step written out for code that shards tokens by hand.
- **Over features** (tensor parallel over D): each rank holds a slice of every row. Its local
  statistics are merged across ranks with Chan's formula (kern-chan), and the backward's two
  sums c1, c2 (ln-c) are one all-reduce of two scalars per token: :func:`layer_norm_sharded`
  and :func:`rms_norm_sharded`.

Everything here is plain torch.distributed on a process group (gloo on the CPU, NCCL on GPUs);
:func:`launch` runs a function on a few local CPU processes, for the chapter and the tests.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from normbook import _validate
from normbook._math import _sum_tokens

__all__ = ["merge_stats", "layer_norm_sharded", "rms_norm_sharded", "all_reduce_param_grads",
           "launch", "sequence_parallel_experiment", "feature_parallel_experiment",
           "dtensor_experiment", "fsdp_experiment"]


def merge_stats(n: torch.Tensor, mean: torch.Tensor,
                m2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chan's merge (kern-chan) of K chunks' statistics, in chunk order (deterministic).

    A chunk may be empty (n = 0, a rank that holds no features): it adds nothing, whatever
    its mean and m2 say. No product of a count of zero with a large squared difference is
    formed, so an empty chunk cannot turn 0 * inf into NaN.

    Args:
        n: (K,) element counts of the chunks (integer or floating: the merge weighs in mean's
            dtype either way).
        mean, m2: (K, ...) floating, each chunk's mean and sum of squared deviations from it,
            per token.

    Returns:
        tuple: (N, mean, m2) of all chunks together: N a scalar tensor (n's dtype), mean and m2 of
            shape (...).
    """
    for name, t in (("n", n), ("mean", mean), ("m2", m2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"merge_stats: {name}: expected a tensor, got {type(t).__name__}")
    if not (mean.is_floating_point() and m2.dtype == mean.dtype):
        raise TypeError(f"merge_stats: mean and m2: expected one floating dtype, got "
                        f"{mean.dtype} and {m2.dtype}")
    if not (n.dim() == 1 and n.shape[0] >= 1 and mean.shape[:1] == n.shape
            and m2.shape == mean.shape):
        raise ValueError(f"merge_stats: expected n (K,) with K >= 1, mean and m2 (K, ...), got "
                         f"{tuple(n.shape)}, {tuple(mean.shape)}, {tuple(m2.shape)}")
    empty = (n == 0).reshape(-1, *([1] * (mean.dim() - 1)))       # (K, 1, ...)
    mean, m2 = mean.masked_fill(empty, 0), m2.masked_fill(empty, 0)
    counts, dtype = n, mean.dtype
    # the weights in mean's dtype, at least float32: int64 counts divided in float32 were off by
    # 2e-8 in float64, and counts past 65504 overflow float16
    work = torch.promote_types(mean.dtype, torch.float32)
    n, mean, m2 = n.to(work), mean.to(work), m2.to(work)
    n_a, mean_a, m2_a = n[0], mean[0], m2[0]
    for k in range(1, n.shape[0]):
        n_b, mean_b, m2_b = n[k], mean[k], m2[k]
        total = n_a + n_b
        share_b = n_b / total.clamp_min(1)                 # n_b / N; 0 when both are empty
        delta = mean_b - mean_a                            # (kern-chan)
        mean_a = mean_a + delta * share_b
        m2_a = m2_a + m2_b + (n_a * share_b) * delta * delta   # the count first: 0 stays 0
        n_a = total
    return counts.sum(), mean_a.to(dtype), m2_a.to(dtype)


class _SumOverRanks(torch.autograd.Function):
    """t summed over the ranks of ``group``, differentiable: every rank's input reaches every
    rank's sum, so the gradient of a rank's input is the sum over the ranks of the gradients
    arriving at their sums (again this Function: differentiable twice and more)."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad):
        return _SumOverRanks.apply(grad.contiguous(), ctx.group), None


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """t summed (or reduced by ``op``) over the ranks, as a new tensor.

    While autograd records (a backward run with ``create_graph=True``), a sum goes through
    :class:`_SumOverRanks`, whose backward sums the gradients over the ranks: the graph of the
    backward then reaches every rank's x, and second derivatives are right.
    """
    if op == dist.ReduceOp.SUM and torch.is_grad_enabled():
        return _SumOverRanks.apply(t, group)
    t = t.clone()
    dist.all_reduce(t, op=op, group=group)
    return t


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    """(world, *t.shape): every rank's t, in rank order; differentiable as :func:`_all_reduce`
    (each rank writes its t into its row of zeros, and the rows are summed over the ranks)."""
    if torch.is_grad_enabled():
        rows = t.new_zeros((dist.get_world_size(group), *t.shape))
        rows[dist.get_rank(group)] = t
        return _SumOverRanks.apply(rows, group)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return torch.stack(out)


_DTYPE_CODES = {torch.float16: 16, torch.bfloat16: 17, torch.float32: 32, torch.float64: 64}
_SHOWN_DIMS = 8     # leading sizes each rank sends for the message (the hash checks them all;
                    # with 4, ranks differing in a fifth showed the same four)


def _check_group(group) -> None:
    """A ProcessGroup or None, of which this rank is a member (a ValueError or TypeError
    naming ``group``, before any collective)."""
    if group is not None and group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", None):
        # (what new_group returns on the ranks it leaves out)
        raise ValueError(f"group: expected a group this rank belongs to; global rank "
                         f"{dist.get_rank()} is not one of its ranks")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        hint = " (a DeviceMesh's: mesh.get_group())" if hasattr(group, "get_group") else ""
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup or None (the default "
                        f"group){hint}, got {type(group).__name__}")
    if group is not None and dist.is_initialized() and dist.get_rank(group) < 0:
        raise ValueError(f"group: expected a group this rank belongs to; global rank "
                         f"{dist.get_rank()} is not one of its ranks")


def _is_dtensor(x) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:                                  # pragma: no cover
        return False
    return isinstance(x, DTensor)


def _agreed(x, weight, bias, eps, is_rms: bool, group):
    """(eps as a float, every rank's feature count) for a sharded norm's call, after its
    arguments are checked (:func:`_check`) and the ranks agree, in one all-gather of a few
    numbers each, on what they must share: the leading shape, x's dtype, the norm, eps and
    whether each rank's arguments passed its checks. A rank whose arguments were refused
    raises its own error after that gather, and every other rank a ValueError naming it, so
    that no rank waits for one that left; ranks that differ raise the same ValueError, which
    names what differs and each rank's value."""
    # (a bad group cannot be told: this rank is not in it, or has no group to gather on)
    _check_group(group)
    refused: Exception | None = None
    if _is_dtensor(x):
        refused = TypeError("x: a DTensor; the sharded norms take this rank's local tensor "
                            "(x.to_local()), and normbook.layer_norm / rms_norm take a DTensor "
                            "itself")
    elif not isinstance(x, torch.Tensor):
        # refused after the gather, as a bad weight is: raised here, it left the other ranks
        # waiting in the gather until the group's timeout (30 minutes by default on gloo)
        refused = TypeError(f"x: expected a tensor of shape (..., D_local), got "
                            f"{type(x).__name__}")
    else:
        try:
            eps = _check(x, weight, bias, eps, is_rms)
        except (TypeError, ValueError) as e:
            refused = e
    if refused is not None and not (dist.is_available() and dist.is_initialized()):
        raise refused       # (no group to tell)
    lead: tuple[int, ...] = ()
    features, code = 0.0, -1
    if isinstance(x, torch.Tensor):
        lead, device = tuple(x.shape[:-1] if x.dim() else x.shape), x.device
        features, code = (float(x.shape[-1]) if x.dim() else 0.0), _DTYPE_CODES.get(x.dtype, -1)
    else:                   # the device the group's collectives take (cuda for NCCL)
        device = torch.device(torch.distributed.distributed_c10d._get_object_coll_device(group))
    mixed = sum(s * 1000003 ** i for i, s in enumerate(lead)) % (1 << 50)
    shown = [float(s) for s in lead[:_SHOWN_DIMS]] + [-1.0] * (_SHOWN_DIMS - len(lead[:_SHOWN_DIMS]))
    mine = [features, float(refused is not None), float(len(lead)),
            float(mixed), float(code), float(is_rms),
            eps if refused is None else 0.0, *shown]
    out = [torch.empty(len(mine), dtype=torch.float64, device=device)
           for _ in range(dist.get_world_size(group))]
    with torch.no_grad():
        dist.all_gather(out, torch.tensor(mine, dtype=torch.float64, device=device),
                        group=group)
    every = torch.stack(out).cpu()
    if refused is not None:
        raise refused
    bad = every[:, 1].nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"x: rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} of the "
                         f"group refused {'their' if len(bad) > 1 else 'its'} arguments (its "
                         f"error says why); this rank's passed")
    codes = {v: k for k, v in _DTYPE_CODES.items()}

    def shape(row):
        dims = [int(d) for d in row[7:7 + min(int(row[2]), _SHOWN_DIMS)]]
        return str(tuple(dims))[:-1] + (", ...)" if row[2] > _SHOWN_DIMS else ")")

    fields = [("leading shape", (2, 3), shape), ("dtype", (4,), lambda r: str(codes.get(int(r[4])))),
              ("norm", (5,), lambda r: "rms_norm" if r[5] else "layer_norm"),
              ("eps", (6,), lambda r: repr(float(r[6])))]
    differ = [(name, show) for name, cols, show in fields
              if not bool((every[:, list(cols)] == every[:1, list(cols)]).all())]
    if differ:
        raise ValueError("x: every rank of the group must call the same norm on x of the same "
                         "leading shape and dtype, with the same eps; the ranks differ in "
                         + "; ".join(f"{name} (rank order: {', '.join(show(r) for r in every)})"
                                     for name, show in differ))
    return eps, every[:, 0]


def _sharded_stats(xf: torch.Tensor, eps: float, is_rms: bool, group, counts: torch.Tensor):
    """(D, mean, rstd) of whole rows split over the ranks: D the row length (a tensor), mean and
    rstd (...,), the same bits on every rank; mean is None for RMSNorm. ``counts``: every
    rank's feature count, in rank order (:func:`_agreed`).

    Each rank may hold any number of the features, none included: D is the sum of the ranks'
    counts, never this rank's count times the world size. LayerNorm merges the ranks'
    two-pass statistics with Chan's formula (kern-chan); RMSNorm adds the ranks' sums of
    squares (rms-ms). Rows whose mean square overflows are rescued as on one process
    (:func:`_rescued_rstd`). Made of differentiable ops and collectives, so the backward can
    recompute these from x when a graph of it is being built.
    """
    d_k = xf.shape[-1]                                     # this rank's feature count
    counts = counts.to(xf.device, xf.dtype)
    D = counts.sum()                                       # (world,) -> the row length
    if is_rms:
        mean = None
        ms = _all_reduce((xf * xf).sum(-1), group) / D     # (rms-ms): one scalar per token
    else:
        n_k = max(d_k, 1)                                  # (an empty slice gives 0 and 0)
        mean_k = xf.sum(-1) / n_k                          # (...,) local two-pass statistics,
        # the mean corrected by the mean of what it leaves: the rounded sum / d_k can miss a
        # constant row's value by a unit, and x - mean would then be a constant that is not
        # zero, which (x - mean) * rstd turns into +-1 (measured: 0.93 for 54321.7 split
        # 512 + 512); corrected, it is exact for such a row, and Chan's merge of equal means
        # (a difference of 0) keeps it so
        mean_k = mean_k + (xf - mean_k[..., None]).sum(-1) / n_k
        m2_k = ((xf - mean_k[..., None]) ** 2).sum(-1)
        # two scalars per token per rank on the wire; merged in rank order on every rank
        every = _gather(torch.stack([mean_k, m2_k]), group)   # (world, 2, ...)
        _, mean, m2 = merge_stats(counts, every[:, 0], every[:, 1])
        ms = m2 / D                                        # (ln-var)
    rstd = torch.rsqrt(ms + eps)                           # (ln-rstd)
    overflow = torch.isinf(ms)      # the same bits on every rank, so all ranks take the branch
    if overflow.any():
        xc = xf if mean is None else xf - mean[..., None]
        rstd = torch.where(overflow, _rescued_rstd(xc, D, eps, group), rstd)
    return D, mean, rstd


def _rescued_rstd(xc: torch.Tensor, D: torch.Tensor, eps: float, group) -> torch.Tensor:
    """1 / sqrt(mean(xc^2) + eps) of rows whose mean square overflows, (...,): as on one
    process (``normbook._math._rsqrt_ms``), the row is scaled down before squaring and the
    scale taken back out of the root, eps with it: 1 / sqrt(mean(u^2) + eps / a^2) / a. Here
    a = 2^e (exact), the same on every rank: e is the exponent of the largest |xc| of the
    whole row, an all-reduce (MAX) over the ranks, and at least 1 as on one process, so that
    a row left all zeros by its mean (a constant row: its mean square overflowed on a rank
    before the merge) gets 1 / sqrt(eps), not 0 * inf. A row holding an infinity keeps the
    caller's rstd = 0, as torch's.
    """
    local = (xc.detach().abs().amax(-1) if xc.shape[-1]
             else xc.new_zeros(xc.shape[:-1]))             # (...,) an empty slice: 0
    big = _all_reduce(local, group, dist.ReduceOp.MAX)
    _, e = torch.frexp(big.clamp_min(1.0))
    u = torch.ldexp(xc, -e[..., None])                     # |u| < 1 on every rank
    scale = torch.ldexp(torch.ones_like(local), -e)        # 1 / a
    rescued = torch.rsqrt(_all_reduce((u * u).sum(-1), group) / D + eps * scale * scale) * scale
    return torch.where(torch.isfinite(big), rescued, torch.zeros_like(rescued))


class _ShardedNorm(torch.autograd.Function):
    """Forward and backward of a norm whose rows are split over the ranks of ``group``.

    The backward is (ln-dx) / (rms-dx) from the saved statistics. When autograd builds a graph
    of the backward (``create_graph=True``, a gradient penalty), the statistics are recomputed
    from x and every sum goes through differentiable collectives, so that second derivatives
    see how c1, c2, mean and rstd depend on the features of every rank.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms, group, counts):
        cdt = _validate.compute_dtype(x.dtype)
        xf = x.to(cdt)
        D, mean, rstd = _sharded_stats(xf, eps, is_rms, group, counts)
        xhat = (xf if mean is None else xf - mean[..., None]) * rstd[..., None]
        y = xhat
        if weight is not None:
            y = y * weight.to(cdt)
        if bias is not None:
            y = y + bias.to(cdt)
        # two scalars per token, not D_local values of xhat
        ctx.save_for_backward(x, weight, rstd, *(() if mean is None else (mean,)))
        ctx.meta = (is_rms, group, eps, float(D), None if bias is None else bias.dtype, counts)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        is_rms, group, eps, D, bias_dtype, counts = ctx.meta
        x, weight, rstd, *rest = ctx.saved_tensors
        cdt = _validate.compute_dtype(x.dtype)
        xf, g = x.to(cdt), dy.to(cdt)
        if torch.is_grad_enabled():   # a graph of the backward is being built: stats from x
            _, mean, rstd = _sharded_stats(xf, eps, is_rms, group, counts)
        else:
            mean = None if is_rms else rest[0]
        xhat = (xf if mean is None else xf - mean[..., None]) * rstd[..., None]
        ghat = g if weight is None else g * weight.to(cdt)       # (ln-ghat)
        # c1, c2 are means over the whole row: local sums, one all-reduce of two scalars a
        # token (RMSNorm's too, which uses c2 alone: chapter 10's exercise counts the waste)
        sums = _all_reduce(torch.stack([(ghat * xhat).sum(-1), ghat.sum(-1)]), group)
        c2, c1 = sums[0] / D, sums[1] / D                          # (ln-c)
        dx = ghat - c2[..., None] * xhat
        if not is_rms:
            dx = dx - c1[..., None]                                # (ln-dx); RMSNorm (rms-dx)
        dx = dx * rstd[..., None]
        # the parameters are split like the features: each rank's slice is whole here
        dweight = None if weight is None else _sum_tokens(g * xhat).to(weight.dtype)
        dbias = None if bias_dtype is None else _sum_tokens(g).to(bias_dtype)   # (ln-dparams)
        return dx.to(x.dtype), dweight, dbias, None, None, None, None


def _check(x, weight, bias, eps, is_rms) -> float:
    """The sharded norms' arguments: a ValueError or TypeError naming the argument, as
    normbook.layer_norm's checks; eps as a float (a 0-d tensor taken, as there)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a tensor of shape (..., D_local), got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"x: expected a tensor of shape (..., D_local), got a 0-d tensor")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and not (isinstance(p, torch.Tensor) and p.is_floating_point()
                                  and tuple(p.shape) == (x.shape[-1],)):
            got = (f"{tuple(p.shape)} {p.dtype}" if isinstance(p, torch.Tensor)
                   else type(p).__name__)
            raise ValueError(f"{name}: expected this rank's slice, a floating tensor of shape "
                             f"({x.shape[-1]},), got {got}")
    if eps is None and is_rms:   # the default, which default_eps leaves for a non-float x
        raise TypeError(f"eps: None (the default) is the machine epsilon of a floating x, and x "
                        f"is {x.dtype}; expected a floating x, or eps given as a number")
    eps = _validate.as_eps(eps)     # a 0-d tensor as its value, as normbook.layer_norm's
    _validate.check_eps(eps)        # a real number, not a bool, not NaN (TypeError, ValueError)
    # an integer, bool or complex x, as normbook.layer_norm and torch refuse it (computed, it
    # came back truncated to integers, or without its imaginary part)
    _validate.check_input(x, "x")
    return float(eps)


def layer_norm_sharded(x: torch.Tensor, weight: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, eps: float = 1e-5,
                       group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """LayerNorm of rows split over the features across the ranks of ``group``.

    Each rank holds ``x[..., its slice of D]``, a slice of any length (uneven splits, and
    ranks with no features, are allowed); every rank's statistics are merged with Chan's
    formula (kern-chan), so y = (x - mean) * rstd * weight + bias (ln-y) is computed with
    the whole row's mean and variance, overflow-safe as on one process. Backward: (ln-dx) with
    c1, c2 of (ln-c) summed across ranks by one all-reduce of two scalars per token; double
    backward (a gradient penalty) differentiates through the collectives.

    Every rank of ``group`` must call it. The ranks first agree, in one small all-gather, on
    the leading shape, x's dtype, the norm and eps, and whether each rank's arguments passed
    its checks: where they differ, every rank raises a ValueError naming what differs (a rank
    whose arguments were refused, its own error) instead of waiting for another.

    Args:
        x: (..., D_local), this rank's features of every token.
        weight, bias: (D_local,), this rank's slices, or None.
        eps: added to the variance inside the square root.
        group: the process group over which D is split (None: the default group).

    Returns:
        Tensor: (..., D_local), this rank's slice of the output, in x's dtype.
    """
    eps, counts = _agreed(x, weight, bias, eps, False, group)
    return _ShardedNorm.apply(x, weight, bias, eps, False, group, counts)


def rms_norm_sharded(x: torch.Tensor, weight: torch.Tensor | None = None,
                     eps: float | None = None,
                     group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """RMSNorm of rows split over the features across the ranks of ``group``: (rms-ms) as one
    all-reduce of the sum of squares per token, divided by the whole row's length (which an
    all-gather of the ranks' feature counts gives, on every call of either norm), then
    (rms-y) locally; backward (rms-dx) with c2 all-reduced (beside c1, which it does not use:
    two scalars a token where one would do, as chapter 10's exercise finds). Arguments, result and what any
    split allows as :func:`layer_norm_sharded`, without a bias, but for ``eps``: added to the
    mean square inside the root; None (the default) is the default of :func:`normbook.rms_norm`
    and torch's, the machine epsilon of x's compute type (fp32's for float16, bfloat16 and
    float32 x, fp64's for float64: ``normbook._validate.default_eps``), so that a model gives
    the same y whether its features are split or not.

    Shapes: x (..., D_local), this rank's features of every token; weight (D_local,) or None;
    returns (..., D_local), this rank's slice of y, in x's dtype."""
    eps, counts = _agreed(x, weight, None, _validate.default_eps(x, eps), True, group)
    return _ShardedNorm.apply(x, weight, None, eps, True, group, counts)


def all_reduce_param_grads(module: torch.nn.Module,
                           group: dist.ProcessGroup | None = None) -> int:
    """Sum the gradients of ``module``'s parameters over the ranks of ``group`` (in place).

    With tokens split over ranks, each rank's dweight and dbias sum only its own tokens
    (ln-dparams); the true gradient is the sum over ranks. Forgetting this step trains each
    rank's copy of the weights on its own tokens only.

    A parameter whose gradient is None on some ranks (a branch those ranks' tokens did not
    take) but not on all of them counts as zeros there, and receives the sum like the rest;
    one None on every rank stays None. (Ranks skipping their own Nones would pair one rank's
    gradient with another parameter's on another rank: the ranks first agree, in one
    all-reduce of a flag per parameter, which gradients exist anywhere.) Every rank of
    ``group`` must call it with the same module structure: the ranks first agree on it, in one
    all-gather of the number of parameters that want gradients and a hash of their shapes and
    dtypes, and raise the same ValueError where they differ (their all-reduces of unequal
    sizes aborted gloo, or waited out its timeout). Returns the number of tensors reduced.
    """
    _check_group(group)
    params = [p for p in module.parameters() if p.requires_grad]
    device = params[0].device if params else (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    layout = 0      # the parameters' shapes and dtypes, as one number (no str hash: a
    for p in params:  # process's is salted)
        shape = sum(n * 1000003 ** j for j, n in enumerate(p.shape))
        layout = (layout * 1000003 + shape * 101 + _DTYPE_CODES.get(p.dtype, 99)) % (1 << 50)
    mine = torch.tensor([float(len(params)), float(layout)], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    rows = torch.stack(every).cpu()
    if not bool((rows == rows[:1]).all()):
        same = bool((rows[:, 0] == rows[0, 0]).all())
        raise ValueError(f"module: every rank of the group must hold the same parameters (their "
                         f"number, shapes and dtypes); the ranks hold "
                         f"{', '.join(str(int(n)) for n in rows[:, 0])} parameters that want "
                         f"gradients (rank order)"
                         + ("; their shapes or dtypes differ" if same else ""))
    if not params:
        return 0
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                       device=params[0].device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
    done = 0
    for p, anywhere in zip(params, has.tolist()):
        if not anywhere:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
        done += 1
    return done


# --- running code on several processes, for the chapter and the tests --------------------------
#
# launch() must neither hang nor leak, whatever a rank does: every rank is a fresh Python in its
# own process group, which launch() kills on every way out (a result, a failure, the deadline,
# KeyboardInterrupt, SIGTERM); a rank whose parent has died kills itself. The ranks meet through
# a file store in a temporary folder (no port to race for, nothing listening beyond loopback)
# and send back one file each, written whole or not at all.

_POLL_S = 0.05      # how often launch() looks at its ranks
_GRACE_S = 10.0     # a rank outlives launch()'s deadline by at most this, should launch() stall

# the child's entry point, run as `python -c`; sys.path is the parent's, as multiprocessing's
# "spawn" does, so fn's module is found as the parent found it
_CHILD = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
          "from normbook.distributed import _child; _child(sys.argv[2], int(sys.argv[3]))")


def _loopback() -> str | None:
    """The loopback interface's name, "lo" (Linux) or "lo0" (macOS), or None if neither."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except (AttributeError, OSError):   # pragma: no cover
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def _write_whole(path: str, data: bytes) -> None:
    """Write then rename: a reader sees the whole file or none."""
    with open(path + ".part", "wb") as f:
        f.write(data)
    os.replace(path + ".part", path)


def _watch_parent(parent: int, tmp: str, limit_s: float) -> None:
    """In a rank: end this rank's process group if launch()'s process has gone (removing the
    folder it can no longer remove) or after ``limit_s`` seconds."""
    end = time.monotonic() + limit_s
    while os.getppid() == parent and time.monotonic() < end:
        time.sleep(0.2)
    if os.getppid() != parent:
        shutil.rmtree(tmp, ignore_errors=True)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _child(tmp: str, rank: int) -> None:
    """One rank of :func:`launch`: gloo group, ``fn``, then a file ``rank<k>.out`` holding
    ("ok", result) or ("error", time, traceback)."""
    torch.set_num_threads(1)
    code = 0
    try:
        with open(os.path.join(tmp, "task.pkl"), "rb") as f:
            # unpickling fn imports its module: TRITON_INTERPRET=1 is already in the environment
            parent, world, timeout_s, fn, args = pickle.load(f)
        threading.Thread(target=_watch_parent, args=(parent, tmp, timeout_s + _GRACE_S),
                         daemon=True).start()
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "store"),
                                rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # every rank connected before any runs fn: a rank whose fn returns at once would
        # otherwise close its sockets while a slower rank's gloo is still connecting to it
        # ("Connection closed by peer" in connectFullMesh, seen on 2 loaded cores)
        dist.barrier()
        record = pickle.dumps(("ok", fn(rank, world, *args)))
    except BaseException:
        code = 1
        record = pickle.dumps(("error", time.time(), traceback.format_exc()))
    try:
        _write_whole(os.path.join(tmp, f"rank{rank}.out"), record)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code)


class _Stopped(BaseException):
    """SIGTERM arrived while launch() ran: unwind (ending the ranks), then die of it."""


# the SIGTERM that launch() is dying of: the handler raises only for the first. A second one a
# few bytecodes later (before the cleanup masks it: in the except clause, or on the way into
# the finally) raised a second _Stopped that escaped launch() before it was recorded, and the
# parent exited with 1, not of SIGTERM (1 run of about 700 under load)
_STOPPING: list[int] = []


def _on_sigterm(signum, frame):
    if _STOPPING:
        return
    _STOPPING.append(signum)
    raise _Stopped(signum)


def _mask(how, signals):
    """``signal.pthread_sigmask(how, signals)`` where the platform has it (the previous mask),
    else nothing (None)."""
    if signals is None or not hasattr(signal, "pthread_sigmask"):   # pragma: no cover
        return None
    return signal.pthread_sigmask(how, signals)


def _end(procs) -> None:
    """Kill every rank's process group (the rank and whatever it started), then reap them."""
    for p in procs:
        try:
            if hasattr(os, "killpg"):
                os.killpg(p.pid, signal.SIGKILL)   # each rank leads its own group (a new session)
            else:   # pragma: no cover
                p.kill()
        except (ProcessLookupError, PermissionError):
            pass    # already gone
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:   # pragma: no cover
            pass


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:   # pragma: no cover
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _collect(procs, tmp: str, name: str, timeout_s: float, start: float) -> list:
    """Wait for every rank's file, at most until ``start + timeout_s``; raise on the first
    failure: a rank's traceback, or a rank that ended without writing its file."""
    world = len(procs)
    records: list = [None] * world
    while True:
        for rank, p in enumerate(procs):
            if records[rank] is not None:
                continue
            code = p.poll()          # before the file: a rank writes, then exits
            path = os.path.join(tmp, f"rank{rank}.out")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    records[rank] = pickle.load(f)
            elif code is not None:
                raise RuntimeError(f"launch: {name}: rank {rank} {_describe_exit(code)} "
                                   f"before returning a result (did it call os._exit or "
                                   f"sys.exit, or was it killed?)")
        errors = sorted((r[1], rank, r[2]) for rank, r in enumerate(records)
                        if r is not None and r[0] == "error")
        if errors:
            _, rank, text = errors[0]
            later = [str(k) for _, k, _ in errors[1:]]
            also = (f" (then rank{'s' if len(later) > 1 else ''} {', '.join(later)} failed "
                    "too)") if later else ""
            raise RuntimeError(f"launch: {name} failed on rank {rank}{also}; the other ranks "
                               f"were stopped. Rank {rank}'s traceback:\n{text}")
        if all(r is not None for r in records):
            return [r[1] for r in records]
        if time.monotonic() - start > timeout_s:
            running = [str(k) for k, r in enumerate(records) if r is None]
            raise TimeoutError(f"launch: {name} did not finish within timeout_s={timeout_s:g} s; "
                               f"rank(s) {', '.join(running)} still running, now stopped")
        time.sleep(_POLL_S)


def launch(fn: Callable[..., Any], *args: Any, world: int = 2,
           timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh CPU processes joined by gloo.

    Each child is a new Python (as with the "spawn" method) in its own process group, with
    ``TRITON_INTERPRET=1`` in its environment before anything imports triton and
    ``torch.set_num_threads(1)``; the children join a gloo process group of ``world`` ranks
    through a file store in a temporary folder, their sockets on the loopback interface, and
    meet at a barrier before any runs ``fn``; collectives in ``fn`` use that default group.
    ``fn`` must be importable by name in a new process (defined at module level in a module,
    not in a notebook cell or ``__main__``); ``args`` and the return values must pickle.

    Nothing outlives the call: on a result, a failure, the deadline, KeyboardInterrupt or
    SIGTERM every child's process group is killed and the temporary folder removed; a child
    whose parent has died ends itself.

    Args:
        fn: the function each rank runs.
        *args: passed to ``fn`` after ``rank, world``.
        world: the number of ranks.
        timeout_s: the deadline of the whole run, start-up included (also the limit of each
            collective inside ``fn``).

    Returns:
        list: of ``world`` values, ``fn``'s return value on rank 0, 1, ... (sent back through
            files in the temporary folder).

    Raises:
        ValueError: ``fn`` defined in ``__main__`` or inside a function (a child process cannot
            find it), or a bad ``world`` (an int >= 1) or ``timeout_s`` (a finite number > 0).
        RuntimeError: ``fn`` raised on some rank (the message holds the traceback of the rank
            that failed first; a child that could not import ``fn``'s module fails so), or a
            rank ended without a result; raised as soon as it happens.
        TimeoutError: the ranks did not all finish within ``timeout_s``.
    """
    # (a functools.partial of such a function, or another callable that pickles, is taken)
    inner = getattr(fn, "func", fn)     # a functools.partial: the function it calls
    name = getattr(inner, "__qualname__", None) or type(fn).__name__
    if getattr(fn, "__module__", "__main__") == "__main__" or "<locals>" in name:
        raise ValueError(f"launch: {name} must be a module-level function of an "
                         f"importable module (a spawned process cannot see __main__)")
    if not (isinstance(world, int) and not isinstance(world, bool) and world >= 1):
        raise ValueError(f"launch: world must be an int >= 1, got {world!r}")
    if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
            and 0 < timeout_s < float("inf")):
        raise ValueError(f"launch: timeout_s must be a finite number > 0, got {timeout_s!r}")
    task = pickle.dumps((os.getpid(), world, float(timeout_s), fn, args))   # fails here, not there
    env = dict(os.environ, TRITON_INTERPRET="1")
    loopback = _loopback()
    if loopback is not None:
        env["GLOO_SOCKET_IFNAME"] = loopback             # gloo's sockets: loopback only
    sys_path = json.dumps([p or os.getcwd() for p in sys.path])

    start = time.monotonic()
    previous = None
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        _STOPPING.clear()
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    tmp = tempfile.mkdtemp(prefix="normbook-launch-")
    procs: list[subprocess.Popen] = []
    try:
        _write_whole(os.path.join(tmp, "task.pkl"), task)
        for rank in range(world):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _CHILD, sys_path, tmp, str(rank)],
                env=env, stdin=subprocess.DEVNULL, start_new_session=True))
        return _collect(procs, tmp, name, timeout_s, start)
    finally:
        # a second Ctrl-C or SIGTERM waits until the cleanup is done: raised out of it, it
        # left the folder behind (the ranks, already killed, cannot remove it). One that came
        # before the mask may still be raised in the cleanup: it is done again, then raised
        masked = _mask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        again: BaseException | None = None
        try:
            for _ in range(2):
                try:
                    _end(procs)
                    shutil.rmtree(tmp, ignore_errors=True)
                    break
                except (KeyboardInterrupt, _Stopped) as e:
                    again = e
            stop = None
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
                stop = _STOPPING[0] if _STOPPING else None
            if stop is not None:     # die of the signal (once unmasked), as without launch()
                os.kill(os.getpid(), stop)
        finally:
            _mask(signal.SIG_SETMASK, masked)
        if again is not None:
            raise again


# --- the chapter's experiments: fn(rank, world, ...) for launch --------------------------------


def _rel(a, b) -> float:
    """|a - b| / |b| in float64, over all elements."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _max(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _rows(n, rank, world):
    """This rank's contiguous block of n tokens."""
    return slice(rank * n // world, (rank + 1) * n // world)


def _spread(t):
    """Largest difference of t between rank 0 and any other rank."""
    every = _gather(t.detach(), None)                 # (world, ...)
    return float((every - every[0]).abs().max())


def _sgd(norm, x, t, n_total, steps, lr, sync):
    """SGD on sum((norm(x) - t)^2) / n_total over these tokens."""
    for _ in range(steps):
        norm.zero_grad()
        loss = ((norm(x) - t) ** 2).sum() / n_total
        loss.backward()                  # local sums (ln-dparams)
        if sync:
            all_reduce_param_grads(norm)  # sum over ranks
        with torch.no_grad():
            for p in norm.parameters():
                p -= lr * p.grad
    return norm


def sequence_parallel_experiment(rank: int, world: int, n: int = 64,
                                 d: int = 16, steps: int = 20,
                                 lr: float = 0.2) -> dict[str, float]:
    """Tokens split over ranks: local dweight, and SGD with and
    without the all-reduce (chapter "Norms across devices").

    x and the target t are (n, d) float64, the same on every rank;
    rank r holds its rows of them. The loss is sum (LN(x) - t)^2 / n,
    so dweight = sum over tokens of (ln-dparams): the all-reduce
    (:func:`all_reduce_param_grads`) sums the ranks' shares.

    Returns: relative errors against one process of the local
    dweight, of world times it and of the reduced one
    (``dweight_err_*``), and after ``steps`` of SGD at ``lr`` the
    ranks' spread (``drift_*``) and the error against one process
    (``err_*``), ``local`` and ``synced``."""
    from normbook import LayerNorm

    g = torch.Generator().manual_seed(0)     # same data everywhere
    x = 2 + torch.randn(n, d, generator=g, dtype=torch.float64)
    t = torch.randn(n, d, generator=g, dtype=torch.float64)
    mine = _rows(n, rank, world)             # this rank's tokens
    f64: dict[str, Any] = dict(dtype=torch.float64)

    one = _sgd(LayerNorm(d, **f64), x, t, n, 1, 0.0, False)
    local = _sgd(LayerNorm(d, **f64), x[mine], t[mine], n, 1, 0.0,
                 False)
    dw_local = local.weight.grad.clone()     # (D,) my tokens only
    all_reduce_param_grads(local)            # (D,) every token
    out = {"dweight_err_local": _rel(dw_local, one.weight.grad),
           "dweight_err_scaled": _rel(world * dw_local,
                                      one.weight.grad),
           "dweight_err_reduced": _rel(local.weight.grad,
                                       one.weight.grad)}

    one = _sgd(LayerNorm(d, **f64), x, t, n, steps, lr, False)
    for sync in (False, True):
        norm = _sgd(LayerNorm(d, **f64), x[mine], t[mine], n,
                    steps, lr, sync)
        w = torch.cat([norm.weight, norm.bias]).detach()
        w_one = torch.cat([one.weight, one.bias]).detach()
        key = "synced" if sync else "local"
        out[f"drift_{key}"] = _spread(w)     # rank 0 vs the others
        out[f"err_{key}"] = _max(w, w_one)   # vs one process
    return out


def feature_parallel_experiment(rank: int, world: int, n: int = 8,
                                d: int = 64) -> dict[str, float]:
    """Features split over ranks: layer_norm_sharded and
    rms_norm_sharded against one process, in float64.

    x and dy are (n, d); rank r holds its columns of them and of the
    (d,) weight and bias, and the statistics are merged over ranks
    (kern-chan). Returns ``layer_norm_err`` and ``rms_norm_err``, the
    largest absolute difference over y, dx and the parameters'
    gradients (this rank's slice) from the reference on the whole
    row."""
    from normbook import reference

    g = torch.Generator().manual_seed(1)
    f64: dict[str, Any] = dict(generator=g, dtype=torch.float64)
    x = 3 + torch.randn(n, d, **f64)        # (N, D)
    w = 1 + 0.1 * torch.randn(d, **f64)      # (D,)
    b = 0.1 * torch.randn(d, **f64)          # (D,)
    dy = torch.randn(n, d, **f64)            # (N, D)
    cols = _rows(d, rank, world)             # my slice of D
    xs, ws, bs = (v[..., cols].clone().requires_grad_()
                  for v in (x, w, b))

    y = layer_norm_sharded(xs, ws, bs, 1e-5)
    y.backward(dy[:, cols])
    y1, mean, rstd = reference.layer_norm_forward(x, w, b, 1e-5)
    dx1, dw1, db1 = reference.layer_norm_backward(dy, x, w, mean,
                                                  rstd)
    assert dw1 is not None                   # w given: dweight too
    ln = max(_max(y, y1[:, cols]), _max(xs.grad, dx1[:, cols]),
             _max(ws.grad, dw1[cols]), _max(bs.grad, db1[cols]))

    xs, ws = (v[..., cols].clone().requires_grad_() for v in (x, w))
    y = rms_norm_sharded(xs, ws, 1e-6)
    y.backward(dy[:, cols])
    y1, rstd = reference.rms_norm_forward(x, w, 1e-6)
    dx1, dw1 = reference.rms_norm_backward(dy, x, w, rstd)
    assert dw1 is not None
    rms = max(_max(y, y1[:, cols]), _max(xs.grad, dx1[:, cols]),
              _max(ws.grad, dw1[cols]))
    return {"layer_norm_err": ln, "rms_norm_err": rms}


def dtensor_experiment(rank: int, world: int, n: int = 2, s: int = 8,
                       d: int = 16) -> dict[int, dict[str, Any]]:
    """normbook.kernels.layer_norm on DTensors sharded over the
    sequence (dim 1) and over the features (dim 2).

    x and dy are (n, s, d); weight and bias (d,), replicated.
    Returns, per sharded dim: the placements of x, y and dweight,
    the collectives of the forward, and ``err``, the largest
    difference of y and the gradients from F.layer_norm's."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import (Replicate, Shard,
                                          distribute_tensor)
    from torch.distributed.tensor.debug import CommDebugMode

    import normbook.kernels as K     # Triton, interpreted on CPUs

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(2)
    x, dy = (torch.randn(n, s, d, generator=g) for _ in "ab")
    w = 1 + 0.1 * torch.randn(d, generator=g)
    b = 0.1 * torch.randn(d, generator=g)
    leaves = [v.clone().requires_grad_() for v in (x, w, b)]
    F.layer_norm(leaves[0], (d,), leaves[1], leaves[2]).backward(dy)

    out = {}
    for dim in (1, 2):                    # the sequence, the features
        xd = distribute_tensor(x, mesh, [Shard(dim)])
        wd, bd = (distribute_tensor(v, mesh, [Replicate()])
                  for v in (w, b))
        for v in (xd, wd, bd):
            v.requires_grad_()
        with CommDebugMode() as comm:     # collectives of the forward
            y = K.layer_norm(xd, (d,), wd, bd)
        y.backward(distribute_tensor(dy, mesh, y.placements))
        out[dim] = {
            "x": str(xd.placements[0]), "y": str(y.placements[0]),
            "dweight": str(wd.grad.placements[0]),
            "comms": {str(k): v for k, v in
                      comm.get_comm_counts().items()},
            "err": max(_max(y.full_tensor(), F.layer_norm(
                x, (d,), w, b)),
                *(_max(v.grad.full_tensor(), l.grad)
                  for v, l in zip((xd, wd, bd), leaves)))}
    return out


def fsdp_experiment(rank: int, world: int, n: int = 8,
                    d: int = 16) -> dict[str, Any]:
    """A LayerNorm under FSDP2's fully_shard against one process;
    each rank runs its own n // world tokens of x, dy (n, d).

    Returns the weight's shape at rest (``at_rest``: FSDP2's chunk,
    ceil(d / world), the last rank what is left) and placement,
    ``y_err`` against one process, and ``grad_err``:
    FSDP2 averages the ranks' gradients, so world times the average
    against one process's sum over all n tokens."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from normbook import LayerNorm

    # FSDP2 warns that the output is a view; nothing here edits it
    warnings.filterwarnings("ignore", "FSDP2-wrapped module")
    g = torch.Generator().manual_seed(3)
    x, dy = (torch.randn(n, d, generator=g) for _ in "ab")
    one = LayerNorm(d)
    with torch.no_grad():
        for p in one.parameters():
            p.add_(0.1 * torch.randn(d, generator=g))
    one(x).backward(dy)                     # sums over all n tokens

    fs = LayerNorm(d)
    fs.load_state_dict(one.state_dict())
    fully_shard(fs, mesh=init_device_mesh("cpu", (world,)))
    at_rest = tuple(fs.weight.to_local().shape)  # (D / world,)
    mine = _rows(n, rank, world)
    y = fs(x[mine])                          # whole weight inside
    y.backward(dy[mine])
    # FSDP2 averages the ranks' gradients: the sum over ranks / world
    grads = [p.grad.full_tensor() for p in fs.parameters()]
    return {"at_rest": at_rest, "placement": str(
                fs.weight.placements[0]),
            "y_err": _max(y, one(x)[mine]),
            "grad_err": max(_max(gr * world, p.grad) for gr, p in
                            zip(grads, one.parameters()))}
