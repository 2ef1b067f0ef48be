"""``normbook-bench`` (also ``python -m normbook.bench``): the command line.

With a CUDA device the default is the full sweep: four ops, three modes, bf16/fp16/fp32,
M = 32768 rows and D = 512 .. 131072 in powers of two, plus the small-D, many-rows case
(D = 128, M = 2**20). Without one it says so and runs the CPU mode: small shapes, fp32,
a perf_counter timer, providers torch / naive / reference (and compile with --compile).

Where a run writes. ``--out DIR`` names the folder. Without it the run writes into a new
folder under the system's temp folder (``tempfile.mkdtemp``), and the first line it prints
is ``normbook.bench: writing results to /abs/path``. Not a required flag, so that a first try
(``normbook-bench --quick``) runs as typed; not a folder under the caller's working folder,
which could be a repository or a home folder that a run would then litter unasked; a fresh
folder each time, so that no run overwrites another. The temp folder does not last (a reboot
may clear it): results to keep go to ``--out``.

Nothing recorded is replaced unasked. A run whose ``--out`` folder already holds a
``results.json``, and ``--merge``, ``--overview`` or ``--model-check`` whose ``--out FILE``
exists, are refused before anything is read or measured, unless ``--force`` is given: a GPU
run's rows cannot be measured again, and a second run would rewrite the first one's
``results.json`` after its first shape. So are the ``--json`` files of ``host``, ``cpu``,
``plans``, ``shapes`` and ``step`` (on a GPU each is a measurement of its own). (``--plot`` rewrites only
its own figures in its folder.)

Goals. The kernels' performance goal (:mod:`normbook.bench.goal`: bf16, M = 32768, a fraction
of copy bandwidth and faster than the rivals), and the host and CPU goals of ``host`` and ``cpu``, are judged only when asked for, with ``--goal``; then the exit
status says whether every goal was met (0) or not (1). Refusals are one line on stderr,
``normbook-bench: error: ...``, exit status 2, no traceback.

Examples:
    normbook-bench --quick                            # a short run; prints where it writes
    normbook-bench --quick --out results/quick        # the same, into a folder you name
    normbook-bench --ops layer_norm,rms_norm --modes fwd --dtypes bf16 --D 1024..16384 --out r/
    normbook-bench --device cuda --goal --out r/      # the full sweep, judged against the goal
    normbook-bench --summary r/ --goal                # recorded JSON: tables and the goal check
    normbook-bench --summary recorded --goal          # the GPU runs normbook ships (wheel too)
    normbook-bench --merge r/ r2/ --out all.json      # all.json exists? refused, unless --force
    normbook-bench --plot r/ --out figures/
    normbook-bench host --json host.json              # host time per call, launches stubbed
    normbook-bench cpu --json cpu.json --goal         # the CPU backend against torch
    normbook-bench plans --json plans.json            # the backward's plans for few rows (GPU)
    normbook-bench shapes --json shapes.json          # wide rows in candidate shapes (GPU)
    normbook-bench step --json step.json              # a Llama training step, HF's norms or ours
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from pathlib import Path

import torch

from normbook.bench import bytemodel, providers, runner
from normbook.bench.goal import GOAL

PROG = "normbook-bench"


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusals are one line, ``normbook-bench: error: ...``, as every
    other refusal here (argparse printed its usage block, eleven lines, above the message)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
GPU_PROVIDERS = ["normbook", "torch", "compile", "naive", "liger", "quack"]
CPU_PROVIDERS = ["torch", "naive", "reference"]


def _pow2_range(lo: int, hi: int) -> list[int]:
    out, d = [], lo
    while d <= hi:
        out.append(d)
        d *= 2
    return out


def _names(parser, flag: str, text: str, allowed) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        parser.error(f"{flag}: expected a comma-separated subset of {','.join(allowed)}, "
                     f"got {text!r}" + (f" (unknown: {','.join(bad)})" if bad else ""))
    return list(dict.fromkeys(names))


def _sizes(parser, flag: str, text: str) -> list[int]:
    """'1024,4096' or '512..131072' (powers of two from lo to hi, both included)."""
    try:
        if ".." in text:
            lo, hi = (int(s) for s in text.split(".."))
            if lo < 1 or lo & (lo - 1) or hi < lo or hi & (hi - 1):    # 512..1000 gave 512
                raise ValueError
            return _pow2_range(lo, hi)
        sizes = [int(s) for s in text.split(",") if s.strip()]
        if not sizes or min(sizes) < 1:
            raise ValueError
        return sizes
    except ValueError:
        parser.error(f"{flag}: expected positive integers as '1024,4096' or a power-of-two "
                     f"range '512..131072', got {text!r}")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return v


def _version() -> str:
    from normbook import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog=PROG,
        description="Benchmark LayerNorm/RMSNorm (and the fused residual adds) in GB/s and as "
                    "a fraction of the device's copy bandwidth; write JSON and plots. Five more "
                    "commands: 'normbook-bench host' (host time per call), 'normbook-bench "
                    "cpu' (the CPU backend against torch), 'normbook-bench plans' (the "
                    "backward's plans for few rows), 'normbook-bench shapes' (wide rows in "
                    "candidate block shapes) and 'normbook-bench step' (a Llama-shaped "
                    "training step with each provider's norms); each has its --help.",
        epilog="examples:" + __doc__.split("Examples:", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if available")
    p.add_argument("--ops", help=f"comma list of {','.join(bytemodel.OPS)} (default: all)")
    p.add_argument("--modes", help="comma list of fwd,bwd,fwd_bwd (default: all)")
    p.add_argument("--dtypes", help="comma list of bf16,fp16,fp32 (default: all on CUDA, fp32 on CPU)")
    p.add_argument("--providers", help=f"comma list of {','.join(providers.PROVIDERS)} "
                   f"(default: {','.join(GPU_PROVIDERS)} on CUDA, {','.join(CPU_PROVIDERS)} on CPU)")
    p.add_argument("--compile", action="store_true", help="CPU: add the torch.compile provider "
                   "(slow to warm up)")
    p.add_argument("--skip-unavailable", action="store_true",
                   help="a provider given by --providers (or --compile) that cannot run here is "
                   "recorded as skipped, not measured, with its reason; without this flag it is "
                   "an error before anything is measured (a default provider is always skipped)")
    p.add_argument("--M", type=_positive_int, help="rows (default: 32768 on CUDA, 4096 on CPU)")
    p.add_argument("--D", help="sizes: '1024,4096' or '512..131072' (default: 512..131072 on "
                   "CUDA, 256..4096 on CPU); giving --M or --D drops the small-D extra case")
    p.add_argument("--quick", action="store_true",
                   help="a short run: bf16, fwd and bwd, four sizes on CUDA; "
                   "fp32, fwd and bwd, M=512, D=256,1024 on the CPU (under a minute)")
    p.add_argument("--warmup-ms", type=_positive_float,
                   help="per-row warmup (default 25; CPU 5, CPU --quick 2)")
    p.add_argument("--rep-ms", type=_positive_float,
                   help="per-row timing (default 100; CPU 40, CPU --quick 10)")
    p.add_argument("--timer", choices=["cudagraph", "do_bench"],
                   help="CUDA: how device time is timed. cudagraph (default): many calls captured "
                   "in a CUDA graph and replayed, the host's time out of it, L2 not flushed "
                   "between calls (a closure that cannot be captured falls back to do_bench, "
                   "as its row says); do_bench: triton.testing.do_bench per call, L2 flushed "
                   "before each, as the H200 results of 2026-12-04 were timed")
    p.add_argument("--time-budget", type=_positive_float, metavar="SECONDS",
                   help="skip the remaining rows (recorded as skipped) once this much time is spent")
    p.add_argument("--threads", type=_positive_int,
                   help="CPU: torch.set_num_threads (default: torch's; 1 with --quick, the "
                   "steadiest on a busy machine)")
    p.add_argument("--out", metavar="DIR",
                   help="output folder of a run (default: a new folder under the system's temp "
                   "folder, printed on the first line); the output file of --merge, --overview "
                   "and --model-check, the folder of --plot. A folder holding a results.json, or "
                   "a file that exists, is refused unless --force")
    p.add_argument("--force", action="store_true",
                   help="replace the results.json in a run's --out folder, or the --out file of "
                   "--merge, --overview or --model-check (recorded GPU results cannot be "
                   "measured again: without --force an existing file is refused, before anything "
                   "is read or measured)")
    p.add_argument("--goal", action="store_true",
                   help="after a run or with --summary: judge the rows against the kernels' "
                   f"performance goal (bf16, M = {GOAL['M']}: at least {GOAL['frac']['fwd']:.2f} "
                   f"of copy bandwidth forward, {GOAL['frac']['bwd']:.2f} backward, "
                   f"{GOAL['tail'][2]:.2f} past D = {GOAL['tail'][0]}, faster than the "
                   "rivals), each run apart; exit status 1 when the newest run does not "
                   "meet it")
    p.add_argument("--no-plots", action="store_true", help="write only the JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--plot", nargs="+", metavar="SRC",
                   help="do not run: draw plots from JSON files/folders/globs into --out")
    p.add_argument("--dry-run", action="store_true",
                   help="check the steps on the CPU: the normbook kernels in Triton's interpreter, "
                   "M = 64, small D, torch.compile with the aot_eager backend (nothing is timed "
                   "meaningfully)")
    p.add_argument("--overview", nargs="+", metavar="SRC",
                   help="do not run: one PNG of every op's fraction of copy bandwidth (bf16), "
                   "--out FILE")
    p.add_argument("--merge", nargs="+", metavar="SRC",
                   help="do not run: merge recorded JSON (rows, skips, each run's provenance) "
                   "into one file, --out FILE")
    p.add_argument("--summary", nargs="+", metavar="SRC",
                   help="do not run: print the tables and the goal check of recorded JSON "
                   "(files, folders or globs; 'recorded': the GPU runs normbook carries, in a "
                   "checkout or an installed wheel)")
    p.add_argument("--model-check", nargs="+", metavar="SRC",
                   help="do not run: recorded JSON against the predictions of the retired "
                   "performance model recorded in --report (a compile report's JSON made before "
                   "2026-12-05): a table, and a PNG to --out FILE")
    p.add_argument("--report", metavar="JSON", help="with --model-check: the compile report")
    return p


def config_from_args(args, parser) -> runner.Config:
    """Defaults by device and --quick, then the explicit flags on top."""
    notes = []
    if args.dry_run:
        if args.device == "cuda":
            parser.error("--dry-run: runs on the CPU; drop --device cuda")
        args.device = "cpu"
        if os.environ.get("TRITON_INTERPRET") != "1" and "triton" in sys.modules:
            parser.error("--dry-run: set TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"   # before anything imports triton
        providers.SETTINGS.update(interpreter=True, compile_backend="aot_eager")
        notes.append("dry run: the normbook kernels in Triton's interpreter, torch.compile with "
                     "aot_eager; the times check the steps, they are not performance figures")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device: cuda requested, but torch.cuda.is_available() is False "
                     f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    if args.timer and not cuda:
        parser.error(f"--timer: {args.timer} times CUDA work; the CPU is timed with a "
                     "perf_counter loop (drop --timer)")
    if not cuda:
        if args.goal:
            parser.error(f"--goal: the goal is judged on a CUDA run (bf16, M = {GOAL['M']}); "
                         "this one would run on the CPU (normbook-bench cpu --goal judges the "
                         "CPU backend)")
        notes.append("no GPU: CPU mode (small shapes, perf_counter timer; fp32 unless "
                     "--dtypes or --dry-run asks for more). "
                     "The numbers are not the performance goal's; that needs a CUDA device.")
    if cuda:
        M, Ds, extra = 32768, _pow2_range(512, 131072), [(1 << 20, 128)]
        dtypes, modes, provs = list(bytemodel.DTYPES), list(bytemodel.MODES), list(GPU_PROVIDERS)
        warmup, rep = 25.0, 100.0
        if args.quick:
            Ds, dtypes, modes = [1024, 4096, 16384, 65536], ["bf16"], ["fwd", "bwd"]
            provs = ["normbook", "torch", "liger", "quack"]
    else:
        M, Ds, extra = 4096, _pow2_range(256, 4096), [(32768, 128)]
        dtypes, modes, provs = ["fp32"], list(bytemodel.MODES), list(CPU_PROVIDERS)
        warmup, rep = 5.0, 40.0
        if args.quick:
            # two small sizes, fwd and bwd (fwd_bwd is their sum): under a minute on 2 busy cores
            M, Ds, extra, warmup, rep = 512, [256, 1024], [], 2.0, 10.0
            modes = ["fwd", "bwd"]
        if args.compile:
            provs.append("compile")
        if args.dry_run:
            M, Ds, extra, warmup, rep = 64, [256, 1024], [], 1.0, 3.0
            dtypes, modes = ["bf16", "fp32"], ["fwd", "bwd"]
            provs = ["normbook", "torch", "compile", "naive", "liger"]
    if args.M is not None or args.D is not None:
        extra = []
    M = args.M if args.M is not None else M
    Ds = _sizes(parser, "--D", args.D) if args.D is not None else Ds
    ops = _names(parser, "--ops", args.ops, bytemodel.OPS) if args.ops else list(bytemodel.OPS)
    if args.modes:
        modes = _names(parser, "--modes", args.modes, bytemodel.MODES)
    if args.dtypes:
        dtypes = _names(parser, "--dtypes", args.dtypes, bytemodel.DTYPES)
    asked = {"compile"} if args.compile else set()
    if args.providers:
        provs = _names(parser, "--providers", args.providers, list(providers.PROVIDERS))
        asked |= set(provs)
    notes += _check_providers(provs, asked, device, args.skip_unavailable)
    return runner.Config(
        ops=ops, modes=modes, dtypes=dtypes, providers=provs,
        shapes=[(M, D) for D in Ds] + extra, device=device,
        warmup_ms=args.warmup_ms or warmup, rep_ms=args.rep_ms or rep,
        threads=args.threads or (1 if args.quick and not cuda else None),
        time_budget_s=args.time_budget, out=args.out, timer=args.timer, plots=not args.no_plots,
        progress=not args.no_progress, notes=notes)


class BenchError(Exception):
    """A refusal of the command line: printed as one line, exit status 2."""


def _check_providers(provs, asked, device, skip_unavailable) -> list[str]:
    """Refuse, before anything is measured, a provider asked for by name that cannot run here
    (unless --skip-unavailable); the others that cannot run are recorded as skipped. Notes."""
    notes, why = [], {p: providers.unavailable(p, device) for p in provs}
    refused = [p for p in provs if why[p] and p in asked and not skip_unavailable]
    if refused:
        raise BenchError("--providers: " + "; ".join(f"{p} cannot run here: {why[p]}" for p in refused)
                         + " (drop it, or pass --skip-unavailable to record it as not measured)")
    if all(why.values()):
        raise BenchError("--providers: none can run here: "
                         + "; ".join(f"{p}: {why[p]}" for p in provs))
    return [f"provider {p} not measured (recorded as skipped): {why[p]}" for p in provs if why[p]]


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def error(where: str, e: BaseException | str) -> int:
    """A refusal as one line on stderr, ``normbook-bench: error: WHERE: ...``; exit status 2.
    A reader of the output that stopped reading (``| head``) is no refusal: raised again, for
    :func:`main` to end quietly."""
    if isinstance(e, BrokenPipeError):
        raise e
    text = e if isinstance(e, str) else _one_line(e)
    print(f"{PROG}: error: {where + ': ' if where else ''}{text}", file=sys.stderr)
    return 2


def writable_file(flag: str, path: str | None) -> None:
    """Refuse, before anything is measured, an output file that could not be written."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise BenchError(f"{flag}: {path} is a folder; give a file name")
    folder = target.parent
    if not folder.is_dir():
        raise BenchError(f"{flag}: no folder {folder} to write {target.name} into")
    if not os.access(folder, os.W_OK):
        raise BenchError(f"{flag}: cannot write into {folder}")
    # what the folder's permissions do not tell (a read-only file, a file system that takes
    # no new file, as /proc): open it for writing as the end will, without changing it
    try:
        if target.exists():
            with open(target, "ab"):
                pass
        else:
            with open(target, "xb"):
                pass
            target.unlink()
    except OSError as e:
        raise BenchError(f"{flag}: cannot write {path} ({e.strerror or e})") from None


def add_json_out(p: argparse.ArgumentParser, what: str) -> None:
    """A mode's ``--json FILE`` (writing ``what``) and ``--force``, checked by
    :func:`json_out`."""
    p.add_argument("--json", metavar="FILE", help=f"write {what} as JSON; a file that exists "
                   "is refused unless --force")
    p.add_argument("--force", action="store_true",
                   help="replace the --json file if it exists (without it the run is refused "
                   "before anything is measured: a GPU's results cannot be measured again)")


def json_out(args) -> None:
    """A mode's --json, refused before anything is measured where it could not be written, or
    where it exists and --force is not given."""
    writable_file("--json", args.json)
    new_file("--json", args.json, args.force)


def new_file(flag: str, path, force: bool = False, instead: str = "another file") -> None:
    """Refuse, before anything is read or measured, to replace the file ``path`` unless
    ``force`` (--force): recorded results cannot be measured again. One line naming the file,
    --force, and ``instead``. A folder is left to the caller's own checks; a link counts as a
    file, whether or not its target exists."""
    if path is None or force:
        return
    target = Path(path)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise BenchError(f"{flag}: {path} exists; pass --force to replace it, or give {instead}")


def _refuse_replacing(args, flag: str | None) -> None:
    """The outputs of this command line that exist, refused unless --force (see the module
    docstring): a run's results.json, the --out file of --merge, --overview, --model-check."""
    if flag is None and args.out is not None:
        new_file("--out", Path(args.out) / runner.RESULTS_FILE, args.force, "another folder")
    elif flag in ("--merge", "--overview", "--model-check"):
        new_file("--out", args.out, args.force)


RECORDED = "recorded"   # a source naming the GPU runs normbook carries (checkout or wheel)


def _results_folder():
    from normbook.bench.plot import results_folder

    return results_folder()


def _resolve_recorded(args) -> None:
    """The source ``recorded`` (where no such file or folder exists; also ``recorded/<path>``,
    in the sources and in --report) as the folder of the GPU runs normbook carries: the checkout's benchmarks/results, or in an installed wheel its
    copy, normbook/bench/recorded (:func:`normbook.bench.plot.results_folder`). Outside a
    clone, ``benchmarks/results/...`` does not exist, and nothing said where the copy was."""
    from normbook.bench.plot import results_folder

    def resolve(source):
        head, _, rest = source.partition("/")
        if head != RECORDED or Path(source).exists():
            return source
        return str(results_folder() / rest) if rest else str(results_folder())

    for key in ("overview", "model_check", "merge", "plot", "summary"):
        sources = getattr(args, key)
        if sources:
            setattr(args, key, [resolve(s) for s in sources])
    if args.report:        # recorded/2026-12-04-h200/report.json: a wheel's carried report
        args.report = resolve(args.report)


# expected failures of a command: one line, not a traceback (ResultsError is a ValueError)
EXPECTED = (BenchError, ValueError, OSError, ImportError)


def main(argv=None) -> int:
    """The command line; returns the exit status: 0; 1 for a goal not met (only with --goal);
    2 for a refusal (one line on stderr); 130 when interrupted. Output piped to a reader that
    stops (``normbook-bench --summary R | head -1``) ends it quietly, with status 1 (Python's
    advice for SIGPIPE): no error line about a broken pipe."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # what is still buffered for stdout goes nowhere, so that the interpreter's exit does
        # not fail on it again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["host"], ["cpu"], ["plans"], ["shapes"], ["step"]):
        mode = importlib.import_module(f"normbook.bench.{argv[0]}")
        try:
            return mode.main(argv[1:])
        except (BenchError, ImportError, OSError) as e:
            return error(argv[0], e)
        except KeyboardInterrupt:
            error(argv[0], "interrupted")
            return 130
    parser = build_parser()
    args = parser.parse_args(argv)
    flag = next((f"--{k.replace('_', '-')}" for k in ("overview", "model_check", "merge", "plot",
                                                       "summary") if getattr(args, k)), None)
    _resolve_recorded(args)
    if args.goal and flag is not None and not args.summary:
        parser.error("--goal: judges a run or --summary, not " + flag)
    try:
        _refuse_replacing(args, flag)     # before anything is read or measured
        if flag is not None:
            return _recorded(args, parser, flag)
        cfg = config_from_args(args, parser)
    except FileNotFoundError as e:
        if flag is None or str(_results_folder()) in str(e):   # 'recorded' was what was given
            return error(flag or "", e)
        return error(flag, f"{_one_line(e)} (the GPU runs normbook carries: give "
                           f"'{RECORDED}')")
    except EXPECTED as e:
        return error(flag if flag and not isinstance(e, BenchError) else "", e)
    try:   # a bad --out fails here, not after the sweep
        out = Path(cfg.out) if cfg.out else runner.default_out_dir(cfg.device)
        if out.exists() and not out.is_dir():
            raise BenchError(f"{out} is a file; a run writes into a folder (its results.json "
                             "and figures): give a folder's name")
        out.mkdir(parents=True, exist_ok=True)
        cfg.out = str(out.resolve())
    except (OSError, BenchError) as e:
        return error("--out", e)
    try:
        result = runner.run(cfg)
    except KeyboardInterrupt:
        error("", f"interrupted; the rows measured so far are in {cfg.out}/results.json")
        return 130
    except OSError as e:
        return error("", e)
    print(runner.summary(result))
    return _goal([result]) if args.goal else 0


def _recorded(args, parser, flag) -> int:
    """The modes that read recorded JSON instead of measuring: --overview, --model-check,
    --merge, --summary, --plot. Bad content raises ResultsError (a ValueError), a missing file
    FileNotFoundError; main prints either as one line."""
    from normbook.bench.plot import (load_results, model_table, model_vs_measured, plot_overview,
                                     plot_model_vs_measured, plot_results)

    need_out = {"--overview": "FILE.png", "--model-check": "FILE.png", "--merge": "FILE for the "
                "merged JSON", "--plot": "DIR for the figures"}
    if flag in need_out and not args.out:
        parser.error(f"{flag}: also give --out {need_out[flag]}")
    if flag == "--summary" and args.out and not args.plot:
        # (it printed the summary and ignored the folder it was given)
        parser.error("--summary: prints to stdout and writes no file; --out goes with --plot, "
                     "--merge, --overview or --model-check")
    if args.plot and args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise BenchError(f"--out: {args.out} is a file; --plot writes its figures into a "
                         "folder: give a folder's name")
    if flag == "--model-check" and not args.report:
        parser.error("--model-check: also give --report REPORT.json and --out FILE.png")
    if flag == "--overview":
        print(plot_overview(args.overview, args.out))
    elif flag == "--model-check":
        rows = model_vs_measured(args.model_check, args.report)
        print(model_table(rows))
        print(plot_model_vs_measured(rows, args.out))
    elif flag == "--merge":
        merged = runner.merge(load_results(args.merge))
        runner.write_json(merged, args.out)
        n = len(merged["runs"])
        print(f"merged {n} run{'' if n == 1 else 's'}, {len(merged['rows'])} rows into {args.out}")
    else:  # --plot, --summary, or both
        if args.plot:
            print("\n".join(str(p) for p in plot_results(load_results(args.plot), args.out)))
        if args.summary:
            results = load_results(args.summary)
            for res in results:
                print(runner.summary(res))
            if args.goal:
                return _goal(results)
    return 0


def _goal(results) -> int:
    """Print the goal check of each run in ``results`` (:func:`normbook.bench.goal.runs`),
    oldest first; the exit status of --goal is the newest run's: 0 met, 1 not (the runs
    recorded before it stay as they were measured). A merged file of several runs is not
    judged: its rows cannot be told apart."""
    from normbook.bench.goal import check_goal, mixed, runs

    met = False
    for label, files in runs(results):
        print(f"\ngoal (bf16, M = 32768) of {label}: normbook vs copy bandwidth and rivals")
        if mixed(label):
            print("not judged: a merged file of runs of other devices, commits or code; "
                  "judge each run's own file")
            met = False
            continue
        lines, met = check_goal(files)
        print("\n".join(lines))
        print(f"goal: {'all PASS' if met else 'not met'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
