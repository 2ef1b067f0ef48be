"""The notation page's label table matches the labels the package's comments cite to the
equations the book numbers (issue 23: a reader can match a comment's label to the page)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _defined() -> set[str]:
    """Labels of displayed equations in the book ($$ ... $$ (label))."""
    return {m for page in (ROOT / "book").glob("*.md")
            for m in re.findall(r"\$\$ *\(([a-z0-9-]+)\)", page.read_text())}


# a label as the code cites it: any prefix the book's labels use (ln-, jac-, kern-, ...), so a
# misspelt label of a new prefix is caught as well as one of an old prefix
LABEL = rf"(?:{'|'.join(sorted({label.split('-')[0] for label in _defined()}))})-[a-z0-9-]+"


def _table() -> set[str]:
    text = (ROOT / "book/notation.md").read_text()
    section = text[text.index("(equation-labels)="):]
    return set(re.findall(rf"^\| `({LABEL})` \| {{eq}}`\1` \|", section, re.M))


def test_every_labelled_equation_is_in_the_table():
    assert _defined() == _table()


def test_every_label_the_code_cites_is_an_equation_of_the_book():
    cited = {m for f in (ROOT / "src/normbook").rglob("*.py")
             for m in re.findall(rf"\(({LABEL})\)", f.read_text())}
    assert cited, "no label found: the pattern is wrong"
    assert cited <= _defined(), f"comments cite labels no equation has: {cited - _defined()}"


# ---- one letter, one meaning (issue 48): the letters of notation.md in each page's math -------

KERNEL_PAGES = {"09-kernels.md", "appendix-kernels.md", "notation.md"}


def _prose_math(text: str) -> list[tuple[int, str]]:
    """(line, math) of each $...$ or $$...$$ in a page's prose: code cells and code blocks are
    left out (their variables follow the code's names), directive bodies (exercises) kept."""
    kept, code = [], False
    for line in text.split("\n"):
        st = line.strip()
        if code:
            code = st != "```"
            kept.append("")
        elif st.startswith("```{code-cell}") or re.fullmatch(r"```[A-Za-z]+", st):
            code = True
            kept.append("")
        else:
            kept.append(line)
    prose = "\n".join(kept)
    return [(prose.count("\n", 0, m.start()) + 1, m.group(0))
            for m in re.finditer(r"\$\$.*?\$\$|\$[^$\n]+\$", prose, re.S)]


def _lines_with(page: Path, pattern: str) -> list[tuple[int, str]]:
    return [(n, math) for n, math in _prose_math(page.read_text()) if re.search(pattern, math)]


def test_prose_math_finds_what_it_should():
    page = ("Take $N = 6$ tokens.\n```{code-cell} ipython3\nM = 5  # $M$\n```\n"
            "```{exercise} Try\nFor $M = 8$ rows.\n```\n$$\ny = \\mathrm{Norm}(x)\n$$\n")
    assert [m for _, m in _prose_math(page)] == ["$N = 6$", "$M = 8$", "$$\ny = \\mathrm{Norm}(x)\n$$"]
    assert [n for n, _ in _prose_math(page)] == [1, 6, 8]


def test_the_norm_is_never_the_letter_that_counts_tokens():
    """Norm is \\mathrm{Norm} in every equation: N is the token count."""
    bad = {page.name: hits for page in sorted((ROOT / "book").glob("*.md"))
           if (hits := _lines_with(page, r"(?<![A-Za-z\\_{])N\s*(?:\\(?:big|Big|left))?\("))}
    assert not bad, f"N used as the norm: {bad}"
    # nor in a figure's labels (chapter 7's block diagrams once drew the norm as a box "N")
    labels = {page.name for page in (ROOT / "book").glob("*.md")
              if re.search(r'"N(?: \(final\))?"', page.read_text())}
    assert not labels, f"a figure labels the norm N: {labels}"


def test_tokens_are_n_and_m_counts_rows_only_where_the_kernels_are():
    """Outside the kernel pages M appears in math only beside the word "row(s)", where a page
    uses the kernels' byte counts; elsewhere the tokens are N."""
    bad = {}
    for page in sorted((ROOT / "book").glob("*.md")):
        if page.name in KERNEL_PAGES:
            continue
        lines = page.read_text().split("\n")
        hits = [(n, math) for n, math in _lines_with(page, r"(?<![A-Za-z\\_{])M(?![a-z_])")
                if "row" not in lines[n - 1]]
        if hits:
            bad[page.name] = hits
    assert not bad, f"M for the token count outside the kernel pages: {bad}"


def test_a_set_of_features_does_not_reuse_the_branch_letter():
    assert not _lines_with(ROOT / "book" / "10-distributed.md", r"(?<![A-Za-z\\_{])F_")
    assert not _lines_with(ROOT / "book" / "appendix-kernels.md", r"(?<![A-Za-z\\_{])R\b")
