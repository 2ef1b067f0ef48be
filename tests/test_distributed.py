"""Norms across two processes (gloo, CPU): DTensor over the kernels (eager and torch.compile),
the modules under sequence parallel and FSDP2, and the feature-sharded norms of normbook.distributed, each against one
process. One spawn runs every check (the start-up of two Python processes is most of the time);
each worker writes what failed, and the test reports it.
"""

from __future__ import annotations

import traceback

import pytest
import torch

pytestmark = pytest.mark.slow   # gloo processes: seconds each

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():   # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORLD = 2
D = 16


def _close(name, got, want, failures, tol=1e-5):
    err = float((got.detach().double() - want.detach().double()).abs().max())
    if not err <= tol:
        failures.append(f"{name}: max error {err:.2e} > {tol:.0e}")


def _kernel_checks(mesh, failures):
    """normbook.kernels on DTensors: every placement of x, both norms, with and without the add."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    import normbook.kernels as K

    torch.manual_seed(0)
    x, r, dy, dh = (torch.randn(4, 6, D) for _ in range(4))
    w, b = 1 + 0.1 * torch.randn(D), 0.1 * torch.randn(D)
    for name in ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"):
        has_res, is_rms = name.startswith("add"), "rms" in name
        params = (w,) if is_rms else (w, b)

        def call(xx, rr, *ps):
            fn = getattr(K, name)
            if has_res:
                return fn(xx, rr, *ps)
            return (fn(xx, (D,), *ps),)

        ref_leaves = [t.clone().requires_grad_() for t in (x, r, *params)]
        outs = call(ref_leaves[0], ref_leaves[1], *ref_leaves[2:])
        torch.autograd.backward(outs, (dy, dh)[:len(outs)])
        for placement in (Shard(0), Shard(1), Replicate(), Shard(2)):
            leaves = [distribute_tensor(x, mesh, [placement]).requires_grad_(),
                      distribute_tensor(r, mesh, [placement]).requires_grad_()]
            leaves += [distribute_tensor(p, mesh, [Replicate()]).requires_grad_() for p in params]
            outs_d = call(leaves[0], leaves[1], *leaves[2:])
            grads_in = [distribute_tensor(g, mesh, o.placements) for g, o in zip((dy, dh), outs_d)]
            torch.autograd.backward(outs_d, grads_in)
            tag = f"{name} x {placement}"
            for i, (o, o_ref) in enumerate(zip(outs_d, outs)):
                _close(f"{tag}: output {i}", o.full_tensor(), o_ref, failures)
            if placement in (Shard(0), Shard(1)):
                if outs_d[0].placements != (placement,):
                    failures.append(f"{tag}: y placed {outs_d[0].placements}, expected x's")
                if not isinstance(leaves[2].grad.placements[0], Partial):
                    failures.append(f"{tag}: dweight placed {leaves[2].grad.placements}, expected Partial")
            for i, (leaf, ref) in enumerate(zip(leaves, ref_leaves)):
                if i == 1 and not has_res:
                    continue
                _close(f"{tag}: grad {i}", leaf.grad.full_tensor(), ref.grad, failures, 1e-4)


def _module_checks(mesh, rank, failures):
    """The modules under SequenceParallel and fully_shard, the torch path and the kernel path."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    import normbook

    torch.manual_seed(1)
    x, dy = torch.randn(2, 8, D), torch.randn(2, 8, D)
    for cls in (normbook.LayerNorm, normbook.RMSNorm):
        torch.manual_seed(2)
        ref = cls(D)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.1 * torch.randn_like(p))
        xr = x.clone().requires_grad_()
        ref(xr).backward(dy)
        for kernels in (False, True):
            # the kernel path, as on a GPU: here in Triton's interpreter
            with normbook.backend("kernels" if kernels else "auto"):
                tag = f"{cls.__name__} kernels={kernels}"
                # sequence parallel: input sharded over the sequence, parameters replicated
                sp = cls(D)
                sp.load_state_dict(ref.state_dict())
                parallelize_module(sp, mesh, SequenceParallel())
                xs = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
                y = sp(xs)
                y.backward(distribute_tensor(dy, mesh, y.placements))
                _close(f"{tag} SP: y", y.full_tensor(), ref(x), failures)
                _close(f"{tag} SP: dx", xs.grad.full_tensor(), xr.grad, failures, 1e-4)
                for (n, p), p_ref in zip(sp.named_parameters(), ref.parameters()):
                    _close(f"{tag} SP: d{n}", p.grad.full_tensor(), p_ref.grad, failures, 1e-4)
                # FSDP2: parameters sharded at rest, whole in the forward; each rank its own batch
                fs = cls(D)
                fs.load_state_dict(ref.state_dict())
                fully_shard(fs, mesh=mesh)
                xl = x[rank:rank + 1].clone().requires_grad_()
                y = fs(xl)
                y.backward(dy[rank:rank + 1])
                _close(f"{tag} FSDP: y", y, ref(x)[rank:rank + 1], failures)
                _close(f"{tag} FSDP: dx", xl.grad, xr.grad[rank:rank + 1], failures, 1e-4)
                for (n, p), p_ref in zip(fs.named_parameters(), ref.parameters()):
                    # FSDP2 averages gradients over ranks: the mean over the two halves' sums
                    _close(f"{tag} FSDP: d{n}", p.grad.full_tensor(), p_ref.grad / WORLD, failures, 1e-4)


def _compile_checks(mesh, failures):
    """torch.compile traces through the custom ops on DTensors (fullgraph, aot_eager: the
    inductor backend would compile C++ for minutes on a CPU)."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    import normbook.kernels as K

    torch.manual_seed(4)
    x, dy = torch.randn(2, 6, D), torch.randn(2, 6, D)
    w = 1 + 0.1 * torch.randn(D)
    ref = [t.clone().requires_grad_() for t in (x, w)]
    K.rms_norm(ref[0], (D,), ref[1]).backward(dy)
    f = torch.compile(lambda a, b: K.rms_norm(a, (D,), b), backend="aot_eager", fullgraph=True)
    xd = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    y = f(xd, wd)
    y.backward(distribute_tensor(dy, mesh, y.placements))
    _close("compiled rms_norm: y", y.full_tensor(), K.rms_norm(x, (D,), w), failures)
    _close("compiled rms_norm: dx", xd.grad.full_tensor(), ref[0].grad, failures, 1e-4)
    _close("compiled rms_norm: dweight", wd.grad.full_tensor(), ref[1].grad, failures, 1e-4)
    if not isinstance(wd.grad.placements[0], Partial):
        failures.append(f"compiled rms_norm: dweight placed {wd.grad.placements}, expected Partial")


def _feature_checks(rank, failures):
    """normbook.distributed: features split over the ranks, statistics merged across them."""
    from normbook import distributed, reference

    torch.manual_seed(3)
    x = 3 + torch.randn(5, 2 * D, dtype=torch.float64)
    w, b = 1 + 0.1 * torch.randn(2 * D, dtype=torch.float64), 0.1 * torch.randn(2 * D, dtype=torch.float64)
    dy = torch.randn(5, 2 * D, dtype=torch.float64)
    cols = slice(rank * D, (rank + 1) * D)
    for is_rms in (False, True):
        leaves = [t[..., cols].clone().requires_grad_() for t in (x, w, b)]
        if is_rms:
            y = distributed.rms_norm_sharded(leaves[0], leaves[1], 1e-6)
            y_ref, rstd = reference.rms_norm_forward(x, w, 1e-6)
            g_ref = reference.rms_norm_backward(dy, x, w, rstd)
        else:
            y = distributed.layer_norm_sharded(leaves[0], leaves[1], leaves[2], 1e-5)
            y_ref, mean, rstd = reference.layer_norm_forward(x, w, b, 1e-5)
            g_ref = reference.layer_norm_backward(dy, x, w, mean, rstd)
        y.backward(dy[..., cols])
        tag = "rms_norm_sharded" if is_rms else "layer_norm_sharded"
        _close(f"{tag}: y", y, y_ref[..., cols], failures, 1e-12)
        _close(f"{tag}: dx", leaves[0].grad, g_ref[0][..., cols], failures, 1e-12)
        _close(f"{tag}: dweight", leaves[1].grad, g_ref[1][cols], failures, 1e-12)
        if not is_rms:
            _close(f"{tag}: dbias", leaves[2].grad, g_ref[2][cols], failures, 1e-12)


def _empty_shard_checks(mesh, failures):
    """The torch backend on DTensors split over the features where a rank holds none of them
    (D = 1 over 2 ranks: 1 and 0; rows of 1 and of 1e20, whose mean square overflows fp32):
    y and the gradients against the same calls on plain tensors. (RMSNorm raised on the empty
    rank: amax over an empty dim, in the overflow rescue's scale.)"""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import normbook

    torch.manual_seed(4)
    for scale in (1.0, 1e20):
        x, dy = scale * torch.randn(3, 1), torch.randn(3, 1)
        w = 1 + 0.1 * torch.randn(1)
        for name in ("rms_norm", "layer_norm"):
            fn = getattr(normbook, name)
            leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
            fn(leaves[0], (1,), leaves[1]).backward(dy)
            dleaves = [distribute_tensor(x, mesh, [Shard(-1)]).requires_grad_(),
                       distribute_tensor(w, mesh, [Replicate()]).requires_grad_()]
            y = fn(dleaves[0], (1,), dleaves[1])
            y.backward(distribute_tensor(dy, mesh, y.placements))
            tag = f"{name} of D = 1 on 2 ranks, scale {scale:g}"
            _close(f"{tag}: y", y.full_tensor(), fn(x, (1,), w), failures)
            for i, (leaf, ref) in enumerate(zip(dleaves, leaves)):
                _close(f"{tag}: grad {i}", leaf.grad.full_tensor(), ref.grad, failures)


def _checks(rank, world):
    """Every check on one rank (run by normbook.distributed.launch): the failures, as text."""
    from torch.distributed.device_mesh import init_device_mesh

    failures = []
    mesh = init_device_mesh("cpu", (world,))
    for name, check in (("kernels", lambda: _kernel_checks(mesh, failures)),
                        ("modules", lambda: _module_checks(mesh, rank, failures)),
                        ("compile", lambda: _compile_checks(mesh, failures)),
                        ("features", lambda: _feature_checks(rank, failures)),
                        ("empty shard", lambda: _empty_shard_checks(mesh, failures))):
        try:
            check()
        except Exception:
            failures.append(f"{name}: raised\n{traceback.format_exc()}")
    return failures


def test_two_processes_match_one():
    pytest.importorskip("triton")
    from normbook.distributed import launch

    failures = [f"rank {rank}: {f}"
                for rank, fs in enumerate(launch(_checks, world=WORLD)) for f in fs]
    assert not failures, "\n".join(failures)
