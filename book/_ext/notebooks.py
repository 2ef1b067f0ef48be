"""The chapters as notebooks that read outside the book: ``make notebooks``.

A chapter is a MyST notebook: its prose holds roles (``{glue}``, ``{eq}``, ``{cite}``, ``{ref}``,
``{numref}``), directives (``literalinclude``, ``exercise``, ``solution``, ``dropdown``,
``admonition``) and labelled equations that only the book's Sphinx build resolves. Opened in
Jupyter, Colab or Binder those would show as raw markup. This module writes each chapter as a
plain notebook instead:

- glued values written in as text (from the book build's ``<stem>.glue.json`` when given,
  otherwise by running the chapter's code here, where ``normbook.booktools.claim`` records them);
- an equation reference as its number, ``(3.4)``, and each labelled equation with its number
  (``\\tag``); the book's MathJax macros (``\\xhat``...) spelled out;
- citations as "(Ba et al., 2016)", cross-references as the section's title, "Figure 3.1" or
  "Exercise 3.2";
- package code a chapter includes (``literalinclude`` with ``:pyobject:``) inlined as a code block;
- exercises, solutions, admonitions and dropdowns as plain Markdown (solutions and dropdowns in
  ``<details>``, which Jupyter and Colab fold);
- a first cell that installs normbook with the ``book`` extra, or only the extra's packages
  beside normbook installed without it (it is not on PyPI), where they are missing.

Needs jupytext and nbformat, plus (to compute glued values without a built book) what the
chapters import: the package with its ``book`` extra. Numbers follow the book's: chapters are
numbered in ``_toc.yml``'s order, equations, figures and exercises within each chapter.

Usage: ``python book/_ext/notebooks.py OUT_DIR [--glue DIR] [CHAPTER.md ...]``; with ``--run``,
``python book/_ext/notebooks.py --run CLAIMS.json CHAPTER.md ...`` only executes the chapters,
each cell as Jupyter runs it (:func:`run_cell`), with neither jupytext nor IPython needed:
``benchmarks/gpu_check.sh`` runs chapter 9 so on a GPU.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import itertools
import json
import linecache
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = "https://github.com/normbook/normbook"
SITE = "https://normbook.github.io/normbook/"     # the rendered book (pyproject's Documentation)


def install_cell(kernels: bool = False, ref: str | None = None) -> str:
    """The notebook's first cell: installs normbook with its "book" extra (and "kernels", Triton
    on Linux, for a chapter that runs the kernels) where missing. ``ref`` pins the git install
    to the commit the notebook was built from (the book workflow's ``GITHUB_SHA``), so that a
    notebook downloaded later still gets the package its text was computed with."""
    extras = ("book", "kernels") if kernels else ("book",)
    source = f"git+{REPOSITORY}" + (f"@{ref}" if ref else "")
    if kernels:
        comment = """\
# Runs this chapter anywhere: installs normbook, what the chapters import (its "book" extra)
# and Triton ("kernels", on Linux) where they are missing: all of it in a fresh Colab or
# Binder session, only the extras' packages beside normbook installed without them, nothing
# when all are present."""
    else:
        comment = """\
# Runs this chapter anywhere: installs normbook and what the chapters import (its "book"
# extra) where they are missing: all of it in a fresh Colab or Binder session, only the
# extra's packages beside normbook installed without it, nothing when all are present."""
    return comment + f"""
import importlib.metadata as md, importlib.util, re, subprocess, sys
def _missing(name):
    try:
        return not md.version(name)
    except md.PackageNotFoundError:
        return True
if importlib.util.find_spec("normbook") is None:
    _pip = ["normbook[{",".join(extras)}] @ {source}"]
else:
    _pip = [n for r in md.requires("normbook") or () for e in {extras!r}
            if f'extra == "{{e}}"' in r and (e != "kernels" or sys.platform == "linux")
            for n in [re.match(r"[\\w.-]+", r)[0]] if _missing(n)]
if _pip:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *_pip], check=True)"""


INSTALL_CELL = install_cell()
KERNEL_CELLS = re.compile(r"why_no_kernels\(|normbook\.kernels|import triton")   # its cells


# -------------------------------------------------------------------------- the book's index


@dataclass
class Page:
    stem: str
    number: int | None                    # chapter number, None outside the numbered part
    title: str = ""


@dataclass
class Index:
    """What the book's references resolve to: numbers and titles, from the sources."""

    pages: dict[str, Page] = field(default_factory=dict)
    equations: dict[str, str] = field(default_factory=dict)    # label -> "3.4"
    figures: dict[str, str] = field(default_factory=dict)      # name -> "3.1"
    exercises: dict[str, str] = field(default_factory=dict)    # label -> "3.2"
    sections: dict[str, str] = field(default_factory=dict)     # label -> title
    section_pages: dict[str, str] = field(default_factory=dict)  # label -> its page's stem
    citations: dict[str, tuple[str, str]] = field(default_factory=dict)  # key -> (authors, year)
    macros: dict[str, str] = field(default_factory=dict)       # "xhat" -> "\\hat{x}"


def toc_pages(root: Path = ROOT) -> list[Page]:
    """The pages of ``_toc.yml`` in order; the first part ("numbered: true") numbered 1, 2, ..."""
    pages, number, numbered = [], 0, False
    for line in (root / "_toc.yml").read_text().splitlines():
        if re.match(r"\s*- caption:", line):
            numbered = False
        elif re.match(r"\s*numbered:\s*true", line):
            numbered = True
        elif m := re.match(r"\s*- file:\s*(\S+)", line):
            if numbered:
                number += 1
            pages.append(Page(Path(m.group(1)).name, number if numbered else None))
    return pages


def chapter_sources(root: Path = ROOT) -> list[Path]:
    """The sources of the chapters and the appendix, in ``_toc.yml``'s order: what becomes a
    notebook (the other pages are prose only)."""
    return [root / "book" / f"{p.stem}.md" for p in toc_pages(root)
            if re.match(r"\d\d-|appendix-", p.stem)]


def _prefix(page: Page, k: int) -> str:
    return f"{page.number}.{k}" if page.number is not None else str(k)


_LABEL_LINE = re.compile(r"^\(([\w-]+)\)=\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")


def build_index(root: Path = ROOT) -> Index:
    index = Index()
    for page in toc_pages(root):
        source = root / "book" / f"{page.stem}.md"
        if not source.is_file():
            continue
        text = source.read_text()
        index.pages[page.stem] = page
        lines = text.splitlines()
        for i, line in enumerate(lines):                 # (label)= then a heading: its title
            m = _LABEL_LINE.match(line)
            if m:
                for nxt in lines[i + 1:i + 4]:
                    h = _HEADING.match(nxt)
                    if h:
                        index.sections[m.group(1)] = _plain_title(h.group(2))
                        index.section_pages[m.group(1)] = page.stem
                        break
        h = next((_HEADING.match(l) for l in lines if _HEADING.match(l) and
                  _HEADING.match(l).group(1) == "#"), None)
        page.title = _plain_title(h.group(2)) if h else page.stem
        for k, label in enumerate(re.findall(r"\$\$[ \t]*\(([\w-]+)\)", text), 1):
            index.equations[label] = _prefix(page, k)
        body = re.sub(r"\A---\n.*?\n---\n", "", text, flags=re.S)  # not the kernelspec's name
        figures = re.findall(r"^\s*name:\s*([\w-]+)\s*$", body, re.M)   # mystnb figure names
        for k, name in enumerate(figures, 1):
            index.figures[name] = _prefix(page, k)
        exercises = re.findall(r"^[`:]{3,}\{exercise\}.*\n(?:\s*:[\w-]+:.*\n)*?\s*:label:\s*([\w-]+)",
                               text, re.M)
        for k, label in enumerate(exercises, 1):
            index.exercises[label] = _prefix(page, k)
    index.citations = _bibliography((root / "book" / "references.bib").read_text())
    index.macros = dict(re.findall(r"^\s+(\w+):\s*'([^']*)'\s*$", _macros_block(root), re.M))
    return index


def _macros_block(root: Path) -> str:
    config = (root / "_config.yml").read_text()
    m = re.search(r"^\s+macros:\s*\n((?:\s{8,}.*\n)+)", config, re.M)
    return m.group(1) if m else ""


def _plain_title(title: str) -> str:
    return re.sub(r"\{[\w:-]+\}`([^`]*)`", r"\1", title)


def _surname(name: str) -> str:
    """How one author is cited: "Ba" for "Ba, Jimmy Lei" or "Jimmy Lei Ba"; a name in braces,
    BibTeX's group author ("{The Triton authors}"), whole."""
    if name.startswith("{") and name.endswith("}"):
        return name[1:-1]
    name = name.strip("{}")
    return name.split(",")[0].strip() if "," in name else name.split()[-1]


def _bibliography(bib: str) -> dict[str, tuple[str, str]]:
    """key -> (authors as cited, year): "Ba et al.", "Zhang and Sennrich", "NVIDIA"."""
    out = {}
    for m in re.finditer(r"@\w+\{([\w:-]+),(.*?)\n\}", bib, re.S):
        key, body = m.group(1), m.group(2)
        author = re.search(r"author\s*=\s*\{(.*?)\}\s*,?\s*$", body, re.M)
        year = re.search(r"year\s*=\s*\{?(\d{4})", body)
        names = [a.strip() for a in (author.group(1) if author else key).split(" and ")]
        last = [_surname(n) for n in names if n != "others"]
        if len(last) == 1 and "others" not in names:
            cited = last[0]
        elif len(last) == 2 and "others" not in names:
            cited = f"{last[0]} and {last[1]}"
        else:
            cited = f"{last[0]} et al."
        out[key] = (cited, year.group(1) if year else "n.d.")
    return out


# -------------------------------------------------------------------------- glued values


def glue_from_build(stem: str, directory: Path) -> dict[str, str] | None:
    """The values the book build glued (myst-nb's ``<stem>.glue.json``), or None."""
    path = directory / f"{stem}.glue.json"
    if not path.is_file():
        return None
    return {name: "".join(out["data"]["text/plain"])
            for name, out in json.loads(path.read_text()).items()}


def without_magics(source: str) -> str:
    """A cell's Python: its IPython magics and shell lines (``%...``, ``!...``) dropped."""
    return "\n".join(l for l in source.splitlines() if not l.lstrip().startswith(("%", "!")))


_RUN = itertools.count(1)       # cells run in this process: each gets a file name of its own


def run_cell(source: str, namespace: dict, name: str) -> None:
    """Execute one cell's source in ``namespace`` as Jupyter does: its source registered in
    ``linecache`` under a file name of its own (``name``, made unique here) before it is
    compiled, so that ``inspect.getsource`` finds the functions it defines and tracebacks show
    its lines. Triton's ``@triton.jit`` reads a kernel's source when it decorates (a compiled
    JITFunction; the interpreter's does not): without this a chapter's kernel cell fails with
    "@jit functions should be defined in a Python file" on a GPU."""
    filename = f"<{name} #{next(_RUN)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)


def _numbered(cell, name: str, k: int) -> tuple[str, str]:
    """(source, name) of code cell ``k`` for :func:`run_cell`: a cell read by
    :func:`code_cells` knows its first line in the chapter's .md, and its source is shifted
    there, so that a traceback's line number is the .md's ("<04-invariances.md cell 4 #9>",
    line 236)."""
    line = getattr(cell, "line", None)
    if line is None:
        return cell.source, f"{name} cell {k}"
    return "\n" * (line - 1) + cell.source, f"{name}.md cell {k}"


def glue_by_running(cells: list, name: str = "chapter", where: Path | None = None
                    ) -> dict[str, str]:
    """Run a chapter's code cells here (magics dropped, each by :func:`run_cell`, named
    "<``name`` cell k #n>" in tracebacks) and return what ``claim`` recorded. ``where``: the
    folder they run in, the book's source by default (where the book build runs them);
    another, outside the repository, runs them as a downloaded notebook is run."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    from normbook import booktools

    booktools.CLAIMED.clear()
    namespace: dict = {"__name__": "__chapter__"}
    here = os.getcwd()
    os.chdir(ROOT / "book" if where is None else where)   # where the book build runs it
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            for k, cell in enumerate((c for c in cells if c.cell_type == "code"), 1):
                source, cell_name = _numbered(cell, name, k)
                run_cell(without_magics(source), namespace, cell_name)
    finally:
        os.chdir(here)
        import matplotlib.pyplot as plt
        plt.close("all")
    return dict(booktools.CLAIMED)


# -------------------------------------------------------------------------- Markdown


def _literalinclude(path: str, options: dict[str, str], base: Path) -> str:
    source = (base / path).resolve().read_text()
    name = options.get("pyobject")
    if name:
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) \
                    and node.name == name.split(".")[-1]:
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                source = "\n".join(lines[start - 1:node.end_lineno])
                break
        else:
            raise ValueError(f"literalinclude: no {name} in {path}")
    language = options.get("language", "")
    return f"```{language}\n{source.rstrip()}\n```"


_DIRECTIVE = re.compile(      # at any indentation: inside a list item too
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|:{3,})\{(?P<name>[\w:-]+)\}[ \t]*(?P<arg>[^\n]*)\n"
    r"(?P<opts>(?:[ \t]*:[\w-]+:[^\n]*\n)*)"
    r"(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$", re.S | re.M)


def _options(block: str) -> dict[str, str]:
    return dict(re.findall(r"^[ \t]*:([\w-]+):[ \t]*(.*?)[ \t]*$", block, re.M))


def convert_markdown(text: str, index: Index, glue: dict[str, str], page: Page,
                     base: Path) -> str:
    """A markdown cell of a chapter as plain Markdown (see the module's docstring)."""
    def directive(m: re.Match) -> str:
        indent = m.group("indent")
        if not indent:
            return converted(m)
        # a directive inside a list item: converted without its indentation, then put back
        out = converted(m)
        return "\n".join(indent + line if line else line for line in out.split("\n"))

    def converted(m: re.Match) -> str:
        name, arg = m.group("name"), m.group("arg").strip()
        indent = m.group("indent")
        body = m.group("body")
        if indent:
            body = "\n".join(line[len(indent):] if line.startswith(indent) else line
                             for line in body.split("\n"))
        opts = _options(m.group("opts"))
        body = _DIRECTIVE.sub(directive, body).strip("\n")
        if name == "literalinclude":
            return _literalinclude(arg, opts, base)
        if name == "exercise":
            number = index.exercises.get(opts.get("label", ""), "")
            head = f"**Exercise {number}**" + (f" ({arg})" if arg else "")
            return f"{head}\n\n{body}"
        if name == "solution":
            number = index.exercises.get(arg, "")
            return (f"<details><summary>Solution to Exercise {number}</summary>\n\n{body}\n\n"
                    "</details>")
        if name == "solution-start":
            return f"**Solution to Exercise {index.exercises.get(arg, '')}.**"
        if name == "solution-end":
            return "*End of the solution.*"
        if name == "dropdown" or opts.get("class", "") == "dropdown":
            title = arg or name.capitalize()
            return f"<details><summary>{title}</summary>\n\n{body}\n\n</details>"
        if name in ("admonition", "note", "tip", "warning", "important", "hint", "seealso"):
            title = arg or name.capitalize()
            quoted = "\n".join(f"> {l}" if l else ">" for l in body.splitlines())
            return f"> **{title}.**\n>\n{quoted}"
        if name == "math":
            return f"$$\n{body}\n$$"
        if name == "nb-exec-table":                   # made by the build: on the book's page
            return f"(The table is on the book's page: [{page.title}]({_url(page.stem)}).)"
        return body                                   # anything else: its content

    def equation(m: re.Match) -> str:
        # its number as \tag, at the closing $$'s indent (a list item's), before the directives
        # are converted, so that an admonition quotes the whole equation
        number = index.equations.get(m.group(2), "")
        body = m.group(1)
        indent = re.fullmatch(r"(?s).*\n([ \t]*)", body)
        pad = indent.group(1) if indent else ""
        return f"$${body.rstrip()}\n{pad}\\tag{{{number}}}\n{pad}$$"
    text = re.sub(r"\$\$(.*?)\$\$[ \t]*\(([\w-]+)\)", equation, text, flags=re.S)
    text = _DIRECTIVE.sub(directive, text)
    text = re.sub(r"^\(([\w-]+)\)=[ \t]*$", r'<a id="\1"></a>', text, flags=re.M)

    def role(m: re.Match) -> str:
        name, content = m.group(1), m.group(2)
        shown, target = _split_target(content)
        if name == "glue":
            if content not in glue:
                raise KeyError(f"{page.stem}: no glued value {content!r}")
            return glue[content]
        if name == "eq":
            return f"({index.equations.get(target, target)})"
        if name == "numref":
            return f"Figure {index.figures.get(target, target)}"
        if name in ("cite", "cite:p", "cite:t"):
            refs = [index.citations.get(k.strip(), (k.strip(), "")) for k in content.split(",")]
            if name == "cite:t":
                return "; ".join(f"{a} ({y})" for a, y in refs)
            return "(" + "; ".join(f"{a}, {y}" for a, y in refs) + ")"
        if name == "ref":
            if target in index.exercises:
                return shown or f"Exercise {index.exercises[target]}"
            if target in index.figures:
                return shown or f"Figure {index.figures[target]}"
            title = shown or index.sections.get(target, target)
            where = index.section_pages.get(target)
            if where is None:
                return title
            # a section of this notebook by its anchor; of another page, on the book's site
            return f"[{title}]({'' if where == page.stem else _url(where)}#{target})"
        if name == "doc":
            stem = Path(target).name
            title = shown or index.pages.get(stem, Page(target, None)).title or target
            return f"[{title}]({_url(stem)})"
        if name == "math":
            return f"${content}$"
        return f"`{shown or content}`"                 # {py:mod}, {py:func}, ...
    text = re.sub(r"\{([\w:-]+)\}`([^`]*)`", role, text)

    for macro, expansion in index.macros.items():    # the book's MathJax macros, spelled out
        text = re.sub(rf"\\{macro}(?![A-Za-z])", lambda _m, e=expansion: e, text)
    return text


def _url(stem: str) -> str:
    """A page of the rendered book (every page lives in its book/ folder)."""
    return f"{SITE}book/{stem}.html"


def _split_target(content: str) -> tuple[str, str]:
    """``text <target>`` -> (text, target); ``target`` -> ("", target)."""
    m = re.fullmatch(r"\s*(.*?)\s*<([^>]+)>\s*", content, re.S)
    return (m.group(1), m.group(2)) if m else ("", content.strip())


# Markup that only the book's build understands; none of it may survive the conversion.
MYST_MARKERS = re.compile(
    r"\{[\w:-]+\}`|^[`:]{3,}\{[\w:-]+\}|^\([\w-]+\)=\s*$|\$\$[ \t]*\([\w-]+\)", re.M)


# -------------------------------------------------------------------------- notebooks


def convert_notebook(nb, stem: str, glue: dict[str, str], index: Index | None = None,
                     base: Path = ROOT / "book"):
    """A chapter's notebook (from jupytext, or executed by the book build, outputs kept) with
    its markdown converted, its removed and folded cells folded, figure captions added and
    the install cell first. Raises ValueError where MyST markup would survive."""
    import nbformat

    index = index or build_index()
    page = index.pages.get(stem, Page(stem, None))
    kernels = any(KERNEL_CELLS.search(c.source) for c in nb.cells if c.cell_type == "code")
    cells = [nbformat.v4.new_code_cell(install_cell(kernels, os.environ.get("GITHUB_SHA")))]
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = convert_markdown(cell.source, index, glue, page, base)
            leftover = MYST_MARKERS.search(cell.source)
            if leftover:
                raise ValueError(f"{stem}: MyST markup left after conversion: "
                                 f"{cell.source[leftover.start():leftover.start() + 60]!r}")
            cells.append(cell)
            continue
        meta = cell.metadata
        tags = set(meta.get("tags", []))
        if "book-only" in tags:   # the build's own check of an exercise's blank placeholder:
            continue              # in the reader's notebook it would fail once they fill it in
        if tags & {"remove-cell", "remove-input", "hide-input", "hide-cell"}:
            meta.setdefault("jupyter", {})["source_hidden"] = True   # folded in Jupyter
            meta["cellView"] = "form"                                 # and in Colab
        if tags & {"remove-cell", "remove-output"}:
            # what the page leaves out entirely: its output folded too (a last line such as
            # claim(...) returns the value it glued, which Jupyter would print)
            meta.setdefault("jupyter", {})["outputs_hidden"] = True
        figure = (meta.get("mystnb") or {}).get("figure") or {}
        cells.append(cell)
        if figure.get("caption"):
            number = index.figures.get(figure.get("name", ""), "")
            caption = convert_markdown(figure["caption"], index, glue, page, base)
            cells.append(nbformat.v4.new_markdown_cell(f"*Figure {number}.* {caption.strip()}"))
    nb.cells = cells
    nb.metadata.pop("jupytext", None)
    nb.metadata.setdefault("kernelspec", {"display_name": "Python 3", "language": "python",
                                          "name": "python3"})
    return nb


def convert(source: Path, index: Index | None = None, glue_dir: Path | None = None):
    """One chapter (a MyST .md) as an nbformat notebook that reads without the book: glued
    values from ``glue_dir`` (a built book's) when it has them, else by running the chapter."""
    import jupytext

    nb = jupytext.read(source)
    glue = glue_from_build(source.stem, glue_dir) if glue_dir else None
    if glue is None:
        glue = glue_by_running(nb.cells, source.stem)
    return convert_notebook(nb, source.stem, glue, index, source.parent)


def code_cells(source: Path) -> list:
    """A chapter's code cells in order, read without jupytext (the GPU machine has none): each
    ``{code-cell}`` fence's body, its metadata lines (``:tags:``, a ``---`` block) left out."""
    from types import SimpleNamespace

    cells = []
    text = source.read_text()
    for m in re.finditer(r"^```\{code-cell\}[^\n]*\n(.*?)^```[ \t]*$", text, re.S | re.M):
        body = m.group(1)
        skipped = 0                       # metadata lines before the source
        if body.startswith("---\n"):
            meta, body = body[4:].split("\n---\n", 1)
            skipped = meta.count("\n") + 3   # the two fences and the lines between
        lines = body.splitlines()
        while lines and re.match(r":[\w-]+:", lines[0]):
            lines.pop(0)
            skipped += 1
        cells.append(SimpleNamespace(cell_type="code", source="\n".join(lines),
                                     line=text.count("\n", 0, m.start(1)) + 1 + skipped))
    return cells


def run_chapter(source: Path, where: Path | None = None) -> dict[str, str]:
    """Execute a chapter's code here, top to bottom (as ``gpu_check.sh`` does on a GPU); return
    its claims. Raises whatever a cell raises, an AssertionError for a claim that fails.
    ``where``: see :func:`glue_by_running`."""
    return glue_by_running(code_cells(source), source.stem, where)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python book/_ext/notebooks.py",
        description="Write the book's chapters as plain notebooks (no MyST markup).")
    parser.add_argument("out", type=Path, help="folder for the .ipynb files")
    parser.add_argument("chapters", nargs="*", type=Path,
                        help="chapter sources (default: the chapters and appendix of _toc.yml)")
    parser.add_argument("--run", action="store_true",
                        help="only execute the chapters here (jupytext not needed) and print "
                             "their claims as JSON; OUT is then where the JSON goes")
    parser.add_argument("--glue", type=Path, default=None,
                        help="a built book's jupyter_execute/book folder: take glued values "
                             "from its <stem>.glue.json instead of running the chapters")
    args = parser.parse_args(argv)
    missing = [str(c) for c in args.chapters if not c.is_file()]
    if missing:      # (a mistyped chapter ended in a FileNotFoundError's traceback)
        parser.error(f"chapters: no such file: {', '.join(missing)}")

    if args.run:
        claims = {}
        for source in args.chapters:
            try:
                claims[source.stem] = run_chapter(source.resolve())
            except Exception:
                # printed by the traceback module, which reads linecache: each frame of a cell
                # with its line (Python's own hook of an uncaught exception reads files only)
                traceback.print_exc()
                print(f"{source}: a cell raised (the last frame's line is the .md's)",
                      file=sys.stderr)
                return 1
            print(f"{source.stem}: ran, {len(claims[source.stem])} claims hold", file=sys.stderr)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(claims, indent=1, ensure_ascii=False))
        return 0
    index = build_index()
    chapters = args.chapters or chapter_sources()
    import nbformat

    args.out.mkdir(parents=True, exist_ok=True)
    for source in chapters:
        nb = convert(source.resolve(), index, args.glue)
        target = args.out / f"{source.stem}.ipynb"
        nbformat.write(nb, target)
        print(f"{source.stem}.ipynb: {len(nb.cells)} cells", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
