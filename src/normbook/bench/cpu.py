"""The CPU backend against torch on the CPU: what a reader running the book on a laptop pays.

    normbook-bench cpu [--json FILE [--force]] [--repeat R] [--goal]

Both norms, forward and forward + backward, fp32 and bf16, at M x D = 4096 x 1024,
2048 x 4096, 512 x 16384 and 64 x 131072 (:data:`SHAPES`): ``normbook.layer_norm`` / ``normbook.rms_norm`` on the torch-ops backend
(``normbook.backend("torch")``: the book's backward, equations (ln-dx) and (rms-dx)) beside
``torch.nn.functional`` on the same tensors (weight and bias as ``Parameter`` objects, as in a module),
in one run, the two interleaved repeat by repeat.
Time per call: the best of ``repeat`` calls (``time.perf_counter``), after two warm-up calls.

JSON keys: ``<norm>_<dtype>_<D>_<fwd|fwd_bwd>_ratio`` (normbook over torch; norm ``layer`` or
``rms``), the milliseconds behind each as ``..._ms`` for ``normbook`` and ``torch``, ``goal``
(every ratio <= 2.0; judged, PASS/FAIL, only with ``--goal``), ``threads`` and ``torch``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

__all__ = ["SHAPES", "GOAL", "measure", "main"]

SHAPES = ((4096, 1024), (2048, 4096), (512, 16384), (64, 131072))   # (M, D): 4 to 8 M values
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GOAL = 2.0


def _best_ms(f, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _calls(norm: str, M: int, D: int, dtype: torch.dtype) -> dict:
    """{(provider, mode): zero-argument callable} on one set of tensors."""
    import torch.nn.functional as F

    import normbook

    g = torch.Generator().manual_seed(M + D)
    x = torch.randn(M, D, generator=g).to(dtype).requires_grad_()
    # Parameters, as a module's weight and bias are (the paths once differed for them)
    w = torch.nn.Parameter((1 + 0.1 * torch.randn(D, generator=g)).to(dtype))
    b = torch.nn.Parameter((0.1 * torch.randn(D, generator=g)).to(dtype))
    dy = torch.randn(M, D, generator=g).to(dtype)
    if norm == "layer":
        fns = {"normbook": lambda: normbook.layer_norm(x, (D,), w, b),
               "torch": lambda: F.layer_norm(x, (D,), w, b)}
        wrt = (x, w, b)
    else:
        fns = {"normbook": lambda: normbook.rms_norm(x, (D,), w),
               "torch": lambda: F.rms_norm(x, (D,), w)}
        wrt = (x, w)

    def forward(f):
        def run():
            with torch.no_grad():
                f()
        return run
    out = {}
    for provider, f in fns.items():
        out[provider, "fwd"] = forward(f)
        out[provider, "fwd_bwd"] = (lambda f=f: torch.autograd.grad(f(), wrt, dy))
    return out


def measure(repeat: int = 10) -> dict:
    """The JSON's keys (see the module docstring) for every norm, dtype, shape and mode."""
    import normbook

    out = {}
    with normbook.backend("torch"):
        for norm in ("layer", "rms"):
            for name, dtype in DTYPES.items():
                for M, D in SHAPES:
                    calls = _calls(norm, M, D, dtype)
                    for f in calls.values():            # warm up: allocator, caches
                        f()
                        f()
                    ms = {k: float("inf") for k in calls}
                    for _ in range(repeat):             # interleaved: drift hits both alike
                        for k, f in calls.items():
                            ms[k] = min(ms[k], _best_ms(f, 1))
                    for mode in ("fwd", "fwd_bwd"):
                        key = f"{norm}_{name}_{D}_{mode}"
                        out[f"{key}_normbook_ms"] = ms["normbook", mode]
                        out[f"{key}_torch_ms"] = ms["torch", mode]
                        out[f"{key}_ratio"] = ms["normbook", mode] / ms["torch", mode]
    return out


def report(data: dict, goal: bool = False) -> tuple[str, bool]:
    """The table of milliseconds and ratios; with ``goal``, each ratio judged against
    :data:`GOAL`. Returns (text, every goal met)."""
    lines = [f"CPU backend against torch.nn.functional on the CPU ({torch.get_num_threads()} "
             f"threads, torch {torch.__version__}); best of the repeats, milliseconds",
             f"{'':26}{'normbook':>10}{'torch':>10}{'ratio':>8}"]
    ok = True
    # (in the order measured, D ascending: sorted as text, 131072 came before 16384)
    for key in [k[:-len("_ratio")] for k in data if k.endswith("_ratio")]:
        ratio = data[f"{key}_ratio"]
        ok &= ratio <= GOAL
        verdict = f" {'PASS' if ratio <= GOAL else 'FAIL'}" if goal else ""
        lines.append(f"{key:26}{data[key + '_normbook_ms']:>10.2f}{data[key + '_torch_ms']:>10.2f}"
                     f"{ratio:>7.2f}x{verdict}")
    if goal:
        lines.append(f"goal: every ratio <= {GOAL}: {'all PASS' if ok else 'not met'}")
    return "\n".join(lines), ok


DESCRIPTION = f"""The CPU backend against torch on the CPU: what a reader running the book on a
laptop pays.

normbook.layer_norm / rms_norm on the torch-ops backend beside torch.nn.functional, forward
and forward + backward, fp32 and bf16, at M x D = {' and '.join(f'{M} x {D}' for M, D in SHAPES)};
the best of --repeat calls of each, the two interleaved. Needs neither a GPU nor Triton."""

EXAMPLES = f"""examples:
    normbook-bench cpu                         # the table: milliseconds and ratios to torch
    normbook-bench cpu --json cpu.json         # also as JSON: <norm>_<dtype>_<D>_<mode>_ratio, ...
    normbook-bench cpu --goal                  # judge: every ratio <= {GOAL}; exit status 1 if not
    normbook-bench cpu --repeat 3              # a quick, rougher look
"""


def main(argv=None) -> int:
    """``normbook-bench cpu``: 0; with --goal, 1 when a ratio is above :data:`GOAL`. A refusal
    (a --json that cannot be written) raises; :func:`normbook.bench.cli.main` prints it as one
    line, exit status 2."""
    from normbook.bench.cli import PROG, Parser, add_json_out, json_out
    from normbook.bench.cli import _positive_int as positive_int

    p = Parser(prog=f"{PROG} cpu", description=DESCRIPTION, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_json_out(p, "the ratios and milliseconds")
    p.add_argument("--repeat", type=positive_int, default=10,
                   help="timed calls of each; the best counts (default 10)")
    p.add_argument("--goal", action="store_true",
                   help=f"judge every ratio against the goal (<= {GOAL}): PASS/FAIL, exit status "
                   "1 if not met")
    args = p.parse_args(argv)
    json_out(args)
    data = measure(args.repeat)
    text, ok = report(data, args.goal)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(data, goal=GOAL, threads=torch.get_num_threads(),
                           torch=torch.__version__), f, indent=1)
    return 1 if args.goal and not ok else 0


if __name__ == "__main__":   # as normbook-bench cpu, its refusals one line each
    from normbook.bench.cli import main as _bench

    raise SystemExit(_bench(["cpu", *__import__("sys").argv[1:]]))
