"""Figures from recorded benchmark JSON: GB/s and fraction of copy bandwidth against D.

One figure per (op, dtype): the top row is GB/s, the bottom row the fraction of the copy
bandwidth measured in the same run, one column per mode, one line per provider. Only
matplotlib (Agg) and json are needed: no GPU, no triton. The book's kernels chapter calls
:func:`plot_results` on ``benchmarks/results`` and :func:`provenance_line` for captions.
"""

from __future__ import annotations

import re
from pathlib import Path

from normbook.bench.schema import ResultsError, check_report, load_results, read_json

__all__ = ["load_results", "plot_results", "plot_overview", "provenance_line", "recorded_rows",
           "model_vs_measured", "model_table", "plot_model_vs_measured", "figure_path",
           "recorded_gpu_results", "newest_gpu_result", "results_folder"]

_MODE_TITLE = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}
# benchmark op -> (norm, residual) of the compile report's paths
_OP_PATH = {"layer_norm": ("layer", False), "rms_norm": ("rms", False),
            "add_layer_norm": ("layer", True), "add_rms_norm": ("rms", True)}
_STYLE = {"normbook": ("C3", "o"), "torch": ("C0", "s"), "compile": ("C2", "^"),
          "naive": ("C7", "x"), "reference": ("C5", "d"), "liger": ("C1", "v"),
          "quack": ("C4", "P")}


def results_folder() -> Path:
    """Where GPU runs are recorded: the checkout's ``benchmarks/results``; in an installed
    wheel, the copy of it that travels with the package (``normbook.bench.recorded``: each
    run's results.json, report.json and README.md); a folder that does not exist when there
    is neither."""
    here = Path(__file__).resolve().parent
    checkout = here.parents[2] / "benchmarks" / "results"
    return checkout if checkout.is_dir() else here / "recorded"


def recorded_gpu_results(folder=None) -> list[dict]:
    """The real GPU runs recorded under ``folder`` (each run's ``results.json``, searched recursively);
    by default ``results_folder()``'s: the checkout's ``benchmarks/results``, or, from an
    installed wheel, the copy of those runs it carries (``normbook/bench/recorded``).

    CPU runs and synthetic test fixtures are left out, so that nothing but a measurement on a GPU
    is ever plotted as one. Returns [] when the folder does not exist or holds none.
    """
    folder = Path(folder) if folder is not None else results_folder()
    files = sorted(folder.rglob("results.json")) if folder.is_dir() else []
    return [r for r in load_results(files)
            if r["provenance"].get("device_type") == "cuda" and not r["provenance"].get("synthetic")]


def newest_gpu_result(folder=None) -> dict | None:
    """The reference run: the newest of :func:`recorded_gpu_results` by its provenance's date
    (ISO 8601, compared as times: an offset of +09:00 is nine hours before UTC), or None when
    no GPU run is recorded. Every later GPU run is recorded beside the first; the book and
    README quote this one. A run without a readable date cannot be ordered, nor can two runs of
    the same time: both raise :class:`normbook.bench.schema.ResultsError`, naming them."""
    runs = recorded_gpu_results(folder)
    if not runs:
        return None
    dated = sorted(((_when(r), n) for n, r in enumerate(runs)), reverse=True)
    newest, second = runs[dated[0][1]], runs[dated[-1 if len(dated) == 1 else 1][1]]
    if newest is not second and dated[0][0] == dated[1][0]:
        raise ResultsError(f"two recorded GPU runs share the date "
                           f"{newest['provenance']['date']!r} ({provenance_line(newest)}; "
                           f"{provenance_line(second)}): which is the reference cannot be told")
    return newest


def _when(result: dict):
    """A run's provenance date as an aware datetime (:func:`normbook.bench.goal._time`), or
    ResultsError naming the run."""
    from normbook.bench.goal import _time

    date = result["provenance"].get("date")
    when = _time(date, undated=False)
    if when is False:
        raise ResultsError(f"a recorded GPU run ({provenance_line(result)}) has no ISO 8601 "
                           f"date: provenance.date = {date!r}")
    return when


def recorded_rows(result: dict, dtype: str = "bf16", M: int | None = None) -> dict:
    """The rows of a recorded ``result`` (see :func:`newest_gpu_result`) in ``dtype`` and at M
    rows (the goal's M by default), by (provider, op, mode, D): what the book and the README
    quote, each figure a recorded row's, never typed."""
    from normbook.bench.goal import GOAL

    M = GOAL["M"] if M is None else M
    return {(r["provider"], r["op"], r["mode"], r["D"]): r for r in result["rows"]
            if r["dtype"] == dtype and r["M"] == M}


def provenance_line(result: dict) -> str:
    """A one-line caption: device, versions, commit, date, copy bandwidth.

    e.g. "NVIDIA H200; torch 2.13.0, triton 3.9.0; normbook 0.1.0 @ b819c73; 2025-06-01;
    copy 4210 GB/s".
    """
    p = result.get("provenance", {})
    commit = str(p.get("commit", "unknown"))
    commit = (commit[:7] if commit != "unknown" else commit) + ("+dirty" if p.get("dirty") else "")
    parts = [p.get("device", "unknown device"),
             f"torch {p.get('torch', '?')}, triton {p.get('triton', '?')}",
             f"normbook {p.get('normbook', '?')} @ {commit}",
             str(p.get("date", "?"))[:10]]
    if "copy_bandwidth_gbps" in result:
        parts.append(f"copy {result['copy_bandwidth_gbps']:.0f} GB/s")
    if p.get("synthetic"):
        parts.insert(0, "SYNTHETIC")
    return "; ".join(parts)


def plot_results(sources, out_dir, fmt: str = "png") -> list[Path]:
    """Draw one figure per (op, dtype) from ``sources`` (see
    :func:`normbook.bench.schema.load_results`) into ``out_dir``.

    Lines: one per provider (and per run, device and commit, when results of several are
    given: see ``normbook.bench.goal.runs``); shapes with a
    different M than the main one (the small-D, many-rows case) are drawn as lone markers.
    Returns the paths written.
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plot_results needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = load_results(sources)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, several = _rows_by_run(results)
    captions = list(dict.fromkeys(provenance_line(r) for r in results))
    written = []
    for op, dtype in dict.fromkeys((r["op"], r["dtype"]) for r in rows):
        sel = [r for r in rows if r["op"] == op and r["dtype"] == dtype]
        modes = [m for m in _MODE_TITLE if any(r["mode"] == m for r in sel)]
        fig, axes = plt.subplots(2, len(modes), figsize=(4.6 * len(modes), 7), squeeze=False,
                                 sharex=True)
        for j, mode in enumerate(modes):
            _panel(axes[0, j], axes[1, j], [r for r in sel if r["mode"] == mode], several)
            axes[0, j].set_title(_MODE_TITLE[mode])
        axes[0, 0].set_ylabel("GB/s (byte model / median time)")
        axes[1, 0].set_ylabel("fraction of copy bandwidth")
        axes[0, -1].legend(fontsize=8, loc="best")
        fig.suptitle(f"{op}, {dtype}")
        fig.text(0.5, 0.005, "\n".join(captions), ha="center", va="bottom", fontsize=7)
        fig.tight_layout(rect=(0, 0.03 * len(captions), 1, 0.97))
        path = figure_path(out_dir, f"{op}-{dtype}", fmt)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def figure_path(out_dir, stem: str, fmt: str = "png") -> Path:
    """``out_dir/<stem>.<fmt>``, the stem made filename-safe; never a path outside ``out_dir``.

    The stem comes from recorded JSON (op and dtype), which the loader checks, but a figure's
    name must not be able to leave the folder whatever a file says: separators and dots at the
    start are replaced, and the resolved path (symbolic links followed) must lie in ``out_dir``.
    """
    if fmt not in ("png", "svg", "pdf"):
        raise ValueError(f"fmt: expected one of png, svg, pdf, got {fmt!r}")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", stem).lstrip(".") or "_"
    out_dir = Path(out_dir)
    path = out_dir / f"{safe}.{fmt}"
    if path.resolve().parent != out_dir.resolve():
        raise ValueError(f"figure {stem!r}: {path} resolves outside the output folder {out_dir}")
    return path


def plot_overview(sources, path, dtype: str = "bf16") -> Path:
    """One figure, the goal at a glance: fraction of copy bandwidth against D, one column per op,
    forward on top and backward below, one line per provider, in ``dtype``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = load_results(sources)
    rows, several = _rows_by_run(results)
    rows = [r for r in rows if r["dtype"] == dtype]
    if not rows:        # (an empty figure was written, and the exit status was 0)
        found = sorted({r["dtype"] for res in results for r in res["rows"]})
        raise ResultsError(f"sources: no {dtype} rows to draw (they hold "
                           f"{', '.join(found) or 'no rows'} only)")
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(2, len(ops), figsize=(4.2 * len(ops), 6.5), squeeze=False, sharex=True)
    for j, op in enumerate(ops):
        for i, mode in enumerate(("fwd", "bwd")):
            ax = axes[i, j]
            sel = [r for r in rows if r["op"] == op and r["mode"] == mode]
            for prov, run in dict.fromkeys((r["provider"], r["_run"]) for r in sel):
                rs = sorted((r for r in sel if (r["provider"], r["_run"]) == (prov, run)),
                            key=lambda r: r["D"])
                color, marker = _STYLE.get(prov, (None, "o"))
                ax.plot([r["D"] for r in rs], [r["frac_copy"] for r in rs], color=color,
                        marker=marker, markersize=4,
                        label=prov + (f" ({run})" if several else ""))
            ax.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{op} {_MODE_TITLE[mode]}", fontsize=9)
        axes[1, j].set_xlabel("D")
    axes[0, 0].set_ylabel("fraction of copy bandwidth")
    axes[1, 0].set_ylabel("fraction of copy bandwidth")
    if rows:
        axes[0, -1].legend(fontsize=7, loc="best")
    captions = list(dict.fromkeys(provenance_line(r) for r in results))
    fig.suptitle(f"normbook against its rivals, {dtype}")
    fig.text(0.5, 0.005, "\n".join(captions), ha="center", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.03 * len(captions), 1, 0.96))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rows_by_run(results) -> tuple[list[dict], bool]:
    """Every row of ``results``, each tagged ``_run`` with its run's label (device, commit,
    date: :func:`normbook.bench.goal.runs`), and whether there are several runs. A line joins
    the rows of one run only: two runs of one provider drew one zigzag line."""
    from normbook.bench.goal import runs

    found = runs(results)
    return ([dict(row, _run=label) for label, files in found for r in files
             for row in r["rows"]], len(found) > 1)


def _panel(ax_gbps, ax_frac, rows, by_run: bool) -> None:
    Ms = [r["M"] for r in rows]
    main_M = max(set(Ms), key=Ms.count)
    series: dict = {}
    for r in rows:
        series.setdefault((r["provider"], r["_run"], r["M"]), []).append(r)
    for (prov, run, M), rs in series.items():
        rs.sort(key=lambda r: r["D"])
        color, marker = _STYLE.get(prov, (None, "o"))
        label = prov + (f" ({run})" if by_run else "")
        D = [r["D"] for r in rs]
        style = dict(color=color, marker=marker, markersize=4)
        if M != main_M:  # the small-D, many-rows case: a hollow marker, no legend entry
            style.update(linestyle="none", markerfacecolor="none", markersize=7)
            label = None
        ax_gbps.plot(D, [r["gbps"] for r in rs], label=label, **style)
        ax_frac.plot(D, [r["frac_copy"] for r in rs], **style)
    for ax in (ax_gbps, ax_frac):
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)  # a bandwidth axis starts at zero
        ax.grid(True, which="both", alpha=0.3)
    ax_frac.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
    ax_frac.set_xlabel(f"D (M = {main_M}; hollow markers: other M)"
                       if len(set(Ms)) > 1 else f"D (M = {main_M})")


def model_vs_measured(sources, report, arch: str = "sm_90", provider: str = "normbook") -> list[dict]:
    """The retired performance model's prediction beside the measurement, per (op, mode,
    dtype, D): a recorded history (see :mod:`normbook.bench.model`).

    ``sources``: benchmark results (see :func:`load_results`); ``report``: a compile report's
    JSON (a dict or a path) recorded with them, from before the predictions went (reports
    since carry none: no rows then). Joins ``provider``'s rows (fwd and bwd, at the report's M)
    with the report's paths for ``arch``. Each row: op, mode, dtype, D, predicted, measured
    (fractions of copy bandwidth) and measured / predicted, where the model is wrong by how much.
    """
    if isinstance(report, dict):
        rep = check_report(report)
    else:
        rep = check_report(read_json(report), str(report))
    predicted = {(p["norm"], p["residual"], p["direction"], p["dtype"], p["D"]): p["predicted_fraction"]
                 for p in rep["paths"]
                 if p["arch"] == arch and "error" not in p and "predicted_fraction" in p}
    from normbook.bench.goal import mixed, runs

    results = load_results(sources)
    found = runs(results)
    if len(found) > 1 or mixed(found[0][0]):   # one report is one run's: rows came out twice
        raise ResultsError("sources: --model-check joins one run's rows to the compile report "
                           "of its commit; these are several runs ("
                           + "; ".join(label for label, _ in found) + "): give one")
    out = []
    for result in results:
        for row in result["rows"]:
            if (row["provider"] != provider or row["op"] not in _OP_PATH or row["mode"] not in ("fwd", "bwd")
                    or row["M"] != rep.get("m", row["M"])):
                continue
            want = predicted.get((*_OP_PATH[row["op"]], row["mode"], row["dtype"], row["D"]))
            if want:
                out.append(dict(op=row["op"], mode=row["mode"], dtype=row["dtype"], D=row["D"],
                                predicted=want, measured=row["frac_copy"],
                                ratio=row["frac_copy"] / want))
    return sorted(out, key=lambda r: (r["op"], r["mode"], r["dtype"], r["D"]))


def model_table(rows: list[dict]) -> str:
    """:func:`model_vs_measured`'s rows as text, with the worst miss named."""
    if not rows:
        return ("model against measurement: no measured row at the report's M and D with a "
                "prediction (reports made after 2026-12-05 carry none)")
    lines = [f"{'op':16} {'mode':4} {'dtype':5} {'D':>7} {'predicted':>9} {'measured':>8} {'ratio':>6}"]
    lines += [f"{r['op']:16} {r['mode']:4} {r['dtype']:5} {r['D']:7} {r['predicted']:9.2f} "
              f"{r['measured']:8.2f} {r['ratio']:6.2f}" for r in rows]
    worst = min(rows, key=lambda r: r["ratio"])
    lines.append(f"largest shortfall against the model: {worst['op']} {worst['mode']} {worst['dtype']} "
                 f"D = {worst['D']}, measured {worst['ratio']:.2f} of the prediction")
    return "\n".join(lines)


def plot_model_vs_measured(rows: list[dict], path, dtype: str = "bf16", caption: str = "") -> Path:
    """One figure: fraction of copy bandwidth against D, measured (solid) and predicted by the
    model (dashed), one column per op, forward on top and backward below, in ``dtype``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["dtype"] == dtype]
    ops = list(dict.fromkeys(r["op"] for r in rows)) or ["(no rows)"]
    fig, axes = plt.subplots(2, len(ops), figsize=(4.2 * len(ops), 6.5), squeeze=False, sharex=True)
    for j, op in enumerate(ops):
        for i, mode in enumerate(("fwd", "bwd")):
            ax = axes[i, j]
            sel = sorted((r for r in rows if r["op"] == op and r["mode"] == mode), key=lambda r: r["D"])
            D = [r["D"] for r in sel]
            ax.plot(D, [r["measured"] for r in sel], "o-", color="C3", markersize=4, label="measured")
            ax.plot(D, [r["predicted"] for r in sel], "s--", color="C7", markersize=4, label="model")
            ax.axhline(1.0, color="k", linewidth=0.8, linestyle=":")
            if sel:
                ax.set_xscale("log", base=2)
            else:
                ax.text(0.5, 0.5, "no measured row at the report's M and D", ha="center",
                        va="center", transform=ax.transAxes, fontsize=8)
            ax.set_ylim(0, 1.1)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{op} {_MODE_TITLE[mode]}", fontsize=9)
        axes[1, j].set_xlabel("D")
    for i in range(2):
        axes[i, 0].set_ylabel("fraction of copy bandwidth")
    axes[0, -1].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"normbook: the performance model against measurement, {dtype}")
    if caption:
        fig.text(0.5, 0.005, caption, ha="center", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.03 if caption else 0, 1, 0.96))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
