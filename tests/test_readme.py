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
