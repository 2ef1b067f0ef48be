"""Sharding rules of the custom ops for DTensor, chapter "Norms across devices".

A norm's statistics are per token, so a DTensor sharded over any token (leading) dim runs the
kernels on each rank's rows as they are: y, h and the statistics keep that sharding, the weight
and bias are replicated. In the backward, dx keeps it too, and dweight and dbias are sums over
every token (``"nd->d"``, the fork rule across devices): each rank's kernel sums only its own
tokens, so they come back as ``Partial()`` and DTensor adds them across ranks (an all-reduce)
when a replicated value is needed.

The normalized (last) dim is never sharded here: every rule keeps each token's row whole on one
rank. An input sharded over it is redistributed by DTensor to the cheapest rule listed (an
all-to-all to a token dim, or an all-gather); ``normbook.distributed`` has the feature-sharded
algorithm, with the statistics merged across ranks, for those who want to avoid that.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

import normbook.kernels.ops  # noqa: F401  (defines the ops)

__all__: list[str] = []


def _opt(t, placement):
    """The placement of an optional tensor argument: None where it is absent."""
    return None if t is None else placement


@register_sharding(torch.ops.normbook.norm_forward.default)
def _forward_rules(x, residual, weight, bias, eps, is_rms):
    """(y, h, stats) from (x, residual, weight, bias, eps, is_rms): one rule per token dim, and
    everything replicated. stats is (S, *leading dims): token dim i is its dim i + 1."""
    h_empty = Replicate() if residual is None else None
    rules = [([Replicate(), Replicate(), Replicate()],
              [Replicate(), _opt(residual, Replicate()), _opt(weight, Replicate()),
               _opt(bias, Replicate()), None, None])]
    for i in range(x.ndim - 1):
        rules.append(([Shard(i), h_empty or Shard(i), Shard(i + 1)],
                      [Shard(i), _opt(residual, Shard(i)), _opt(weight, Replicate()),
                       _opt(bias, Replicate()), None, None]))
    return rules


@register_sharding(torch.ops.normbook.norm_backward.default)
def _backward_rules(dy, dh, x, weight, stats, bias_dtype, is_rms):
    """(dx, dweight, dbias) from (dy, dh, x, weight, stats, ...): per token dim, dx sharded like
    x and the parameter gradients partial sums, reduced across ranks by DTensor (ln-dparams)."""
    rules = [([Replicate(), Replicate(), Replicate()],
              [Replicate(), _opt(dh, Replicate()), Replicate(), _opt(weight, Replicate()),
               Replicate(), None, None])]
    for i in range(x.ndim - 1):
        rules.append(([Shard(i), Partial(), Partial()],
                      [Shard(i), _opt(dh, Shard(i)), Shard(i), _opt(weight, Replicate()),
                       Shard(i + 1), None, None]))
    return rules
