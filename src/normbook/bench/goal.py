"""The performance goal of DESIGN.md as a check over recorded rows.

Goal, on a Hopper GPU, bf16, M = 32768 rows: the normbook kernels reach at least 0.90 of
the copy bandwidth in forward and 0.80 in backward for every D in 1024..32768, at least 0.70
for larger D up to 131072, and are faster than torch eager, torch.compile and Liger at every
D. :func:`check_goal` says, per (op, mode, D), whether a result meets it; it judges only what
was measured (a rival that was not run is not compared).
"""

from __future__ import annotations

__all__ = ["GOAL", "check_goal"]

GOAL = {
    "dtype": "bf16",
    "M": 32768,
    "core": (1024, 32768),            # D range of the main targets
    "frac": {"fwd": 0.90, "bwd": 0.80},
    "tail": (32768, 131072, 0.70),    # larger D: works and stays above this
    "rivals": ("torch", "compile", "liger"),
}


def _need(mode: str, D: int) -> float | None:
    lo, hi = GOAL["core"]
    t_lo, t_hi, t_frac = GOAL["tail"]
    if lo <= D <= hi:
        return GOAL["frac"].get(mode)
    if t_lo < D <= t_hi:
        return t_frac if mode in GOAL["frac"] else None
    return None


def check_goal(results: list[dict]) -> tuple[list[str], bool]:
    """Lines ``op mode D: frac (need x) vs rivals ... PASS|FAIL`` and whether all passed.

    Only rows with the goal's dtype and M, modes fwd/bwd, and a D inside the goal's range are
    judged; a missing normbook row (skipped or failed) counts as FAIL, with its reason.
    """
    rows = [r for res in results for r in res["rows"]
            if r["dtype"] == GOAL["dtype"] and r["M"] == GOAL["M"]]
    skipped = {(s["op"], s["mode"], s["D"]): s["reason"] for res in results
               for s in res.get("skipped", []) if s["provider"] == "normbook"}
    best: dict = {}
    for r in rows:  # several files: the fastest measurement of each key
        k = (r["provider"], r["op"], r["mode"], r["D"])
        if k not in best or r["ms"] < best[k]["ms"]:
            best[k] = r
    keys = sorted({(op, mode, D) for (_, op, mode, D) in best} | set(skipped))
    lines, ok_all = [], True
    for op, mode, D in keys:
        need = _need(mode, D)
        if need is None:
            continue
        mine = best.get(("normbook", op, mode, D))
        if mine is None:
            lines.append(f"{op:<15}{mode:<4} D={D:<7} normbook missing: "
                         f"{skipped.get((op, mode, D), 'not run')}  FAIL")
            ok_all = False
            continue
        ok = mine["frac_copy"] >= need
        vs = []
        for rival in GOAL["rivals"]:
            r = best.get((rival, op, mode, D))
            if r is not None:
                speedup = r["ms"] / mine["ms"]
                ok &= speedup > 1.0
                vs.append(f"{rival} {speedup:.2f}x")
        ok_all &= ok
        lines.append(f"{op:<15}{mode:<4} D={D:<7} {mine['frac_copy']:.2f} of copy "
                     f"(need {need:.2f}); vs {', '.join(vs) or 'no rivals run'}  "
                     f"{'PASS' if ok else 'FAIL'}")
    return lines, ok_all
