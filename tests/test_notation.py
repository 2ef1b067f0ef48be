"""The notation page's label table matches the labels the package's comments cite to the
equations the book numbers (issue 23: a reader can match a comment's label to the page)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABEL = r"(?:ln|rms|kern|fork|residual|pre|post|batch|dist)-[a-z0-9-]+"


def _table() -> set[str]:
    text = (ROOT / "book/notation.md").read_text()
    section = text[text.index("(equation-labels)="):]
    return set(re.findall(rf"^\| `({LABEL})` \| {{eq}}`\1` \|", section, re.M))


def _defined() -> set[str]:
    """Labels of displayed equations in the book ($$ ... $$ (label))."""
    return {m for page in (ROOT / "book").glob("*.md")
            for m in re.findall(rf"\$\$ *\(({LABEL})\)", page.read_text())}


def test_every_labelled_equation_is_in_the_table():
    assert _defined() == _table()


def test_every_label_the_code_cites_is_an_equation_of_the_book():
    cited = {m for f in (ROOT / "src/normbook").rglob("*.py")
             for m in re.findall(rf"\(({LABEL})\)", f.read_text())}
    assert cited, "no label found: the pattern is wrong"
    assert cited <= _defined(), f"comments cite labels no equation has: {cited - _defined()}"
