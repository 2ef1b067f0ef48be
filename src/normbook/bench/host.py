"""Host time per call: what Python and the framework cost around the kernels.

    normbook-bench host [--json FILE [--force]] [--number N] [--repeat R] [--goal]

A norm on a small batch is over on the GPU in a few microseconds, so the time a user sees in
eager mode is set by the host: argument checks, autograd bookkeeping, normbook's launcher and
Triton's. This measures exactly that where users call it, the modules ``normbook.LayerNorm``
and ``normbook.RMSNorm`` on the kernel backend, beside ``torch.nn.LayerNorm`` and
``torch.nn.RMSNorm`` on the same tensor, in one of two ways:

- **cuda** (a GPU at hand): real launches on M x D rows (default 4 x 4096 bf16); each round
  is the wall clock of ``number`` calls and one synchronization at the end, so the queue of
  kernels never throttles the host (their device time, a few microseconds, is below the host
  time being measured).
- **stubbed driver** (no GPU): Triton's CUDA driver is replaced by
  :func:`normbook.kernels._launch.stub_driver`, whose compiled kernels' launcher is a C no-op:
  the kernels compile for sm_90 for real, and everything up to that launcher runs: the
  modules, the front door, the autograd Function, normbook's launchers and Triton's binding
  and lookup (or normbook's direct launch, :func:`normbook.kernels._launch.launch`). CPU
  tensors of 1 x 64 fp32 (default): torch's CPU op then computes next to nothing, so its
  time is its own per-call cost (at 4 x 4096 bf16 torch's CPU norms compute for half their
  time, which would flatter normbook). Triton's launcher class itself (its Python ``__call__``
  before the driver's C launch, the same for any Triton kernel) needs the CUDA driver library
  and is stubbed with the rest; the cuda way includes it.

Timing: in rounds: each round times ``number`` calls of every provider, one after another,
and there are ``repeat`` rounds. The microseconds reported are each provider's best round (the
one least disturbed by the rest of the machine). A ratio is the median, over the rounds, of
normbook's time over torch's in the same round: the two sides of each ratio are timed
moments apart, so what slows the machine for a while slows both. JSON keys:
``<provider>_<op>_<mode>_us`` for provider normbook, torch and floor, op layer_norm and
rms_norm, mode fwd and fwd_bwd; ``ratios`` (normbook over torch, op by op), ``goal`` (judged
only with ``--goal``), ``way`` (cuda or stubbed driver), ``entry``, the shape and dtype,
``number``, ``repeat``. Needs Triton; without it the command refuses in one line.

The floor: any autograd Function written in Python pays a fixed cost that torch's own norms,
dispatched in C++, do not: the Python forward and backward bodies, the context, the saved
tensors. To show where that floor lies, the same modules are timed a third way, ``floor_*``:
a minimal Function (:class:`_Floor`) that only allocates what the kernel route allocates (y and
the statistics; dx, dweight, dbias) and launches nothing, called by the same C++ ``apply`` and
module wrapper as normbook's. Its ratios are ``floor_ratios``; no design with a Python
Function and no launch can be faster than it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

__all__ = ["stubbed", "measure", "ratios", "main", "GOAL", "Timings"]

# host time per call <= 1.5x torch's, forward and forward + backward, through the modules
GOAL = {"fwd": 1.5, "fwd_bwd": 1.5}
ENTRY = "normbook.LayerNorm / normbook.RMSNorm modules, kernel backend"
SHAPES = {"cuda": (4, 4096, "bf16"), "stubbed driver": (1, 64, "fp32")}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@contextlib.contextmanager
def stubbed():
    """Launches that do nothing, for the duration (:func:`normbook.kernels._launch.stub_driver`),
    with the front door taking CPU tensors on the kernel backend (as it does under Triton's
    interpreter). Needs Triton's interpreter off."""
    from normbook import functional
    from normbook.kernels import _launch

    was = functional._INTERPRETED
    functional._INTERPRETED = True
    try:
        with _launch.stub_driver():
            yield
    finally:
        functional._INTERPRETED = was


class _Floor(torch.autograd.Function):
    """The least an autograd Function on the kernel route can do: allocate the outputs the
    launchers allocate (y and the (k, M) statistics; dx, dweight, dbias), save what backward
    reads, compute nothing. ``apply(x, weight, bias, k)``."""

    @staticmethod
    def forward(ctx, x, weight, bias, k):
        y = torch.empty_like(x)
        stats = x.new_empty(k, x.shape[0], dtype=torch.float32)
        ctx.save_for_backward(x, weight, stats)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, _ = ctx.saved_tensors
        return (torch.empty_like(x), torch.empty_like(weight),
                torch.empty_like(weight) if ctx.has_bias else None, None)


_floor_apply = super(torch.autograd.Function, _Floor).apply   # the C++ apply, as normbook's


class _FloorLayerNorm(torch.nn.LayerNorm):
    def forward(self, input):
        return _floor_apply(input, self.weight, self.bias, 2)


class _FloorRMSNorm(torch.nn.RMSNorm):
    def forward(self, input):
        return _floor_apply(input, self.weight, None, 1)


PROVIDERS = ("normbook", "torch", "floor")


def _calls(M: int, D: int, dtype: torch.dtype, device: str):
    """{key: zero-argument callable} for every (provider, op, mode) measured."""
    import normbook

    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, D, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(M, D, generator=g).to(device, dtype)
    kw = dict(device=device, dtype=dtype)
    modules = {"normbook_layer_norm": normbook.LayerNorm(D, **kw),
               "normbook_rms_norm": normbook.RMSNorm(D, **kw),
               "torch_layer_norm": torch.nn.LayerNorm(D, **kw),
               "torch_rms_norm": torch.nn.RMSNorm(D, **kw),
               "floor_layer_norm": _FloorLayerNorm(D, **kw),
               "floor_rms_norm": _FloorRMSNorm(D, **kw)}
    out = {}
    for name, m in modules.items():
        wrt = (x, *m.parameters())
        out[f"{name}_fwd_us"] = (lambda m=m: m(x))
        out[f"{name}_fwd_bwd_us"] = (lambda m=m, wrt=wrt: torch.autograd.grad(m(x), wrt, dy))
    return out


class Timings(dict):
    """``{key: best microseconds per call}``, with ``rounds``: ``{key: [microseconds per call
    in each round]}``, the rounds in the order they ran."""

    rounds: dict


def _per_call_us(f, number: int, sync) -> float:
    """Wall clock of ``number`` calls of f and one ``sync`` after them, per call; the garbage
    collector off meanwhile, as ``timeit`` has it (a collection's pause is the whole process's,
    not the call's)."""
    sync()
    collecting = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(number):
            f()
        sync()
        return (time.perf_counter() - start) / number * 1e6
    finally:
        if collecting:
            gc.enable()


def measure(number: int = 100, repeat: int = 140, way: str = "stubbed driver",
            shape: tuple = None) -> Timings:
    """Microseconds per call: ``repeat`` rounds, each timing ``number`` calls of every
    provider in turn; the best round of each, and every round in ``.rounds``. ``way``: "cuda"
    (real launches) or "stubbed driver"; ``shape``: (M, D, dtype name), :data:`SHAPES` by
    default."""
    import normbook

    M, D, dt = shape or SHAPES[way]
    cuda = way == "cuda"
    calls = _calls(M, D, DTYPES[dt], "cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rounds: dict = {k: [] for k in calls}
    with contextlib.ExitStack() as stack:
        if not cuda:
            stack.enter_context(stubbed())
        stack.enter_context(normbook.backend("kernels"))
        for f in calls.values():  # warm up: first calls compile, build caches, register ops
            for _ in range(50):
                f()
        for _ in range(repeat):
            for k, f in calls.items():
                rounds[k].append(_per_call_us(f, number, sync))
    us = Timings((k, min(v)) for k, v in rounds.items())
    us.rounds = rounds
    return us


def ratios(us: dict, provider: str = "normbook") -> dict:
    """``provider`` (normbook, or the floor) over torch, op by op (LayerNorm over torch's
    LayerNorm, RMSNorm over its RMSNorm), per mode; {} where it was not measured. From
    :func:`measure`'s rounds, the median of the rounds' ratios; from plain best times (a dict
    without rounds), their ratio."""
    rounds = getattr(us, "rounds", None)
    out = {}
    for op in ("layer_norm", "rms_norm"):
        for mode in GOAL:
            key, base = f"{provider}_{op}_{mode}_us", f"torch_{op}_{mode}_us"
            if key not in us:
                continue
            if rounds:
                out[f"{op}_{mode}"] = statistics.median(
                    a / b for a, b in zip(rounds[key], rounds[base]))
            else:
                out[f"{op}_{mode}"] = us[key] / us[base]
    return out


def report(us: dict, goal: bool = False, way: str = "stubbed driver",
           shape: tuple = None) -> tuple[str, bool]:
    """The table of microseconds and ratios; with ``goal``, each ratio judged against
    :data:`GOAL`. Returns (text, every goal met)."""
    import triton

    r = ratios(us)
    M, D, dt = shape or SHAPES[way]
    how = ("real launches on " + torch.cuda.get_device_name()) if way == "cuda" else (
        "Triton's driver stubbed (launchers do nothing), CPU tensors")
    lines = [f"host time per call of the {ENTRY}, {how}, {M} x {D} {dt} (us: the best round; "
             f"ratios: the median of the rounds'; torch {torch.__version__}, "
             f"Triton {triton.__version__})",
             f"{'':24}{'fwd us':>10}{'fwd+bwd us':>12}"]
    for provider in PROVIDERS:
        for op in ("layer_norm", "rms_norm"):
            name = f"{provider}_{op}"
            if name + "_fwd_us" in us:
                lines.append(f"{name:24}{us[name + '_fwd_us']:>10.1f}{us[name + '_fwd_bwd_us']:>12.1f}")
    ok = True
    floor = ratios(us, "floor")
    for key, ratio in r.items():
        mode = "fwd_bwd" if key.endswith("fwd_bwd") else "fwd"
        good = ratio <= GOAL[mode]
        ok &= good
        verdict = f" (goal <= {GOAL[mode]}x)  {'PASS' if good else 'FAIL'}" if goal else ""
        at_floor = f"; the floor {floor[key]:.2f}x" if key in floor else ""
        lines.append(f"{key:24}{ratio:.2f}x torch's{at_floor}{verdict}")
    if goal:
        lines.append(f"goal (fwd <= {GOAL['fwd']}x, fwd+bwd <= {GOAL['fwd_bwd']}x torch's): {'all PASS' if ok else 'not met'}")
    return "\n".join(lines), ok


DESCRIPTION = """Host time per call: what Python and the framework cost around the kernels.

Times the modules normbook.LayerNorm and normbook.RMSNorm on the kernel backend beside
torch.nn.LayerNorm and torch.nn.RMSNorm: with a GPU, real launches on 4 x 4096 bf16 (the wall
clock of --number calls and one synchronization); without one, on a 1 x 64 fp32 CPU tensor with
Triton's driver stubbed (the kernels compile for sm_90, their launcher does nothing). --repeat
rounds of --number calls of each, in turn; the best round's time, and the median of the rounds'
ratios. Needs Triton; runs with Triton's interpreter off (in a fresh process if needed)."""

EXAMPLES = """examples:
    normbook-bench host                        # the table: microseconds and ratios to torch
    normbook-bench host --json host.json       # also as JSON: <provider>_<op>_<mode>_us, ratios
    normbook-bench host --goal                 # judge: fwd and fwd+bwd <= 1.5x torch's;
                                               # exit status 1 when not met
    normbook-bench host --way stub             # the stubbed driver even where a GPU is
    normbook-bench host --number 100 --repeat 10   # a quick, rougher look
"""

WAYS = {"stub": "stubbed driver", "cuda": "cuda"}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def main(argv=None) -> int:
    """``normbook-bench host``: 0; with --goal, 1 when a goal is not met. A refusal (no
    Triton, a --json that cannot be written) raises; :func:`normbook.bench.cli.main` prints it
    as one line, exit status 2."""
    import argparse

    from normbook.bench.cli import PROG, Parser, BenchError, add_json_out, json_out
    from normbook.bench.cli import _positive_int as positive_int

    p = Parser(prog=f"{PROG} host", description=DESCRIPTION, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_json_out(p, "the microseconds (and ratios)")
    p.add_argument("--number", type=positive_int, default=100,
                   help="calls of each provider per round (default 100)")
    p.add_argument("--repeat", type=positive_int, default=140, help="rounds (default 140)")
    p.add_argument("--way", choices=("auto", *WAYS), default="auto",
                   help="cuda: real launches; stub: Triton's driver stubbed, CPU tensors; "
                   "auto (default): cuda when a GPU is at hand")
    p.add_argument("--goal", action="store_true",
                   help=f"judge the ratios against the goal (fwd <= {GOAL['fwd']}x, "
                   f"fwd+bwd <= {GOAL['fwd_bwd']}x torch's): PASS/FAIL, exit status 1 if not met")
    args = p.parse_args(argv)
    json_out(args)
    if _interpreting():
        if "triton" in sys.modules:  # too late to switch: run again in a fresh process
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            return subprocess.call([sys.executable, "-m", "normbook.bench", "host",
                                    *(sys.argv[2:] if argv is None else argv)], env=env)
        del os.environ["TRITON_INTERPRET"]   # compiled kernels: the launches are what is timed
    try:
        import normbook.kernels  # noqa: F401
    except ImportError as e:
        raise BenchError(f"the kernel backend it times cannot be imported: {e}; "
                         f"'{PROG} cpu' times the torch backend without Triton") from None
    way = WAYS[args.way] if args.way != "auto" else (
        "cuda" if torch.cuda.is_available() else "stubbed driver")
    if way == "cuda" and not torch.cuda.is_available():
        raise BenchError("--way cuda: no CUDA device is at hand (torch.cuda.is_available() is "
                         "False); --way stub measures with Triton's driver stubbed")
    torch.set_num_threads(1)
    us = measure(args.number, args.repeat, way)
    text, ok = report(us, args.goal, way)
    print(text)
    if args.json:
        M, D, dt = SHAPES[way]
        with open(args.json, "w") as f:
            json.dump(dict(us, ratios=ratios(us), floor_ratios=ratios(us, "floor"), goal=GOAL,
                           way=way, entry=ENTRY, torch=torch.__version__,
                           triton=__import__("triton").__version__, M=M, D=D, dtype=dt,
                           device=torch.cuda.get_device_name() if way == "cuda" else "cpu",
                           number=args.number, repeat=args.repeat), f, indent=1)
    return 1 if args.goal and not ok else 0


if __name__ == "__main__":   # as normbook-bench host, its refusals one line each
    from normbook.bench.cli import main as _bench

    raise SystemExit(_bench(["host", *__import__("sys").argv[1:]]))
