"""Timing: a mode as a callable, a median-of-repeats timer, and the copy bandwidth.

On CUDA the timer is ``triton.testing.do_bench``: CUDA events around each call, the L2 cache
flushed before each, and the median with the 20% and 80% quantiles returned. On the CPU,
where do_bench cannot run, it is a ``time.perf_counter`` loop with the same statistics
(no cache flush: the CPU numbers are for the book's small-shape sanity checks only).

Backward is timed alone: forward runs once outside the timed region, and each timed call is
``torch.autograd.grad(outputs, wrt, grad_outputs, retain_graph=True)``. autograd.grad returns
fresh gradients instead of accumulating into ``.grad``, so nothing needs resetting between
calls. ``fwd`` runs with the inputs requiring grad, as in training (each provider saves what
its backward needs); ``fwd_bwd`` is both in one call.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from normbook.bench.providers import Inputs

__all__ = ["closure", "bench", "copy_bandwidth", "synchronize", "host_ms"]

MIN_REPS = 25   # at least this many timed calls per row, also when one call takes milliseconds


def closure(fn: Callable[[Inputs], tuple], inp: Inputs, mode: str) -> Callable[[], object]:
    """The zero-argument callable that ``mode`` times: fwd, bwd (forward excluded) or fwd_bwd."""
    if mode == "fwd":
        return lambda: fn(inp)
    wrt, grads = inp.wrt(), inp.grad_outputs()
    if mode == "bwd":
        outs = fn(inp)  # forward once, outside the timed region; its graph is kept
        return lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True)
    if mode == "fwd_bwd":
        return lambda: torch.autograd.grad(fn(inp), wrt, grads)
    raise ValueError(f"mode: expected fwd, bwd or fwd_bwd, got {mode!r}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _quantiles(times_ms: list[float]) -> tuple[float, float, float]:
    """(median, q20, q80) of the recorded times, in ms."""
    if len(times_ms) == 1:
        return times_ms[0], times_ms[0], times_ms[0]
    q = statistics.quantiles(times_ms, n=10, method="inclusive")  # deciles: q[1] = 20%, q[7] = 80%
    return statistics.median(times_ms), q[1], q[7]


def _bench_cpu(fn, warmup_ms: float, rep_ms: float, min_reps: int = 3, max_reps: int = 1000):
    t0 = time.perf_counter()
    fn()
    first = (time.perf_counter() - t0) * 1e3
    n_warm = 0 if first > warmup_ms else max(1, min(int(warmup_ms / max(first, 1e-3)), 100))
    for _ in range(n_warm):
        fn()
    n = max(min_reps, min(max_reps, int(rep_ms / max(first, 1e-3))))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return _quantiles(times)


def bench(fn: Callable[[], object], device, warmup_ms: float = 25, rep_ms: float = 100):
    """Time ``fn``: (median, q20, q80) in milliseconds.

    CUDA: ``triton.testing.do_bench(fn, warmup, rep, quantiles=[0.5, 0.2, 0.8])`` (imported
    here, lazily, so that the package imports without triton). CPU: a perf_counter loop.
    """
    device = torch.device(device)
    if device.type == "cuda":
        import triton.testing

        # do_bench times rep_ms / (one call's time) calls: a wide row (4 ms a call at
        # D = 131072) would get a dozen; stretch rep_ms so the median has MIN_REPS behind it
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        rep_ms = max(rep_ms, MIN_REPS * start.elapsed_time(end))
        ms, q20, q80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                               quantiles=[0.5, 0.2, 0.8])
        return float(ms), float(q20), float(q80)
    return _bench_cpu(fn, warmup_ms, rep_ms)


def host_ms(fn: Callable[[], object], device, calls: int = 20) -> float | None:
    """Host time per call on CUDA: the Python, framework and launch cost of ``fn``, timed with
    perf_counter around ``calls`` calls before synchronizing (the GPU runs behind). When it
    exceeds the device time of the row, a training loop without do_bench's cache flush between
    calls would wait on the host, not on the kernel: the runner flags such rows. None on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    synchronize(device)
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / calls
    synchronize(device)
    return host


def copy_bandwidth(device, nbytes: int | None = None, warmup_ms: float = 25,
                   rep_ms: float = 100) -> dict:
    """The device's copy bandwidth: ``y.copy_(x)`` of a large buffer, timed like the rows.

    Bytes = 2 * numel * itemsize (one read, one write). Default buffer: 1 GiB per tensor on
    CUDA (far past L2), 64 MiB on the CPU. Returns {"gbps", "ms", "bytes", "method"}.
    An idle GPU runs at a low clock: give a long ``warmup_ms`` for the first measurement.
    """
    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    numel = nbytes // 4
    x = torch.randn(numel, device=device, dtype=torch.float32)
    y = torch.empty_like(x)
    ms, _, _ = bench(lambda: y.copy_(x), device, warmup_ms, rep_ms)
    moved = 2 * numel * x.element_size()
    del x, y
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"gbps": moved / (ms * 1e-3) / 1e9, "ms": ms, "bytes": moved,
            "method": f"y.copy_(x), fp32, {numel * 4 >> 20} MiB per tensor, median"}
