"""Host time per call: what Python and the framework cost around the kernels.

    python -m normbook.bench host [--json FILE] [--number N] [--repeat R]

A norm on a small batch is over on the GPU in a few microseconds, so the time a user sees in
eager mode is set by the host: argument checks, autograd bookkeeping, the launcher. This
measures exactly that where users call it: the modules ``normbook.LayerNorm`` and
``normbook.RMSNorm`` on the kernel backend (``normbook.backend("kernels")``, the route a CUDA
tensor takes), with every Triton launch of ``normbook.kernels`` replaced by a no-op
(``stub_launches``), on a tiny CPU tensor (1 x 64, fp32, requires_grad), beside
``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` on the same tensor. Triton's own launch overhead (its
argument binding, about 10-20 us per launch on a GPU host) is not included: it is the same for
any Triton kernel and normbook cannot change it.

Timing: ``timeit``, ``number`` calls per repeat, the best of ``repeat`` repeats (the best is
the one least disturbed by the rest of the machine), the providers interleaved repeat by
repeat so that drift hits all of them alike. JSON keys: ``<provider>_<op>_<mode>_us`` for
provider normbook and torch, op layer_norm and rms_norm, mode fwd and fwd_bwd; ``ratios``
(normbook over torch, op by op), ``goal`` and ``entry`` (what was timed).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import timeit

import torch

__all__ = ["stub_launches", "measure", "main", "GOAL"]

# forward <= 2.5x torch's, forward + backward <= 1.4x torch's (issue 21), through the modules
GOAL = {"fwd": 2.5, "fwd_bwd": 1.4}
D = 64
ENTRY = "normbook.LayerNorm / normbook.RMSNorm modules, kernel backend"


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **meta)`` does nothing."""

    def __getitem__(self, grid):
        return _noop


def _noop(*args, **kwargs):
    return None


@contextlib.contextmanager
def stub_launches():
    """Replace every kernel of ``normbook.kernels`` by a no-op launch for the duration."""
    from normbook.kernels import _backward, _forward

    saved = []
    for mod in (_forward, _backward):
        for name in dir(mod):
            if name.endswith("_kernel"):
                saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, _NoLaunch())
    try:
        yield
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)


def _calls():
    """{key: zero-argument callable} for every (provider, op, mode) measured."""
    import normbook

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, D, generator=g, requires_grad=True)
    dy = torch.randn(1, D, generator=g)
    modules = {"normbook_layer_norm": normbook.LayerNorm(D), "normbook_rms_norm": normbook.RMSNorm(D),
               "torch_layer_norm": torch.nn.LayerNorm(D), "torch_rms_norm": torch.nn.RMSNorm(D)}
    out = {}
    for name, m in modules.items():
        wrt = (x, *m.parameters())
        out[f"{name}_fwd_us"] = m
        out[f"{name}_fwd_bwd_us"] = (lambda m=m, wrt=wrt: torch.autograd.grad(m(x), wrt, dy))
    return {k: (lambda f=f: f(x)) if k.endswith("_fwd_us") else f for k, f in out.items()}


def measure(number: int = 2000, repeat: int = 7) -> dict:
    """Microseconds per call, the best of ``repeat`` batches of ``number`` calls each."""
    import normbook

    calls = _calls()
    best = {k: float("inf") for k in calls}
    with stub_launches(), normbook.backend("kernels"):
        for f in calls.values():  # warm up: first calls import, build caches, register ops
            for _ in range(50):
                f()
        for _ in range(repeat):
            for k, f in calls.items():
                t = timeit.timeit(f, number=number) / number * 1e6
                best[k] = min(best[k], t)
    return best


def ratios(us: dict) -> dict:
    """normbook over torch, op by op (LayerNorm over torch's LayerNorm, RMSNorm over its
    RMSNorm), per mode."""
    out = {}
    for op in ("layer_norm", "rms_norm"):
        for mode in GOAL:
            out[f"{op}_{mode}"] = us[f"normbook_{op}_{mode}_us"] / us[f"torch_{op}_{mode}_us"]
    return out


def report(us: dict) -> tuple[str, bool]:
    r = ratios(us)
    lines = [f"host time per call of the {ENTRY}, kernel launches stubbed, 1 x {D} fp32 on "
             f"the CPU (best of batches; torch {torch.__version__})",
             f"{'':24}{'fwd us':>10}{'fwd+bwd us':>12}"]
    for name in ("normbook_layer_norm", "normbook_rms_norm", "torch_layer_norm", "torch_rms_norm"):
        lines.append(f"{name:24}{us[name + '_fwd_us']:>10.1f}{us[name + '_fwd_bwd_us']:>12.1f}")
    ok = True
    for key, ratio in r.items():
        mode = "fwd_bwd" if key.endswith("fwd_bwd") else "fwd"
        good = ratio <= GOAL[mode]
        ok &= good
        lines.append(f"{key:24}{ratio:.2f}x torch's (goal <= {GOAL[mode]}x)  {'PASS' if good else 'FAIL'}")
    return "\n".join(lines), ok


def main(argv=None) -> int:
    import argparse

    from normbook.bench.cli import _positive_int as positive_int

    p = argparse.ArgumentParser(prog="python -m normbook.bench host", description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="FILE", help="write the microseconds (and ratios) as JSON")
    p.add_argument("--number", type=positive_int, default=2000, help="calls per batch (default 2000)")
    p.add_argument("--repeat", type=positive_int, default=7,
                   help="batches; the best counts (default 7)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:  # too late to switch: run again in a fresh process
            env = dict(os.environ, TRITON_INTERPRET="1")
            return subprocess.call([sys.executable, "-m", "normbook.bench", "host", *(sys.argv[2:] if argv is None else argv)], env=env)
        os.environ["TRITON_INTERPRET"] = "1"   # CPU tensors reach the (stubbed) launchers
    torch.set_num_threads(1)
    us = measure(args.number, args.repeat)
    text, ok = report(us)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(us, ratios=ratios(us), goal=GOAL, entry=ENTRY, torch=torch.__version__,
                           D=D), f, indent=1)
    return 0
