"""The README's equation -> function -> chapter table covers every labelled equation of the book."""

import importlib.util
import pkgutil
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABEL = re.compile(r"^\s*\$\$\s*\(([A-Za-z0-9_-]+)\)\s*$", re.M)


def book_labels():
    labels = {}
    for chapter in sorted((ROOT / "book").glob("[0-9][0-9]-*.md")):
        for label in LABEL.findall(chapter.read_text()):
            labels[label] = chapter.name
    return labels


def table_rows() -> list[list[str]]:
    """The README's equation table: its rows, each split into its cells."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Equation, function, chapter"):]
    return [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| `")]


def test_every_labelled_equation_is_in_the_readme_table():
    table = "".join(cells[0] for cells in table_rows())
    missing = {label: ch for label, ch in book_labels().items() if f"`{label}`" not in table}
    assert not missing, f"README table lacks these equations (label: chapter): {missing}"


def test_every_labelled_equation_is_in_the_notation_table():
    """book/notation.md's table of equation labels, which says it matches them all."""
    notation = (ROOT / "book" / "notation.md").read_text()
    rows = notation[notation.index("## Equation labels"):]
    named = set(re.findall(r"^\| `([a-z0-9-]+)` \|", rows, re.M))
    assert named == set(book_labels()), (
        f"book/notation.md's '## Equation labels' table lacks {set(book_labels()) - named} and "
        f"names labels no chapter defines: {named - set(book_labels())}")


def test_the_readmes_equation_numbers_are_the_books():
    """Each label in the table carries the number the book prints, (3.4) for ``ln-dx``: what
    a reader of the book or the downloaded notebooks looks for. The numbers are the book
    builder's (book/_ext/notebooks.build_index, which the built pages are checked against in
    tests/browser)."""
    import sys
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    import notebooks
    numbers = notebooks.build_index(ROOT).equations
    written = {label: number for cells in table_rows()
               for label, number in re.findall(r"`([a-z0-9-]+)`(?: \(([\d.]+)\))?", cells[0])}
    wrong = {label: (number, numbers.get(label)) for label, number in written.items()
             if number != numbers.get(label)}
    assert not wrong, f"README's equation numbers (label: (README's, the book's)): {wrong}"


def test_the_readme_names_only_real_labels():
    named = {m for cells in table_rows() for m in re.findall(r"`([a-z0-9-]+)`", cells[0])}
    assert named <= set(book_labels()), f"README names labels no chapter defines: {named - set(book_labels())}"


def test_every_label_is_unique_across_the_book():
    seen = {}
    for chapter in sorted((ROOT / "book").glob("[0-9][0-9]-*.md")):
        for label in LABEL.findall(chapter.read_text()):
            assert label not in seen, f"equation label {label} defined in {seen.get(label)} and {chapter.name}"
            seen[label] = chapter.name


def test_every_name_in_the_readme_table_exists():
    """The table is how a newcomer finds an equation's code: each dotted name it gives in the
    code column (``reference.layer_norm_backward`` is ``normbook.reference.layer_norm_backward``)
    must resolve. (It once named a kernel removed two redesigns earlier.)"""
    names = {m.removeprefix("normbook.") for cells in table_rows()
             for m in re.findall(r"`([A-Za-z_][\w.]*\.[\w.]+)`", cells[2])}
    assert len(names) > 20
    have_triton = importlib.util.find_spec("triton") is not None
    missing = []
    for name in sorted(names):
        if name.startswith("kernels") and not have_triton:
            continue
        try:
            pkgutil.resolve_name(f"normbook.{name}")
        except (AttributeError, ImportError) as e:
            missing.append(f"{name} ({e})")
    assert not missing, f"README's table names what the package lacks: {missing}"


def test_the_readmes_dotted_names_work_after_import_normbook_alone():
    """A reader types what the README shows after ``import normbook`` and nothing else: each
    dotted name it gives resolves by attribute (``normbook.checks`` is imported on first use),
    except those under the kernels and the benchmarks, which are imported by name (they need
    Triton, or are a command). In a fresh process, so that no other test's import helps."""
    import subprocess
    import sys

    names = sorted({n.rstrip(".") for n in re.findall(r"normbook\.[A-Za-z_][A-Za-z0-9_.]*",
                                                      (ROOT / "README.md").read_text())
                    if not n.startswith(("normbook.kernels", "normbook.bench"))})
    assert "normbook.checks.check_norm_backward" in names
    code = ("import functools, sys, normbook\n"
            "assert 'normbook.checks' not in sys.modules   # imported on first use, not before\n"
            f"for name in {names!r}:\n"
            "    functools.reduce(getattr, name.split('.')[1:], normbook)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
