"""The sweep: every (op, dtype, shape, provider, mode) of a :class:`Config`, timed, as JSON.

Output (``results.json`` in the output folder, rewritten after every shape so that a run cut
short still leaves its rows)::

    {"provenance": {"device", "device_type", "torch", "triton", "normbook", "commit",
                    "commit_from", "dirty", "date", "python", "platform", "cuda",
                    "cpu_threads", "timer", "argv"},
     "copy_bandwidth_gbps": float,
     "copy": {"gbps", "ms", "bytes", "method"},
     "config": {...},
     "byte_model": str,
     "rows": [{"op", "mode", "provider", "dtype", "M", "D", "ms", "ms_q20", "ms_q80",
               "timer", ["timer_note"], "bytes", "gbps", "frac_copy", "copy_same_gbps",
               "frac_same_copy", "host_ms", "host_bound"}, ...],
     "skipped": [{"op", "mode", "provider", "dtype", "M", "D", "reason"}, ...]}

GB/s = bytes (from :mod:`normbook.bench.bytemodel`) / median time; frac_copy = GB/s over
the big copy's bandwidth (1 GiB per tensor, the faster of the run's start and end);
frac_same_copy = GB/s over copy_same_gbps, a copy of the row's own bytes (within 1/128) timed
by the same timer: a copy of 134 MB, a D = 1024 problem's size, runs slower than the big one
(on the H200, by that session's notes, not its recorded results). ms is device time (the row's ``timer``: :mod:`normbook.bench.timing`), host_ms
the host's time per call beside it; host_bound says the host's is the longer.
"""

from __future__ import annotations

import datetime as _dt
import gc
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from normbook.bench import bytemodel, providers, timing
from normbook.bench.goal import HOST_SHARE_DO_BENCH, host_set

__all__ = ["Config", "run", "provenance", "device_name", "default_out_dir", "summary", "merge",
           "write_json"]


@dataclass
class Config:
    """What to run. shapes: list of (M, D); ops, modes, dtypes, providers: names."""

    ops: list[str]
    modes: list[str]
    dtypes: list[str]
    providers: list[str]
    shapes: list[tuple[int, int]]
    device: str = "cuda"
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    time_budget_s: float | None = None
    threads: int | None = None  # CPU: torch.set_num_threads
    out: str | None = None
    timer: str | None = None    # CUDA: cudagraph (None: the device's default) or do_bench
    plots: bool = True
    progress: bool = True
    notes: list[str] = field(default_factory=list)


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)  # no import: triton stays unloaded
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git(*args: str) -> str | None:
    """git in the checkout this module was imported from; None where it was not imported from
    one (an installed wheel: ``parents[3]`` is then the venv's lib folder, inside whatever
    repository holds the venv, whose HEAD a run recorded as normbook's commit)."""
    root = Path(__file__).resolve().parents[3]  # src/normbook/bench/runner.py -> repo root
    if not (root / "src" / "normbook" / "bench" / "runner.py").is_file() or not (
            root / "pyproject.toml").is_file():
        return None
    try:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                           timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def provenance(device, timer: str | None = None) -> dict:
    """Where and with what the numbers were measured: device, versions, commit, date, timer."""
    import normbook

    device = torch.device(device)
    timer = timer or timing.default_timer(device)
    # NORMBOOK_COMMIT: the commit the run's tree was copied from, where the checkout it runs in
    # is not it (the GPU machine commits its copy of the tree: its HEAD names no commit of
    # this repository; benchmarks/results/README.md)
    given = os.environ.get("NORMBOOK_COMMIT", "").strip()
    commit = given or _git("rev-parse", "HEAD") or "unknown"
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "normbook": normbook.__version__,
        "commit": commit,
        "commit_from": "NORMBOOK_COMMIT" if given else "git",
        "dirty": None if status is None else bool(status),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "cpu_threads": torch.get_num_threads(),
        "timer": timing.DESCRIBE.get(timer, timer),
        "argv": " ".join(sys.argv),
    }


def default_out_dir(device) -> Path:
    """A new folder ``normbook-bench-<date>-<device>-XXXX`` under the system's temp folder
    (created, absolute): never a folder inside the caller's working folder, never a previous
    run's (why: :mod:`normbook.bench.cli`). ``run`` prints it on its first line."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device_name(device)).strip("-").lower()[:40]
    return Path(tempfile.mkdtemp(prefix=f"normbook-bench-{_dt.date.today().isoformat()}-{slug}-"))


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _fits(op: str, M: int, D: int, dtype: str, device: torch.device) -> bool:
    """A rough check before allocating: inputs plus a few outputs' worth of headroom."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    act = M * D * bytemodel.itemsize(dtype)
    return (8 if op.startswith("add_") else 6) * act < free


# torch.OutOfMemoryError is new in torch 2.5; older ones have only torch.cuda's
OutOfMemoryError = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, OutOfMemoryError) or "out of memory" in str(e).lower()


class _NoBar:
    """Stands in for tqdm where it is not installed."""

    def __init__(self, *args, **kwargs):
        pass

    def update(self, n=1):
        pass

    def set_postfix_str(self, *args, **kwargs):
        pass

    def close(self):
        pass

    write = staticmethod(print)


def _progress_bar(total: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if enabled:
            print("normbook.bench: tqdm not installed, no progress bar")
        return _NoBar()
    return tqdm(total=total, disable=not enabled, unit="row", dynamic_ncols=True)


def _reason(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


RESULTS_FILE = "results.json"   # a run's rows in its folder (the command line refuses to
                                # replace one without --force)


def _write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{RESULTS_FILE}.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out / RESULTS_FILE)


def run(cfg: Config) -> dict:
    """Run the sweep of ``cfg``; write ``results.json`` (and plots) into ``cfg.out`` (None: a
    new temp folder, :func:`default_out_dir`); return it."""
    device = torch.device(cfg.device)
    out = Path(cfg.out) if cfg.out else default_out_dir(device)
    if cfg.threads and device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    say = print
    say(f"normbook.bench: writing results to {out.resolve()}")   # first: where to look
    say(f"normbook.bench: device {device_name(device)} ({device.type})")
    for note in cfg.notes:
        say(f"normbook.bench: {note}")
    timer = cfg.timer or timing.default_timer(device)
    # an idle GPU runs at a low clock: a second of copies first, so the baseline is not low
    warm = 1000.0 if device.type == "cuda" else cfg.warmup_ms
    copy = timing.copy_bandwidth(device, warmup_ms=warm, rep_ms=cfg.rep_ms, timer=timer)
    say(f"normbook.bench: copy bandwidth {copy['gbps']:.1f} GB/s ({copy['method']})")
    result = {
        "provenance": provenance(device, timer),
        "copy_bandwidth_gbps": copy["gbps"],
        "copy": copy,
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("progress", "plots")},
        "byte_model": (bytemodel.__doc__ or "").strip().split("\n\n")[0],
        "rows": [],
        "skipped": [],
    }

    total = len(cfg.ops) * len(cfg.dtypes) * len(cfg.shapes) * len(cfg.providers) * len(cfg.modes)
    bar = _progress_bar(total, cfg.progress)
    log = bar.write if cfg.progress else print
    t_start = time.monotonic()
    reported: set[tuple[str, str]] = set()
    same_gbps: dict[int, float | None] = {}   # copy of the same size: fp32 elements -> GB/s

    def same_copy(nbytes: int) -> float | None:
        """GB/s of a copy moving ``nbytes`` (within 1/128), measured once per size."""
        numel = timing.same_size_numel(nbytes)
        if numel not in same_gbps:
            try:
                same_gbps[numel] = timing.copy_bandwidth(device, 4 * numel, cfg.warmup_ms,
                                                         cfg.rep_ms, timer)["gbps"]
            except Exception as e:   # a row without its yardstick, said once; never a lost run
                same_gbps[numel] = None
                log(f"same-size copy of {8 * numel} bytes not measured: {_reason(e)}")
            _free(device)
        return same_gbps[numel]

    def skip(key, reason):
        op, dtype, M, D, prov, mode = key
        result["skipped"].append(dict(op=op, mode=mode, provider=prov, dtype=dtype, M=M, D=D,
                                      reason=reason))
        short = (prov, reason)
        if short not in reported:  # say each distinct reason once
            reported.add(short)
            log(f"skip {prov} {op} {mode} {dtype} M={M} D={D}: {reason}")

    # shapes outermost, in the order given: a run cut short by its time budget still covers
    # every op at the shapes it reached (order --D to spread them: 1024,32768,131072,4096,...)
    def spent():
        if cfg.time_budget_s is not None and time.monotonic() - t_start > cfg.time_budget_s:
            return f"time budget of {cfg.time_budget_s:g} s spent"
        return None

    # Each row ends with a collection (_free), so that cycles holding tensors go before the next
    # row's inputs are made. Everything alive now (torch, sympy, the caller's objects) is moved
    # out of the collector's view first: a full collection of a process that has imported torch
    # took 0.15 s here (28 of them, 4 of a small run's 5 seconds); one of only what the rows
    # made takes milliseconds.
    gc.freeze()
    try:
        for M, D in cfg.shapes:
            for op in cfg.ops:
                for dtype in cfg.dtypes:
                    keys = [(op, dtype, M, D, p, m) for p in cfg.providers for m in cfg.modes]
                    inp, why = None, spent()
                    if why is None:
                        if "compile" in cfg.providers:   # a fresh static compile per shape:
                            torch._dynamo.reset()          # no recompile limit
                        try:
                            if not _fits(op, M, D, dtype, device):
                                raise OutOfMemoryError("inputs would not fit in free memory")
                            inp = providers.make_inputs(op, M, D, dtype, device)
                        except Exception as e:
                            why = ("OOM: " if _is_oom(e) else "error: ") + _reason(e)
                    if inp is None:
                        for key in keys:
                            skip(key, why)
                        bar.update(len(keys))
                        _free(device)
                        continue
                    first = len(result["rows"])
                    for key in keys:
                        bar.set_postfix_str(f"{op} {key[5]} {dtype} D={D} {key[4]}", refresh=False)
                        bar.update()
                        why = spent()
                        if why is not None:
                            skip(key, why)
                            continue
                        row = _one(key, inp, copy["gbps"], device, cfg, skip, timer)
                        if row is not None:
                            result["rows"].append(row)
                        _free(device)
                    del inp
                    _free(device)
                    for row in result["rows"][first:]:   # the inputs freed: room for the copy
                        row.update(same_size_fields(row["gbps"], same_copy(row["bytes"])))
                    _write(result, out)
    finally:
        gc.unfreeze()
    bar.close()
    # the copy again at the end: the fractions use the faster of the two (the stricter yardstick)
    end = timing.copy_bandwidth(device, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms, timer=timer)
    result["copy_end"] = end
    result["copy_bandwidth_gbps"] = best = max(copy["gbps"], end["gbps"])
    for row in result["rows"]:
        row["frac_copy"] = row["gbps"] / best
    say(f"normbook.bench: copy bandwidth at the end {end['gbps']:.1f} GB/s; fractions use {best:.1f}")
    _write(result, out)
    say(f"normbook.bench: {len(result['rows'])} rows, {len(result['skipped'])} skipped, "
        f"{time.monotonic() - t_start:.0f} s; JSON: {out / 'results.json'}")
    if cfg.plots and result["rows"]:
        from normbook.bench.plot import plot_results

        try:
            paths = plot_results([result], out)
            say(f"normbook.bench: {len(paths)} plots in {out}")
        except ImportError as e:
            say(f"normbook.bench: no plots ({e}); the JSON is intact")
        except Exception as e:  # a plotting problem must not lose the measurements
            say(f"normbook.bench: plotting failed ({_reason(e)}); the JSON is intact")
    return result


def same_size_fields(gbps: float, same_gbps: float | None) -> dict:
    """A row's same-size yardstick: the GB/s of a copy of its bytes and its fraction of that."""
    frac = None if not same_gbps else gbps / same_gbps
    return {"copy_same_gbps": same_gbps, "frac_same_copy": frac}


def _one(key, inp, copy_gbps, device, cfg, skip, timer=None):
    """Time one row; on any failure (OOM included) record a skip and return None."""
    op, dtype, M, D, prov, mode = key
    try:
        fn = providers.get(prov, op, mode, device)
        # on the side stream from the closure on: a bwd closure's forward runs here, and its
        # backward ops run where it ran, so a graph can capture them (timing's docstring)
        with timing.side_stream(device):
            call = timing.closure(fn, inp, mode)
            call()  # first call outside the timer (and any graph): compiles, autotunes, plans
            timing.synchronize(device)
            t = timing.timed(call, device, cfg.warmup_ms, cfg.rep_ms, timer or cfg.timer)
            host = timing.host_ms(call, device)
    except providers.Unsupported as e:
        skip(key, str(e))
        return None
    except Exception as e:
        skip(key, ("OOM: " if _is_oom(e) else "error: ") + _reason(e))
        return None
    finally:
        call = fn = None
    ms = t.ms
    if not (ms > 0 and math.isfinite(ms)):  # a timer's 0 or NaN is no measurement: never a row
        skip(key, f"error: the timer returned {ms} ms")
        return None
    nbytes = bytemodel.bytes_moved(op, mode, M, D, dtype)
    gbps = nbytes / (ms * 1e-3) / 1e9
    row = dict(op=op, mode=mode, provider=prov, dtype=dtype, M=M, D=D, ms=ms, ms_q20=t.q20,
               ms_q80=t.q80, timer=t.timer, bytes=nbytes, gbps=gbps, frac_copy=gbps / copy_gbps,
               host_ms=host, host_bound=timing.host_bound(host, ms))
    if t.note:
        row["timer_note"] = t.note
    return row


def merge(results: list[dict]) -> dict:
    """Several runs as one result: every row and skip, each run's provenance and copy bandwidth.

    Rows keep the frac_copy of their own run, and ``run``, the index of their run in ``runs``;
    ``copy_bandwidth_gbps`` is the fastest of the runs (informative only). The first run's
    provenance heads the file; ``runs`` lists them all, a merged file's own runs each (its
    rows' ``run`` moved along; rows merged before ``run`` was recorded get none). A run given
    twice (the same file twice, or a folder and a file in it) is merged once.
    """
    if not results:
        raise ValueError("nothing to merge")
    seen: set = set()
    unique = []
    for r in results:
        key = json.dumps(r, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            unique.append(r)
    results = unique
    runs: list = []
    index: dict = {}        # a run (as JSON) -> its place in runs
    rows: list = []
    for r in results:
        inner = r.get("runs") or [{k: r.get(k) for k in ("provenance", "copy", "copy_end",
                                                          "config")}]
        places, new = [], set()
        for run in inner:
            key = json.dumps(run, sort_keys=True, default=str)
            if key not in index:
                index[key] = len(runs)
                runs.append(run)
                new.add(index[key])
            places.append(index[key])
        for row in r["rows"]:
            old = row.get("run") if "runs" in r else 0
            place = places[old] if type(old) is int and old < len(places) else None
            if place is not None and place not in new:
                continue                        # a run merged already, with its rows
            row = {k: v for k, v in row.items() if k != "run"}
            if place is not None:
                row["run"] = place
            rows.append(row)
    return {
        "provenance": results[0]["provenance"],
        "copy_bandwidth_gbps": max(r["copy_bandwidth_gbps"] for r in results),
        "copy": results[0].get("copy", {"gbps": results[0]["copy_bandwidth_gbps"]}),
        "runs": runs,
        "byte_model": results[0].get("byte_model", ""),
        "rows": rows,
        "skipped": [s for r in results for s in r.get("skipped", [])],
    }


def write_json(result: dict, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bandwidth_cell(r: dict | None) -> str:
    """GB/s, then (fraction of the big copy, of a same-size copy): ``2027.3*(0.48, 0.56)``."""
    if r is None:
        return f"{'-':>22}"
    same = r.get("frac_same_copy")
    fracs = f"{r['frac_copy']:.2f}" + (f", {same:.2f}" if _num(same) else "")
    flag = "*" if r.get("host_bound") or host_set(r) else " "
    return f"{r['gbps']:>8.1f}{flag}({fracs})".ljust(22)


def _time_cell(r: dict | None) -> str:
    """Device time | host time per call, in us: ``66.3 |   84.4*``."""
    if r is None:
        return f"{'-':>22}"
    host = r.get("host_ms")
    flag = "*" if r.get("host_bound") or host_set(r) else " "
    host = f"{host * 1e3:>8.1f}{flag}" if _num(host) else f"{'-':>8} "
    return f"{r['ms'] * 1e3:>11.1f} |{host}"


def summary(result: dict) -> str:
    """A text table per (op, dtype, mode), providers by D: each cell GB/s (fraction of the big
    copy, of a same-size copy); under it, device and host time per call in us."""
    rows = result["rows"]
    runs = result.get("runs") or []
    if len(runs) > 1:      # a merged file: each run's yardstick and timer, as its rows use them
        lines = [f"{len(runs)} runs merged; each row's fractions are of its own run's copy:"]
        for i, run in enumerate(runs):
            prov = run.get("provenance") or {}
            copies = [f"{k} {g:.1f}" for k, key in (("start", "copy"), ("end", "copy_end"))
                      if _num(g := (run.get(key) or {}).get("gbps"))]
            lines.append(f"  run {i}: {prov.get('device', '?')}, {prov.get('date', '?')}, "
                         f"timer {prov.get('timer') or 'not recorded'}; copy bandwidth "
                         + (f"{max(float(c.split()[1]) for c in copies):.1f} GB/s "
                            f"({', '.join(copies)})" if copies else "not recorded"))
    else:
        both = [f"{k} {result[key]['gbps']:.1f}"
                for k, key in (("start", "copy"), ("end", "copy_end")) if key in result]
        timer = result.get("provenance", {}).get("timer")
        lines = [f"copy bandwidth: {result['copy_bandwidth_gbps']:.1f} GB/s"
                 + (f" ({', '.join(both)}; the faster is the yardstick)" if both else ""),
                 f"timer: {timer if isinstance(timer, str) else 'not recorded'}"]
    lines += [
             "(a, b): fraction of that copy, and of a copy of the row's own bytes "
             "(a same-size copy; none in older runs)",
             "* : host time per call exceeds the device time (an eager loop would wait on the "
             f"host, not the kernel), or is at least {HOST_SHARE_DO_BENCH} of a do_bench time "
             "(do_bench then times the host)"]
    # a provider measured by several runs at one (D, M): a column per run ("normbook run 1"),
    # where one column kept the last run's cell and dropped the others
    taken: dict = {}
    for r in rows:
        taken.setdefault((r["op"], r["dtype"], r["mode"], r["provider"], r["D"], r["M"]),
                         set()).add(r.get("run"))
    clash = {k[:4] for k, v in taken.items() if len(v) > 1}
    rows = [dict(r, provider=f"{r['provider']} run {r.get('run', '?')}")
            if (r["op"], r["dtype"], r["mode"], r["provider"]) in clash else r for r in rows]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["op"], r["dtype"], r["mode"]), []).append(r)
    for (op, dtype, mode), rs in groups.items():
        shapes = sorted({(r["D"], r["M"]) for r in rs})
        provs = list(dict.fromkeys(r["provider"] for r in rs))
        cell = {(r["provider"], r["D"], r["M"]): r for r in rs}
        one_m = len({m for _, m in shapes}) == 1
        for title, show in (("GB/s (fraction of copy, of a same-size copy)", _bandwidth_cell),
                            ("device | host time per call, us", _time_cell)):
            lines.append(f"\n{op} {mode} {dtype}   {title}")
            lines.append(f"{'D':>10} " + "".join(f"{p:>22}" for p in provs))
            for D, M in shapes:
                tag = f"{D}" + ("" if one_m else f"/M={M}")
                cells = "".join(show(cell.get((p, D, M))) for p in provs)
                lines.append(f"{tag:>10} {cells}".rstrip())
        for r in rs:   # rows a graph could not hold: timed by do_bench, and why
            if r.get("timer_note"):
                lines.append(f"  {r['provider']} D={r['D']} timed by {r.get('timer')}: "
                             f"{r['timer_note']}")
    return "\n".join(lines)
