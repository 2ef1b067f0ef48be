"""What a results file holds, checked in one place before anything reads it.

A results file is what ``normbook.bench.runner.run`` writes (see benchmarks/README.md, "The
JSON"). :func:`load_results` reads files, folders and globs, and :func:`check_result` holds
each one against the declaration below: the keys a result and its rows must have, and the type
of each value. A file that does not fit raises :class:`ResultsError`, one line naming the file,
the place in it (``rows[3].ms``) and what was expected against what was found, so that the
command line can print it and exit 2 instead of failing somewhere deep in a plot.

Timings: a row's ``ms`` is a positive number; NaN or +inf is allowed and means *not
measured* (the goal check never counts such a row); 0 or a negative time is an error. A row
names the timer that made it (``timer``: ``cudagraph``, ``do_bench`` or ``perf_counter``, and
``timer_note`` where a graph could not be captured) and carries its same-size yardstick
(``copy_same_gbps``, ``frac_same_copy``; null where that copy failed). All of these are
optional, so results recorded before them (rows timed by do_bench, without a same-size copy)
still load and merge.

In a folder, the other files that a GPU run leaves beside its results are recognized and
skipped: the compile report (``report.json``, keys ``paths``), the host timings
(``host.json``, keys ``ratios`` and ``goal``), the plans' timings (``plans.json``, key
``one_program_rows``) and the training step's (``llama.json``, key ``goal_speedup``). Given by
name, they are an error.
"""

from __future__ import annotations

import glob
import json
import math
import reprlib
from pathlib import Path

from normbook.bench.bytemodel import DTYPES, MODES, OPS

__all__ = ["ResultsError", "check_result", "check_report", "load_results", "kind", "measured",
           "read_json"]


class ResultsError(ValueError):
    """A results file (or a compile report) that does not fit the declaration; one line."""


# ---- checks on one value: each returns None when it fits, else what was expected ----------
def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number(v):
    return None if _is_num(v) else "a number"


def _nonneg(v):  # GB/s and fractions: NaN where the time was not measured
    return None if _is_num(v) and not v < 0 else "a number >= 0 (or NaN)"


def _positive(v):
    return None if _is_num(v) and math.isfinite(v) and v > 0 else "a positive finite number"


def _timing(v):  # milliseconds: NaN or +inf is "not measured", never 0 or negative
    return None if _is_num(v) and (v > 0 or math.isnan(v)) else (
        "a positive number of milliseconds (NaN: not measured)")


def _size(v):  # below 2**53: exact as a float, which a plot's axis makes of it
    return None if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 53 else (
        "a positive integer below 2**53")


def _text(v):
    return None if isinstance(v, str) and v else "a non-empty string"


def _one_of(names):
    def check(v):
        return None if isinstance(v, str) and v in names else f"one of {', '.join(names)}"
    return check


def _optional(check):
    def opt(v):
        return None if v is None else (None if check(v) is None else f"{check(v)} or null")
    return opt


def _boolean(v):
    return None if isinstance(v, bool) else "true or false"


def _copy(v):  # {"gbps", "ms", "bytes", "method"}: the summary prints gbps
    if not isinstance(v, dict):
        return "an object with 'gbps'"
    return None if _positive(v.get("gbps")) is None else "an object whose 'gbps' is a positive number"


def _object(v):
    return None if isinstance(v, dict) else "an object"


# ---- the declaration: key -> check; required, then optional ---------------------------------
_KEYS = {"op": _one_of(OPS), "mode": _one_of(MODES), "provider": _text, "dtype": _one_of(DTYPES),
         "M": _size, "D": _size}
ROW = {**_KEYS, "ms": _timing, "gbps": _nonneg, "frac_copy": _nonneg}
# rows recorded before these (the H200's of 2026-12-04) have no timer (they were do_bench's on
# CUDA), copy_same_gbps or frac_same_copy
ROW_OPTIONAL = {"ms_q20": _number, "ms_q80": _number, "bytes": _size,
                "host_ms": _optional(_number), "host_bound": _optional(_boolean),
                "timer": _text, "timer_note": _text,
                "copy_same_gbps": _optional(_nonneg), "frac_same_copy": _optional(_nonneg),
                "run": _optional(lambda v: None if type(v) is int and v >= 0
                                 else "an index into runs")}
SKIP = {**_KEYS, "reason": _text}
PROVENANCE_OPTIONAL = {k: _optional(lambda v: None if isinstance(v, str) else "a string")
                       for k in ("device", "device_type", "commit", "date")}
PROVENANCE_OPTIONAL.update(dirty=_optional(_boolean), synthetic=_optional(_boolean))
# None: a list, whose items check_result holds against ROW, SKIP or "an object"
RESULT = {"provenance": _object, "copy_bandwidth_gbps": _positive, "rows": None}
RESULT_OPTIONAL = {"skipped": None, "copy": _copy, "copy_end": _copy, "config": _object,
                   "runs": None}
# the compile report, as far as --model-check reads it; reports made before the model's
# predictions went (the H200's of 2026-12-04) carry a predicted fraction per path
REPORT_PATH = {"arch": _text, "norm": _one_of(("layer", "rms")), "residual": _boolean,
               "direction": _one_of(("fwd", "bwd")), "dtype": _text, "D": _size}
REPORT_PATH_OPTIONAL = {"predicted_fraction": _nonneg}


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict, _REPR.maxlevel = 40, 40, 4, 4, 2


def _show(v) -> str:
    """A value, short, with its JSON type unless it is a number: ``string '4'``, ``null``."""
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    name = {str: "string", list: "list", dict: "object"}.get(type(v))
    return _REPR.repr(v) if name is None else f"{name} {_REPR.repr(v)}"


def _fit(obj, required: dict, optional: dict, where: str) -> None:
    if not isinstance(obj, dict):
        raise ResultsError(f"{where}: expected an object, got {_show(obj)}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise ResultsError(f"{where}: missing {', '.join(repr(k) for k in missing)}"
                           f" (has {', '.join(repr(k) for k in list(obj)[:8]) or 'no keys'})")
    for table in (required, optional):
        for key, check in table.items():
            if check is None or key not in obj:
                continue
            want = check(obj[key])
            if want is not None:
                raise ResultsError(f"{where}.{key}: expected {want}, got {_show(obj[key])}")


def _list_of(obj, key, required, where, optional=None) -> None:
    items = obj[key]
    if not isinstance(items, list):
        raise ResultsError(f"{where}{key}: expected a list, got {_show(items)}")
    for i, item in enumerate(items):
        _fit(item, required, optional or {}, f"{where}{key}[{i}]")


def check_result(data, where: str = "result") -> dict:
    """``data`` if it is a benchmark result, else :class:`ResultsError` naming ``where``."""
    kind_ = kind(data)
    if kind_ != "result":
        hint = {"compile report": "give it to --model-check --report",
                "host timings": "what `python -m normbook.bench host --json` writes",
                "plans timings": "what `python -m normbook.bench plans --json` writes",
                "training step": "what `python -m normbook.bench step --json` writes"}
        raise ResultsError(f"{where}: {'a ' if kind_ in hint else ''}{kind_}, not a "
                           f"normbook.bench result ("
                           f"{hint.get(kind_, 'expected an object with provenance and rows')})")
    try:
        _fit(data, RESULT, RESULT_OPTIONAL, "")
        _fit(data["provenance"], {}, PROVENANCE_OPTIONAL, "provenance")
        _list_of(data, "rows", ROW, "", ROW_OPTIONAL)
        if "skipped" in data:
            _list_of(data, "skipped", SKIP, "")
        if "runs" in data:
            _list_of(data, "runs", {}, "")
    except ResultsError as e:
        raise ResultsError(f"{where}: {str(e).lstrip(':. ')}") from None
    return data


def check_report(data, where: str = "report") -> dict:
    """``data`` if it is a compile report as --model-check reads it, else :class:`ResultsError`."""
    if kind(data) != "compile report":
        raise ResultsError(f"{where}: not a compile report (expected an object with 'paths'; "
                           f"got {_show(data)})")
    if not isinstance(data["paths"], list):
        raise ResultsError(f"{where}: paths: expected a list, got {_show(data['paths'])}")
    if "m" in data and _size(data["m"]) is not None:
        raise ResultsError(f"{where}: m: expected a positive integer below 2**53, got {_show(data['m'])}")
    for i, p in enumerate(data["paths"]):
        if isinstance(p, dict) and "error" in p:  # a path that failed to compile: not joined
            continue
        _fit(p, REPORT_PATH, REPORT_PATH_OPTIONAL, f"{where}: paths[{i}]")
    return data


def kind(data) -> str:
    """What a parsed JSON file is: "result", "compile report", "host timings" or a description."""
    if isinstance(data, dict):
        if "paths" in data:            # first: a compile report has "rows" (its kernels) too
            return "compile report"
        if "one_program_rows" in data:   # normbook-bench plans --json: "rows" of plans' timings
            return "plans timings"
        if "goal_speedup" in data:       # normbook-bench step --json: "rows" of training steps
            return "training step"
        if "rows" in data or "provenance" in data:
            return "result"
        if "ratios" in data and "goal" in data:
            return "host timings"
        return "an object with keys " + (", ".join(repr(k) for k in list(data)[:8]) or "none")
    return f"a JSON {_show(data)}" if isinstance(data, (str, list, type(None), bool)) else (
        f"a JSON number {_show(data)}")


def measured(row: dict) -> str | None:
    """None if the row holds a usable timing, else why not (the goal check's "not measured")."""
    ms, frac = row.get("ms"), row.get("frac_copy")
    if not (_is_num(ms) and math.isfinite(ms) and ms > 0):
        return f"recorded ms = {ms!r}, not a timing"
    if not (_is_num(frac) and math.isfinite(frac) and frac >= 0):
        return f"recorded frac_copy = {frac!r}, not a fraction"
    return None


def read_json(path) -> object:
    """The parsed content of ``path``, or :class:`ResultsError` in one line naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ResultsError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not JSON ({e})") from None
    except RecursionError:
        raise ResultsError(f"{path}: not JSON this reader can parse (nested too deeply)") from None


# what a GPU check leaves beside its results.json (report.json, host.json, plans.json,
# llama.json): skipped in a folder, refused by name
_BESIDE = ("compile report", "host timings", "plans timings", "training step")


def load_results(sources) -> list[dict]:
    """Results from JSON files, folders (every ``*.json`` below them), glob patterns or dicts.

    Each is checked by :func:`normbook.bench.schema.check_result`. In a folder, compile reports
    and host timings (the other files a GPU run leaves) are skipped; a folder with no result is
    an error, as is a file given by name that is not a result. The other files a GPU check
    leaves (the plans' and the training step's timings) are skipped too. Raises
    :class:`normbook.bench.schema.ResultsError` (a ValueError) or FileNotFoundError, each one
    line that names the file.
    """
    if isinstance(sources, (str, Path, dict)):
        sources = [sources]
    out = []
    for n, src in enumerate(sources):
        if isinstance(src, dict):
            out.append(check_result(src, f"result #{n}"))
            continue
        p = Path(src)
        if p.is_dir():
            found = []
            for f in sorted(p.rglob("*.json")):
                data = read_json(f)
                if kind(data) in _BESIDE:
                    continue
                found.append(check_result(data, str(f)))
            if not found:
                raise FileNotFoundError(f"sources: no normbook.bench results in folder {str(src)!r}")
            out += found
            continue
        files = [p] if p.exists() else [Path(f) for f in sorted(glob.glob(str(src), recursive=True))]
        if not files:
            raise FileNotFoundError(f"sources: no JSON results at {str(src)!r}")
        out += [check_result(read_json(f), str(f)) for f in files if not f.is_dir()]
    return out
