"""The README's equation -> function -> chapter table covers every labelled equation of the book."""

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


def test_every_labelled_equation_is_in_the_readme_table():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Equation, function, chapter"):]
    missing = {label: ch for label, ch in book_labels().items() if f"`{label}`" not in table}
    assert not missing, f"README table lacks these equations (label: chapter): {missing}"


def test_the_readme_names_only_real_labels():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Equation, function, chapter"):]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    named = {m for row in rows for m in re.findall(r"`([a-z0-9-]+)`", row.split("|")[1])}
    assert named <= set(book_labels()), f"README names labels no chapter defines: {named - set(book_labels())}"


def test_every_label_is_unique_across_the_book():
    seen = {}
    for chapter in sorted((ROOT / "book").glob("[0-9][0-9]-*.md")):
        for label in LABEL.findall(chapter.read_text()):
            assert label not in seen, f"equation label {label} defined in {seen.get(label)} and {chapter.name}"
            seen[label] = chapter.name


def _resolve(dotted: str):
    """``normbook.<dotted>``: the longest importable module prefix, then attributes."""
    import importlib

    parts = dotted.removeprefix("normbook.").split(".")
    for cut in range(len(parts), -1, -1):
        try:
            obj = importlib.import_module(".".join(["normbook", *parts[:cut]]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj


def test_every_name_in_the_readme_table_exists():
    """The table is how a newcomer finds an equation's code: each dotted name it gives in the
    code column (``reference.layer_norm_backward`` is ``normbook.reference.layer_norm_backward``)
    must resolve. (It once named a kernel removed two redesigns earlier.)"""
    import importlib.util

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Equation, function, chapter"):]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    names = {m for row in rows for m in re.findall(r"`([A-Za-z_][\w.]*\.[\w.]+)`", row.split("|")[3])}
    assert len(names) > 20
    have_triton = importlib.util.find_spec("triton") is not None
    missing = []
    for name in sorted(names):
        if name.removeprefix("normbook.").startswith("kernels") and not have_triton:
            continue
        try:
            _resolve(name)
        except (AttributeError, ImportError) as e:
            missing.append(f"{name} ({e})")
    assert not missing, f"README's table names what the package lacks: {missing}"
