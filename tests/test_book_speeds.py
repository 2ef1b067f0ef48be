"""No page types a speed: a bandwidth (GB/s, TB/s) or a fraction of copy bandwidth in the
prose of the book or the README is either glued from a recorded measurement (``{glue}``) or a
datasheet figure cited on the same line (``{cite}``). A number typed by hand would outlive the
measurement it came from; the recorded results under benchmarks/results/ are the only source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "book").glob("*.md")) + [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
SPEED = re.compile(
    r"\d[\d,.]*\s*(?:GB/s|TB/s|GiB/s)"                                     # a bandwidth
    r"|\b[01]?\.\d+\s+of\s+(?:the\s+)?(?:[\w.]+\s+){0,2}(?:copy|bandwidth|peak)"   # 0.92 of (the 1 GiB) copy
    r"|\d+(?:\.\d+)?\s*%\s+of\s+(?:the\s+)?(?:copy|bandwidth|peak)")        # 92% of copy
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)


GOAL = re.compile(r"(?:>=|≥|at least)\s*$")    # "at least 0.92 of copy": a target, not a speed


def typed_speeds(text: str) -> list[tuple[int, str]]:
    """(line, match) of each speed typed in the prose of a page (code blocks and cells left
    out: their numbers are computed), unless the line cites its source or the number is a
    goal's target (after ">=" or "at least")."""
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return [(i, m.group(0)) for i, line in enumerate(prose.split("\n"), 1)
            if "{cite}" not in line for m in SPEED.finditer(line)
            if not GOAL.search(line[:m.start()])]


def test_the_rule_catches_typed_speeds():
    page = ("The kernel reaches 0.92 of copy.\nIt moves 3,900 GB/s.\n"
            "It reaches 93% of the bandwidth.\nHBM: 4.8 TB/s {cite}`nvidia2024h200`.\n"
            "A small one reached 0.86 of the 1 GiB copy.\n"
            "It reaches {glue}`frac` of copy.\n```python\nprint('0.5 of copy')\n```\n"
            "The goal: >= 0.92 of copy, at least 0.85 of a copy.\n")
    assert typed_speeds(page) == [(1, "0.92 of copy"), (2, "3,900 GB/s"),
                                  (3, "93% of the bandwidth"), (5, "0.86 of the 1 GiB copy")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_types_a_speed(page):
    assert typed_speeds(page.read_text()) == [], (
        f"{page.relative_to(ROOT)}: glue these from benchmarks/results/ or cite a datasheet")


def test_the_readmes_measured_times_are_the_recorded_runs():
    """The README cannot glue: the host times it quotes from the H200 run must be the ones that
    run recorded (benchmarks/results/2026-12-04-h200/README.md), figure for figure."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## CUDA graphs"):]
    section = section[:section.index("\n## ", 1)]
    quoted = re.findall(r"(\d+(?:\.\d+)?) (?:and (\d+(?:\.\d+)?) )?us", section)
    figures = {f for pair in quoted for f in pair if f}
    recorded = (ROOT / "benchmarks" / "results" / "2026-12-04-h200" / "README.md").read_text()
    assert figures >= {"42", "257", "9.9", "102"}, figures
    for f in figures:
        assert re.search(rf"\b{re.escape(f)} us\b|\b{re.escape(f)} /", recorded), f


def test_the_benchmarks_readme_states_the_goal_the_check_judges():
    """The README cannot glue: its goal sentence must be normbook.bench.goal.GOAL's, figure
    for figure (the appendix glued D from 1024 while the README said 2048)."""
    from normbook.bench.goal import GOAL

    text = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    (same_d, same_frac), = GOAL["same_size"].items()
    lo, hi = GOAL["core"]
    for words in (f">= {GOAL['frac']['fwd']:.2f} of copy bandwidth forward",
                  f">= {GOAL['frac']['bwd']:.2f} backward for D in {lo}..{hi}",
                  f">= {GOAL['tail'][2]:.2f} up to {GOAL['tail'][1]}",
                  f"D = {same_d} >= {same_frac:.2f} of a same-size copy",
                  f"bf16, M = {GOAL['M']}"):
        assert words in text, words


def test_the_benchmarks_readme_states_the_host_share_the_check_uses():
    """The README's rule for a time the host set (the goal check's NOT MEASURED, the summary's
    star) is normbook.bench.goal.host_set's: a do_bench row whose host time is at least
    HOST_SHARE_DO_BENCH of its time, not only one whose host time exceeds it (what the README
    still said after the check took the share)."""
    from normbook.bench.goal import HOST_SHARE_DO_BENCH

    text = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    for words in (f"is at least `HOST_SHARE_DO_BENCH` ({HOST_SHARE_DO_BENCH})",
                  f"whose host time is at least {HOST_SHARE_DO_BENCH} of its time"):
        assert words in text, words
    assert "per call exceeds its time measured the host" not in text
