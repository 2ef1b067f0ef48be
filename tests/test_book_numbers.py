"""No number in the book's prose is typed by hand unless it is listed here with its reason.

The book's rule: every number its prose quotes is computed in a cell, asserted there, and glued
into the sentence (``claim`` in a hidden cell, ``{glue}`` in the prose; AUTHORING.md). A result
typed by hand passes every other check and goes stale when the code changes. So the prose of
each page (outside code, math, inline code and roles) may hold a decimal number, or a whole
number of three digits or more, only where :data:`TYPED` names it with the reason it is not a
result: an experiment's input that the cell below sets (and asserts where the prose explains
it), a cited datasheet figure, a model's published size, a version. Smaller whole numbers
("two passes", "3 seeds") are words of the argument and are not checked.

And every ``claim`` a page makes is glued somewhere: a claim no sentence shows is a check
that guards nothing a reader sees.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "book").glob("*.md"))

# (page, number) -> why the prose may type it
TYPED = {
    ("01-one-token.md", "512"): "the experiment's input: D of the rows the cell builds",
    ("01-one-token.md", "100"): "the shift the example adds, an input",
    ("04-invariances.md", "150"): "the experiment's input: tokens per eps (asserted in the cell)",
    ("07-pre-post-norm.md", "128"): "the experiment's input: the MLP's hidden width",
    ("07-pre-post-norm.md", "200"): "the experiment's input: steps",
    ("07-pre-post-norm.md", "100"): "the experiment's input: warmup steps",
    ("09-kernels.md", "4096"): "a 7B-class model's hidden size and sequence length, inputs",
    ("09-kernels.md", "128"): "a typical matrix-product block, an example",
    ("09-kernels.md", "9000"): "the example's row length, an input",
    ("10-distributed.md", "900"): "H200 NVLink, a datasheet figure cited in the sentence",
    ("10-distributed.md", "450"): "half of the cited 900 GB/s, each direction",
    ("10-distributed.md", "4.8"): "H200 HBM, a datasheet figure cited in the sentence",
    ("10-distributed.md", "160"): "an example model's norm count (80 layers, two norms each)",
    ("appendix-kernels.md", "16384"): "an example row length, an input",
    ("appendix-kernels.md", "65536"): "an example row length, an input",
    ("appendix-kernels.md", "128"): "the width of a vector load in bits, a hardware fact",
    ("appendix-kernels.md", "9000"): "the interpreter test's row length, an input",
    ("cheatsheet.md", "32768"): "the example's row count, an input",
    ("references.md", "2016"): "a year, in an example of a citation",
    ("running.md", "3.6"): "a Triton version",
    ("running.md", "3.7"): "a Triton version",
    ("running.md", "3.8"): "a Triton version",
    ("running.md", "2.11"): "a torch version",
}

NUMBER = re.compile(r"(?<![\w.])(?:\d+\.\d+|\d{3,})(?![\w.])")
FENCE = re.compile(r"^\s*(`{3,}|:{3,})\s*(\{[\w:-]+\}|[\w+-]*)")
# fenced blocks whose body is code or math, not prose
NOT_PROSE = {"", "{code-cell}", "{math}", "{literalinclude}", "{code-block}", "{code}",
             "{bibliography}", "{toctree}"}


def prose(text: str) -> str:
    """The page's prose, line for line: code, math, inline code, roles, links' targets,
    comments and directive options blanked."""
    text = re.sub(r"\A---\n.*?\n---\n", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    lines, stack = [], []           # stack: (fence, is_prose) of the open fenced blocks
    for line in text.split("\n"):
        m = FENCE.match(line)
        if m and stack and line.strip() == stack[-1][0]:
            stack.pop()
            lines.append("")
            continue
        if m and (not stack or stack[-1][1]):
            fence, info = m.group(1), m.group(2)
            stack.append((fence, fence.startswith(":") or info not in NOT_PROSE
                          and not (fence.startswith("`") and not info.startswith("{"))))
            lines.append("")
            continue
        lines.append(line if all(p for _, p in stack) else "")
    out = "\n".join(lines)
    out = re.sub(r"\$\$.*?\$\$", lambda m: "\n" * m.group(0).count("\n"), out, flags=re.S)
    out = re.sub(r"<!--.*?-->", lambda m: "\n" * m.group(0).count("\n"), out, flags=re.S)
    for pattern in (r"\$[^$\n]+\$", r"\{[\w:-]+\}`[^`]*`", r"`[^`\n]*`", r"\]\([^)\n]*\)",
                    r"<https?://[^>\n]*>", r"(?m)^[ \t]*:[\w-]+:.*$", r"(?m)^\([\w-]+\)=[ \t]*$"):
        out = re.sub(pattern, " ", out)
    return out


def typed_numbers(text: str) -> list[tuple[int, str]]:
    """(line, number) of each number typed in a page's prose."""
    return [(i, m.group(0)) for i, line in enumerate(prose(text).split("\n"), 1)
            for m in NUMBER.finditer(line)]


def test_the_rule_finds_typed_numbers_and_nothing_else():
    page = ("---\njupytext: 1.0\n---\n"
            "The error is 0.07 here, over 4096 rows.\n"
            "It is {glue}`err` at $D = 4096$, `x[1024]`, two passes, 3 seeds.\n"
            "```{code-cell} ipython3\nD = 4096\n```\n"
            ":::{admonition} Note\n:class: tip\nIt took 12.5 s.\n:::\n"
            "$$\nD = 8192\n$$\n"
            "See [the run](results/2026-12-04-h200/README.md) and <http://localhost:8000>.\n"
            "````{solution} ex\n```python\nprint(0.5)\n```\nAbout 250 steps.\n````\n")
    assert typed_numbers(page) == [(4, "0.07"), (4, "4096"), (11, "12.5"), (21, "250")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_types_a_result(page):
    typed = [(line, n) for line, n in typed_numbers(page.read_text())
             if (page.name, n) not in TYPED]
    assert not typed, (
        f"book/{page.name}: numbers typed in the prose (line, number): {typed}. Compute each in "
        f"a cell, assert it there and glue it (booktools.claim and {{glue}}, AUTHORING.md); an "
        f"input or a cited fact goes into tests/test_book_numbers.py's TYPED with its reason")


def test_every_listed_number_is_still_typed():
    """An entry of TYPED whose number left its page is stale: it would let the number back
    unseen."""
    found = {(page.name, n) for page in PAGES for _, n in typed_numbers(page.read_text())}
    assert set(TYPED) <= found, sorted(set(TYPED) - found)


def test_every_claim_is_glued_somewhere():
    claims, glued = {}, set()
    for page in PAGES:
        text = page.read_text()
        for name in re.findall(r"""\bclaim\(\s*["']([\w.-]+)["']""", text):
            claims.setdefault(name, page.name)
        glued |= set(re.findall(r"\{glue(?::\w+)?\}`([\w.-]+)", text))
        glued |= set(re.findall(r"[`:]{3,}\{glue:figure\}\s+([\w.-]+)", text))
    unshown = {name: page for name, page in claims.items() if name not in glued}
    assert not unshown, f"claims no page glues (name: page): {unshown}"
