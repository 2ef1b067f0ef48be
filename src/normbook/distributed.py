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

import datetime
import os
import pickle
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist

__all__ = ["merge_stats", "layer_norm_sharded", "rms_norm_sharded", "all_reduce_param_grads",
           "launch", "sequence_parallel_experiment", "feature_parallel_experiment",
           "dtensor_experiment", "fsdp_experiment"]


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


# --- running code on several processes, for the chapter and the tests --------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_worker(rank, world, port, out_dir, timeout_s, fn, args):
    """One child of :func:`launch`: gloo group, ``fn``, result or traceback to a file."""
    # TRITON_INTERPRET=1 came with the environment launch() gave this process: it had to be
    # there before unpickling fn imported anything
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}")
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, world, *args)
        with open(path + ".pkl", "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(path + ".err", "w") as f:
            f.write(traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn, *args, world: int = 2, timeout_s: float = 120.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh CPU processes joined by gloo.

    Each child starts a new Python (the "spawn" method), with ``TRITON_INTERPRET=1`` in its
    environment before anything imports triton and ``torch.set_num_threads(1)``, and joins a
    gloo process group of ``world`` ranks on 127.0.0.1 at a free port; collectives in ``fn``
    use that default group. ``fn`` must be importable by name in a new process (defined at
    module level in a module, not in a notebook cell or ``__main__``); ``args`` and the return
    values must pickle.

    Returns:
        list of length ``world``: ``fn``'s return value on rank 0, 1, ... (sent back through
        files in a temporary directory).

    Raises:
        ValueError: ``fn`` cannot be found by a child process.
        RuntimeError: ``fn`` raised on some rank; the message holds each failing rank's traceback.
    """
    if getattr(fn, "__module__", "__main__") == "__main__" or "<locals>" in fn.__qualname__:
        raise ValueError(f"launch: {fn.__qualname__} must be a module-level function of an "
                         f"importable module (a spawned process cannot see __main__)")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"  # inherited by the children as they start
        try:
            mp.start_processes(_launch_worker, nprocs=world, join=True, start_method="spawn",
                               args=(world, _free_port(), tmp, timeout_s, fn, args))
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = old
        errors = []
        for rank in range(world):
            err = os.path.join(tmp, f"rank{rank}.err")
            if os.path.exists(err):
                with open(err) as f:
                    errors.append(f"--- rank {rank} ---\n{f.read()}")
        if errors:
            raise RuntimeError(f"launch: {fn.__qualname__} failed on "
                               f"{len(errors)} of {world} ranks:\n" + "\n".join(errors))
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


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


def sequence_parallel_experiment(rank, world, n=64, d=16,
                                 steps=20, lr=0.2):
    """Tokens split over ranks: local dweight, and SGD with and
    without the all-reduce (chapter "Norms across devices")."""
    from normbook import LayerNorm

    g = torch.Generator().manual_seed(0)     # same data everywhere
    x = 2 + torch.randn(n, d, generator=g, dtype=torch.float64)
    t = torch.randn(n, d, generator=g, dtype=torch.float64)
    mine = _rows(n, rank, world)             # this rank's tokens
    f64 = dict(dtype=torch.float64)

    one = _sgd(LayerNorm(d, **f64), x, t, n, 1, 0.0, False)
    local = _sgd(LayerNorm(d, **f64), x[mine], t[mine], n, 1, 0.0,
                 False)
    dw_local = local.weight.grad.clone()     # (D,) my tokens only
    all_reduce_param_grads(local)            # (D,) every token
    out = {"dweight_err_local": _rel(dw_local, one.weight.grad),
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


def feature_parallel_experiment(rank, world, n=8, d=64):
    """Features split over ranks: layer_norm_sharded and
    rms_norm_sharded against one process, in float64."""
    from normbook import reference

    g = torch.Generator().manual_seed(1)
    f64 = dict(generator=g, dtype=torch.float64)
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
    ln = max(_max(y, y1[:, cols]), _max(xs.grad, dx1[:, cols]),
             _max(ws.grad, dw1[cols]), _max(bs.grad, db1[cols]))

    xs, ws = (v[..., cols].clone().requires_grad_() for v in (x, w))
    y = rms_norm_sharded(xs, ws, 1e-6)
    y.backward(dy[:, cols])
    y1, rstd = reference.rms_norm_forward(x, w, 1e-6)
    dx1, dw1 = reference.rms_norm_backward(dy, x, w, rstd)
    rms = max(_max(y, y1[:, cols]), _max(xs.grad, dx1[:, cols]),
              _max(ws.grad, dw1[cols]))
    return {"layer_norm_err": ln, "rms_norm_err": rms}


def dtensor_experiment(rank, world, n=2, s=8, d=16):
    """normbook.kernels.layer_norm on DTensors sharded over the
    sequence (dim 1) and over the features (dim 2)."""
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
    F.layer_norm(leaves[0], (d,), *leaves[1:]).backward(dy)

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


def fsdp_experiment(rank, world, n=8, d=16):
    """A LayerNorm under FSDP2's fully_shard against one process;
    each rank runs its own n // world tokens."""
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
    at_rest = tuple(fs.weight.to_local().shape)   # (D / world,)
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
