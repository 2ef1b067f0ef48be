"""Timing: a mode as a callable, the timers, host time per call, and the copy bandwidth.

Three timers; each row records which one timed it (``timer``):

- ``cudagraph`` (CUDA, the default): N calls of the closure captured in one CUDA graph, the
  graph replayed :data:`REPLAYS` times, CUDA events around each replay; a replay's time over N is
  one sample, and a row gets the median and the 20% / 80% quantiles of the samples. The host
  launches one graph per replay, so Python, torch's dispatch and Triton's launch stay out of the
  device time: a kernel shorter than its host cost (normbook's at M = 32768, D <= 2048 on the
  H200) is timed as the kernel, not as the wait for the host. The L2 cache is not flushed
  between the N calls: a call may find in L2 what the one before left there. Every shape the
  goal judges moves 134 MB or more per call, past the 50 MB or so of an H100's or H200's L2,
  and a row's same-size copy is timed the same way.
- ``do_bench`` (CUDA, ``--timer do_bench``): ``triton.testing.do_bench``, events around each call,
  L2 flushed before each: how the H200 results of 2026-12-04 were timed. A call whose host
  cost exceeds its kernel's time is timed at its host cost. Also the fallback for a closure
  that cannot be captured (the row's ``timer_note`` says why).
- ``perf_counter`` (the CPU): a ``time.perf_counter`` loop with the same statistics and no
  cache flush; CPU numbers are for the book's small-shape checks only.

Why not ``triton.testing.do_bench_cudagraph`` (Triton 3.6 and 3.9 have it, quantiles
included): it captures on a stream of its own, and the ``bwd`` closure's backward ops run on the
stream its forward ran on (torch's autograd stream semantics), outside that capture; and it
replays ten graphs of ``rep`` ms each, ten times do_bench's time per row. Here one side stream
(:func:`side_stream`) holds everything: the runner makes the closure (the ``bwd`` forward
included) and calls it first on that stream, and the graph is captured on it. What happens once
happens before capture, in that first call and the warm-up: compiles, autotuning, normbook's
plans measuring their first launch. The garbage collector is off while capturing (a Triton
kernel freed then unloads its module, which capture forbids; Triton 3.9's cudagraph timer does
the same). A capture that fails raises :class:`NotCapturable`, and :func:`timed` falls back to
do_bench.

Backward is timed alone: forward runs once outside the timed region, and each timed call is
``torch.autograd.grad(outputs, wrt, grad_outputs, retain_graph=True)``. autograd.grad returns
fresh gradients instead of accumulating into ``.grad``, so nothing needs resetting between
calls. ``fwd`` runs with the inputs requiring grad, as in training (each provider saves what
its backward needs); ``fwd_bwd`` is both in one call.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from typing import Callable, NamedTuple

import torch

from normbook.bench.providers import Inputs

__all__ = ["closure", "bench", "timed", "Timed", "NotCapturable", "copy_bandwidth",
           "synchronize", "host_ms", "host_bound", "side_stream", "default_timer",
           "graph_calls", "same_size_numel", "TIMERS", "DESCRIBE"]

MIN_REPS = 25          # at least this many timed calls per row, also when one call takes ms
REPLAYS = 10           # replays of a graph: the samples of a cudagraph row
MAX_GRAPH_CALLS = 1000  # calls captured in one graph: bounds the capture's host time
TIMERS = ("cudagraph", "do_bench", "perf_counter")
DESCRIBE = {
    "cudagraph": f"CUDA graph of N calls on a side stream, replayed {REPLAYS} times, CUDA events "
                 "around each replay, L2 not flushed between calls; median, q20, q80 of the "
                 "replays' time per call (a row not capturable: do_bench, its timer says so)",
    "do_bench": "triton.testing.do_bench (CUDA events, L2 flushed), median, q20, q80",
    "perf_counter": "time.perf_counter loop (no cache flush), median, q20, q80",
}


class NotCapturable(RuntimeError):
    """The closure could not be captured in a CUDA graph; the message says why."""


class Timed(NamedTuple):
    """A timing in ms and the timer that made it; ``note``: why not the timer asked for."""

    ms: float
    q20: float
    q80: float
    timer: str
    note: str | None = None


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


def default_timer(device) -> str:
    return "cudagraph" if torch.device(device).type == "cuda" else "perf_counter"


_SIDE: dict[int, "torch.cuda.Stream"] = {}


@contextlib.contextmanager
def side_stream(device):
    """On CUDA: the current stream is this process's one side stream for ``device`` (capture
    needs a stream other than the default one), ordered after the work queued before and before
    the work queued after. Elsewhere: nothing."""
    device = torch.device(device)
    if device.type != "cuda":
        yield None
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    side = _SIDE.get(index)
    if side is None:
        side = _SIDE[index] = torch.cuda.Stream(device=index)
    before = torch.cuda.current_stream(index)
    if before == side:      # already on it
        yield side
        return
    side.wait_stream(before)
    try:
        with torch.cuda.stream(side):
            yield side
    finally:
        before.wait_stream(side)


def _quantiles(times_ms: list[float]) -> tuple[float, float, float]:
    """(median, q20, q80) of the recorded times, in ms."""
    if len(times_ms) == 1:
        return times_ms[0], times_ms[0], times_ms[0]
    q = statistics.quantiles(times_ms, n=10, method="inclusive")  # deciles: q[1] = 20%, q[7] = 80%
    return statistics.median(times_ms), q[1], q[7]


def _count(budget_ms: float, call_ms: float, most: int) -> int:
    """Calls of ``call_ms`` each that fill ``budget_ms``: at least 1, at most ``most``."""
    return max(1, min(most, int(budget_ms / max(call_ms, 1e-3))))


def _bench_cpu(fn, warmup_ms: float, rep_ms: float, min_reps: int = 3, max_reps: int = 1000):
    t0 = time.perf_counter()
    fn()
    first = (time.perf_counter() - t0) * 1e3
    n_warm = 0 if first > warmup_ms else _count(warmup_ms, first, 100)
    for _ in range(n_warm):
        fn()
    n = max(min_reps, _count(rep_ms, first, max_reps))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return _quantiles(times)


def _events_ms(fn, calls: int = 1) -> float:
    """Device time per call of ``calls`` eager calls on the current stream (host gaps included)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _bench_do_bench(fn, warmup_ms: float, rep_ms: float):
    import triton.testing

    # do_bench times rep_ms / (one call's time) calls: a wide row (4 ms a call at
    # D = 131072) would get a dozen; stretch rep_ms so the median has MIN_REPS behind it
    rep_ms = max(rep_ms, MIN_REPS * _events_ms(fn))
    ms, q20, q80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                           quantiles=[0.5, 0.2, 0.8])
    return float(ms), float(q20), float(q80)


def graph_calls(call_ms: float, rep_ms: float) -> int:
    """Calls to capture in one graph: :data:`REPLAYS` replays take about ``rep_ms`` in all,
    they make at least :data:`MIN_REPS` timed calls, and no graph has more than
    :data:`MAX_GRAPH_CALLS`. ``call_ms`` is an eager call's time, which host time may inflate:
    then the graph is shorter than it could be, never longer."""
    fewest = -(-MIN_REPS // REPLAYS)
    return max(fewest, min(MAX_GRAPH_CALLS, int(rep_ms / (REPLAYS * max(call_ms, 1e-3)))))


def _capture(fn, calls: int) -> "torch.cuda.CUDAGraph":
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()   # a Triton kernel finalized during capture would unload its module
    try:
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
            for _ in range(calls):
                fn()
    finally:
        if collecting:
            gc.enable()
    return graph


def _bench_graph(fn, warmup_ms: float, rep_ms: float):
    """The ``cudagraph`` timer (module docstring); on the current stream, not the default one."""
    first = _events_ms(fn)
    for _ in range(_count(warmup_ms, first, 10_000)):   # warm-up: the clock comes up
        fn()
    calls = graph_calls(_events_ms(fn, 5), rep_ms)
    try:
        graph = _capture(fn, calls)
    except Exception as e:
        torch.cuda.synchronize()
        msg = " ".join(str(e).split())[:200]
        raise NotCapturable(f"{type(e).__name__}: {msg}") from e
    try:
        graph.replay()   # the first replay uploads the graph: not timed
        times = []
        for _ in range(REPLAYS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
    finally:
        graph.reset()
    return _quantiles(times)


def bench(fn: Callable[[], object], device, warmup_ms: float = 25, rep_ms: float = 100,
          timer: str | None = None):
    """Time ``fn`` with ``timer`` (None: :func:`default_timer`): (median, q20, q80) in ms.

    ``cudagraph`` raises :class:`NotCapturable` where ``fn`` cannot be captured (:func:`timed`
    falls back to ``do_bench``). Triton is imported only here, when a CUDA timer runs.
    """
    device = torch.device(device)
    timer = timer or default_timer(device)
    fits = ("cudagraph", "do_bench") if device.type == "cuda" else ("perf_counter",)
    if timer not in fits:
        raise ValueError(f"timer: expected one of {', '.join(fits)} for {device.type} work, "
                         f"got {timer!r}")
    if timer == "perf_counter":
        return _bench_cpu(fn, warmup_ms, rep_ms)
    with side_stream(device):
        if timer == "do_bench":
            return _bench_do_bench(fn, warmup_ms, rep_ms)
        return _bench_graph(fn, warmup_ms, rep_ms)


def timed(fn: Callable[[], object], device, warmup_ms: float = 25, rep_ms: float = 100,
          timer: str | None = None) -> Timed:
    """:func:`bench` with ``timer``, or with do_bench where a CUDA graph cannot hold ``fn``:
    the result names the timer that made it and, for a fallback, why."""
    timer = timer or default_timer(device)
    try:
        return Timed(*bench(fn, device, warmup_ms, rep_ms, timer), timer)
    except NotCapturable as e:
        note = f"not capturable in a CUDA graph ({e})"
    return Timed(*bench(fn, device, warmup_ms, rep_ms, "do_bench"), "do_bench", note)


def host_ms(fn: Callable[[], object], device, calls: int = 20) -> float | None:
    """Host time per call on CUDA: the Python, framework and launch cost of ``fn``, timed with
    perf_counter around ``calls`` calls before synchronizing (the GPU runs behind). None on the
    CPU, where host and device time are one."""
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


def host_bound(host: float | None, device_ms: float) -> bool | None:
    """Whether an eager loop of the row would wait on the host: its host time per call exceeds
    the device time per call, where the device time is the cudagraph timer's (do_bench's is
    inflated by the host time it is compared with). None without a host time or a device time."""
    if host is None or not (isinstance(device_ms, (int, float)) and math.isfinite(device_ms)):
        return None
    return host > device_ms


def same_size_numel(nbytes: int) -> int:
    """fp32 elements per tensor of a copy ``y.copy_(x)`` that moves ``nbytes`` (2 x 4 bytes per
    element), rounded to 7 significant bits: within 1/128 of ``nbytes``, so that rows of nearly
    the same bytes (LayerNorm's and RMSNorm's forward) share one measured copy."""
    numel = max(1, round(nbytes / 8))
    drop = max(0, numel.bit_length() - 7)
    return max(1, round(numel / (1 << drop))) << drop


def copy_bandwidth(device, nbytes: int | None = None, warmup_ms: float = 25,
                   rep_ms: float = 100, timer: str | None = None) -> dict:
    """The device's copy bandwidth: ``y.copy_(x)`` of ``nbytes`` per tensor, timed like the rows.

    Bytes = 2 * numel * itemsize (one read, one write). Default buffer: 1 GiB per tensor on
    CUDA (far past L2), 64 MiB on the CPU. Returns {"gbps", "ms", "bytes", "method", "timer"}.
    An idle GPU runs at a low clock: give a long ``warmup_ms`` for the first measurement.
    """
    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    numel = max(1, nbytes // 4)
    x = torch.randn(numel, device=device, dtype=torch.float32)
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), device, warmup_ms, rep_ms, timer)
    moved = 2 * numel * x.element_size()
    del x, y
    if device.type == "cuda":
        torch.cuda.empty_cache()
    size = f"{numel * 4 >> 20} MiB" if numel * 4 >= 1 << 20 else f"{numel * 4} bytes"
    return {"gbps": moved / (t.ms * 1e-3) / 1e9, "ms": t.ms, "bytes": moved,
            "method": f"y.copy_(x), fp32, {size} per tensor, median, {t.timer}", "timer": t.timer}
