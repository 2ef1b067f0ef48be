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

Everything here is plain torch.distributed on a process group (gloo on the CPU, NCCL on GPUs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["merge_stats", "layer_norm_sharded", "rms_norm_sharded", "all_reduce_param_grads"]


def merge_stats(n: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor):
    """Chan's merge (kern-chan) of K chunks' statistics, in chunk order (deterministic).

    Args:
        n: (K,) element counts of the chunks.
        mean, m2: (K, ...) each chunk's mean and sum of squared deviations from it, per token.

    Returns:
        (N, mean, m2) of all chunks together: N a scalar tensor, mean and m2 of shape (...).
    """
    if not (n.dim() == 1 and mean.shape[:1] == n.shape and m2.shape == mean.shape):
        raise ValueError(f"merge_stats: expected n (K,), mean and m2 (K, ...), got "
                         f"{tuple(n.shape)}, {tuple(mean.shape)}, {tuple(m2.shape)}")
    n_a, mean_a, m2_a = n[0], mean[0], m2[0]
    for k in range(1, n.shape[0]):
        n_b, mean_b, m2_b = n[k], mean[k], m2[k]
        total = n_a + n_b
        delta = mean_b - mean_a                           # (kern-chan)
        mean_a = mean_a + delta * (n_b / total)
        m2_a = m2_a + m2_b + delta * delta * (n_a * n_b / total)
        n_a = total
    return n_a, mean_a, m2_a


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    """(world, *t.shape): every rank's t, in rank order."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return torch.stack(out)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; half and single precision compute in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _ShardedNorm(torch.autograd.Function):
    """Forward and backward of a norm whose rows are split over the ranks of ``group``."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms, group):
        cdt = _compute_dtype(x)
        xf = x.to(cdt)
        d_local = torch.tensor(float(x.shape[-1]), dtype=cdt)
        if is_rms:
            ss = (xf * xf).sum(-1)                                # (...,) local sum of squares
            dist.all_reduce(ss, group=group)                      # one scalar per token
            D = d_local * dist.get_world_size(group)
            mean, rstd = None, torch.rsqrt(ss / D + eps)          # (rms-ms)
        else:
            mean_l = xf.mean(-1)                                  # local two-pass statistics
            m2_l = ((xf - mean_l[..., None]) ** 2).sum(-1)
            counts = _gather(d_local.reshape(1), group)[:, 0]     # (world,)
            # two scalars per token per rank on the wire; merged in rank order on every rank
            D, mean, m2 = merge_stats(counts, _gather(mean_l, group), _gather(m2_l, group))
            rstd = torch.rsqrt(m2 / D + eps)                      # (ln-var), (ln-rstd)
        xhat = (xf if mean is None else xf - mean[..., None]) * rstd[..., None]
        y = xhat
        if weight is not None:
            y = y * weight.to(cdt)
        if bias is not None:
            y = y + bias.to(cdt)
        ctx.save_for_backward(x, weight, rstd, *(() if mean is None else (mean,)))
        ctx.meta = (is_rms, group, float(D), bias is not None)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        is_rms, group, D, has_bias = ctx.meta
        x, weight, rstd, *rest = ctx.saved_tensors
        cdt = _compute_dtype(x)
        xf, g = x.to(cdt), dy.to(cdt)
        xhat = (xf if is_rms else xf - rest[0][..., None]) * rstd[..., None]
        ghat = g if weight is None else g * weight.to(cdt)       # (ln-ghat)
        # c1, c2 are means over the whole row: local sums, one all-reduce of two scalars a token
        sums = torch.stack([(ghat * xhat).sum(-1), ghat.sum(-1)])
        dist.all_reduce(sums, group=group)
        c2, c1 = sums[0] / D, sums[1] / D                          # (ln-c)
        dx = ghat - c2[..., None] * xhat
        if not is_rms:
            dx = dx - c1[..., None]                                # (ln-dx); RMSNorm (rms-dx)
        dx = dx * rstd[..., None]
        lead = tuple(range(x.dim() - 1))
        # the parameters are split like the features: each rank's slice is whole here
        dweight = None if weight is None else (g * xhat).sum(lead).to(weight.dtype)
        dbias = g.sum(lead).to(weight.dtype if weight is not None else x.dtype) if has_bias else None
        return dx.to(x.dtype), dweight, dbias, None, None, None


def _check(x, weight, bias, eps):
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x: expected a tensor of shape (..., D_local), got {type(x).__name__}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != (x.shape[-1],):
            raise ValueError(f"{name}: expected this rank's slice of shape ({x.shape[-1]},), "
                             f"got {tuple(p.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps: expected a number >= 0, got {eps}")


def layer_norm_sharded(x, weight=None, bias=None, eps=1e-5, group=None):
    """LayerNorm of rows split over the features across the ranks of ``group``.

    Each rank holds ``x[..., its slice of D]``; every rank's statistics are merged with Chan's
    formula (kern-chan), so y = (x - mean) * rstd * weight + bias (ln-y) is computed with
    the whole row's mean and variance. Backward: (ln-dx) with c1, c2 of (ln-c) summed
    across ranks by one all-reduce of two scalars per token.

    Args:
        x: (..., D_local), this rank's features of every token.
        weight, bias: (D_local,), this rank's slices, or None.
        eps: added to the variance inside the square root.
        group: the process group over which D is split (None: the default group).

    Returns:
        (..., D_local): this rank's slice of the output, in x's dtype.
    """
    _check(x, weight, bias, eps)
    return _ShardedNorm.apply(x, weight, bias, float(eps), False, group)


def rms_norm_sharded(x, weight=None, eps=1e-6, group=None):
    """RMSNorm of rows split over the features across the ranks of ``group``: (rms-ms) as one
    all-reduce of the sum of squares per token, then (rms-y) locally; backward (rms-dx) with
    c2 all-reduced. Arguments and result as :func:`layer_norm_sharded`, without a bias."""
    _check(x, weight, None, eps)
    return _ShardedNorm.apply(x, weight, None, float(eps), True, group)


def all_reduce_param_grads(module: torch.nn.Module, group=None) -> int:
    """Sum the gradients of ``module``'s parameters over the ranks of ``group`` (in place).

    With tokens split over ranks, each rank's dweight and dbias sum only its own tokens
    (ln-dparams); the true gradient is the sum over ranks. Forgetting this step trains each
    rank's copy of the weights on its own tokens only. Returns the number of tensors reduced.
    """
    done = 0
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            done += 1
    return done
