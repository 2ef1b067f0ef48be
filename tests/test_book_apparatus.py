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
