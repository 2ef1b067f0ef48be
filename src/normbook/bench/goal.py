"""The kernels' performance goal as a check over recorded rows.

Goal (issue 46, set after the first H200 run), on a Hopper GPU, bf16, M = 32768 rows: the
normbook kernels reach at least 0.92 of the copy bandwidth in forward and 0.85 in backward for
every D in 2048..32768, at least 0.80 for larger D up to 131072; at D = 1024, forward and backward, at least 0.85 of a copy of the
row's own bytes (a copy of that size, 134 MB for the forward, reached only 0.86 of the big copy
on the H200); and faster than torch eager, torch.compile and Liger at every D.
:func:`check_goal` says, per (op, mode, D) of that grid, PASS, FAIL or NOT MEASURED: a row
that is missing, normbook's or a rival's, is never counted as a pass, nor is a row whose time is
not a timing (NaN, inf, 0 or negative: ``nan <= 1.0`` is False, so a NaN rival would otherwise
look slower than anything).
"""

from __future__ import annotations

import math

from normbook.bench.schema import measured

__all__ = ["GOAL", "check_goal", "need"]

GOAL = {
    "dtype": "bf16",
    "M": 32768,
    "core": (1024, 32768),            # D range of the main targets
    "frac": {"fwd": 0.92, "bwd": 0.85},
    "tail": (32768, 131072, 0.80),    # larger D: works and stays above this
    "same_size": {1024: 0.85},        # D: fraction of a same-size copy (frac_same_copy), both modes
    "rivals": ("torch", "compile", "liger"),
}


def need(mode: str, D: int) -> float | None:
    """The goal's fraction of the big copy's bandwidth for ``mode`` ("fwd" or "bwd") at row
    length D (bf16, M rows as :data:`GOAL` says), or None where the goal sets none; where
    ``GOAL["same_size"]`` names D, :func:`check_goal` judges the fraction of a same-size copy
    instead."""
    lo, hi = GOAL["core"]
    t_lo, t_hi, t_frac = GOAL["tail"]
    if lo <= D <= hi:
        return GOAL["frac"].get(mode)
    if t_lo < D <= t_hi:
        return t_frac if mode in GOAL["frac"] else None
    return None


GOAL_DS = tuple(1 << k for k in range(10, 18))      # 1024 .. 131072
GOAL_OPS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
NO_SUCH_OP = "no such op"   # how a provider's skip reason starts when it has no kernel for the op


def check_goal(results: list[dict], ops=GOAL_OPS, Ds=GOAL_DS) -> tuple[list[str], bool]:
    """One line per (op, mode, D) of the goal's grid, ending PASS, FAIL or NOT MEASURED.

    PASS needs a normbook row at or above the target fraction of copy bandwidth (at the D of
    ``GOAL["same_size"]``, of a copy of its own bytes: ``frac_same_copy``; a row without one, as
    recorded before it was measured, is NOT MEASURED) and a row of every rival (torch, compile,
    liger) that is slower. A missing row, normbook's or a rival's, makes the line NOT MEASURED
    with the recorded reason, never a pass; the only excuse is a rival that has no such op at
    all (Liger has no fused add + LayerNorm), which is named. A row whose ms is NaN, inf, 0 or
    negative (or frac_copy not a finite fraction) counts as missing, its recorded value named.
    Only rows with the goal's dtype and M count; the fastest of several files is used.
    """
    rows = [r for res in results for r in res["rows"]
            if r["dtype"] == GOAL["dtype"] and r["M"] == GOAL["M"]]
    skipped = {(s["provider"], s["op"], s["mode"], s["D"]): s["reason"] for res in results
               for s in res.get("skipped", [])
               if s["dtype"] == GOAL["dtype"] and s["M"] == GOAL["M"]}
    best: dict = {}
    for r in rows:
        k = (r["provider"], r["op"], r["mode"], r["D"])
        why = measured(r)
        if why is not None:  # a NaN time is not measured: the line says so, with the value
            skipped[k] = why
        elif k not in best or r["ms"] < best[k]["ms"]:
            best[k] = r
    lines, ok_all = [], True
    for op in ops:
        for mode in GOAL["frac"]:
            for D in Ds:
                same = GOAL["same_size"].get(D)
                frac = same if same is not None else need(mode, D)
                if frac is None:
                    continue
                line, status = _judge(op, mode, D, frac, best, skipped, same is not None)
                ok_all &= status == "PASS"
                lines.append(f"{op:<15}{mode:<4} D={D:<7} {line}  {status}")
    return lines, ok_all


def _judge(op, mode, D, need, best, skipped, same_size=False) -> tuple[str, str]:
    def missing(prov):
        return skipped.get((prov, op, mode, D), "not run")

    mine = best.get(("normbook", op, mode, D))
    if mine is None:
        return f"normbook not measured: {missing('normbook')}", "NOT MEASURED"
    frac, of, big = mine["frac_copy"], "of copy", ""
    if same_size:   # the yardstick is a copy of the row's own bytes
        frac, of = mine.get("frac_same_copy"), "of a same-size copy"
        big = f"; {mine['frac_copy']:.2f} of copy"
        if not (isinstance(frac, (int, float)) and math.isfinite(frac) and frac >= 0):
            why = ("the run measured no same-size copy" if "frac_same_copy" not in mine
                   else f"recorded frac_same_copy = {frac!r}, not a fraction")
            return (f"normbook {mine['frac_copy']:.2f} of copy; {why} (the yardstick at "
                    f"D = {D})"), "NOT MEASURED"
    status = "PASS" if frac >= need else "FAIL"
    vs = []
    for rival in GOAL["rivals"]:
        r = best.get((rival, op, mode, D))
        if r is not None:
            speedup = r["ms"] / mine["ms"]
            if speedup <= 1.0:
                status = "FAIL"
            vs.append(f"{rival} {speedup:.2f}x")
        elif missing(rival).startswith(NO_SUCH_OP):
            vs.append(f"{rival} has no such op")
        else:
            vs.append(f"{rival} not measured ({missing(rival)})")
            if status == "PASS":
                status = "NOT MEASURED"
    return f"{frac:.2f} {of} (need {need:.2f}{big}); vs {', '.join(vs)}", status
