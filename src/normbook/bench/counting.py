"""Count launches and passes over memory: what a composition of framework ops costs.

Used by the chapter "Kernels" to put numbers on the byte model: every operation PyTorch
dispatches is one kernel launch, and every full (M, D) tensor it reads or writes is one pass
over memory. A fused kernel reads and writes each (M, D) tensor of the byte model once.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from normbook.bench import bytemodel, providers

__all__ = ["CountPasses", "count", "fused_passes"]


class CountPasses(TorchDispatchMode):
    """Count the operations dispatched (views excluded) and their passes.

    A pass is an (M, D) tensor an operation reads or writes.

    Args:
        numel: M * D, the size of a full activation tensor; smaller
            tensors (weights, the per-row statistics) are not counted as
            passes.

    After the ``with`` block: ``ops`` launches, ``reads`` and ``writes``
    passes over memory.
    """

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops, self.reads, self.writes = numel, 0, 0, 0

    def _full(self, tensors) -> int:
        return sum(
            isinstance(t, torch.Tensor) and t.numel() == self.numel
            for t in tensors
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views move no data
        if (
            not func.is_view
            and func is not torch.ops.aten.promote_types.default
        ):
            self.ops += 1
            self.reads += self._full(tree_leaves((args, kwargs)))
            self.writes += self._full(tree_leaves(out))
        return out


def count(provider: str, op: str, M: int = 64, D: int = 256):
    """((launches, passes) forward, (launches, passes) backward) of one benchmark provider on the CPU.

    Args:
        provider: a name from ``normbook.bench.providers`` that runs on the CPU ("naive", "torch").
        op: "layer_norm", "rms_norm", "add_layer_norm" or "add_rms_norm".
        M, D: the (M, D) shape counted; counts do not depend on it for M * D larger than D.
    """
    inp = providers.make_inputs(op, M, D, "fp32", "cpu")
    fn = providers.get(provider, op, "fwd", "cpu")
    with CountPasses(M * D) as fwd:
        outs = fn(inp)
    with CountPasses(M * D) as bwd:
        torch.autograd.grad(outs, inp.wrt(), inp.grad_outputs())
    return (fwd.ops, fwd.reads + fwd.writes), (bwd.ops, bwd.reads + bwd.writes)


def fused_passes(op: str, mode: str) -> int:
    """Full (M, D) tensors in the byte model of (op, mode): what one fused kernel reads and writes."""
    return sum(t.rows == "M" and t.cols == "D" for t in bytemodel.traffic(op, mode))
