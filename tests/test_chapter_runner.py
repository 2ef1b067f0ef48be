"""The chapter runner, ``book/_ext/notebooks.py --run`` (what benchmarks/gpu_check.sh runs on a
GPU, and ``make notebooks`` without a built book): a chapter's cells executed in plain Python as
Jupyter executes them, without Jupyter, jupytext or IPython."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "book" / "_ext" / "notebooks.py"
sys.path.insert(0, str(RUNNER.parent))
notebooks = importlib.import_module("notebooks")

# A chapter of one cell that defines a kernel, as chapter 9 does, and claims what it got
KERNEL_CHAPTER = """\
# A kernel

```{code-cell} ipython3
import inspect

import triton
import triton.language as tl

from normbook.booktools import claim


@triton.jit
def add_one(X, N: tl.constexpr):
    cols = tl.arange(0, N)
    tl.store(X + cols, tl.load(X + cols) + 1)


claim("kind", type(add_one).__name__)
claim("def", inspect.getsource(add_one.fn).splitlines()[1])
```
"""


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``python book/_ext/notebooks.py ARGS`` in a fresh interpreter, Triton's interpreter off
    (it is read once, when triton is imported) unless ``env`` turns it on."""
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(env)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full,
                          timeout=300)


def test_a_cell_defines_a_compiled_triton_kernel(tmp_path):
    """With the interpreter off (a GPU's run), ``@triton.jit`` makes a JITFunction, which reads
    the kernel's source when it decorates: the runner registers each cell's source in linecache,
    as Jupyter does, so ``inspect`` finds it. (Cells compiled as "<chapter cell>" without that
    failed on the H200, 2026-12-04: "@jit functions should be defined in a Python file".)
    Decorating needs no GPU."""
    pytest.importorskip("triton")
    chapter, claims = tmp_path / "kernel.md", tmp_path / "claims.json"
    chapter.write_text(KERNEL_CHAPTER)
    run = _run(str(RUNNER), "--run", str(claims), str(chapter))
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(claims.read_text()) == {
        "kernel": {"kind": "JITFunction", "def": "def add_one(X, N: tl.constexpr):"}}


def test_each_cell_is_its_own_file_in_tracebacks():
    """Cells get file names of their own, and a failing cell's traceback shows its line."""
    cells = [SimpleNamespace(cell_type="code", source=s)
             for s in ("x = 1", "y = 2\nassert x == y, 'the second cell'")]
    with pytest.raises(AssertionError, match="the second cell") as failure:
        notebooks.glue_by_running(cells, "two")
    frame = traceback.extract_tb(failure.value.__traceback__)[-1]
    assert frame.filename.startswith("<two cell 2 #") and frame.lineno == 2
    assert frame.line == "assert x == y, 'the second cell'"


def test_a_chapters_cells_fail_at_their_md_line(tmp_path):
    """Run from its .md (``--run``, the GPU check's chapter step), a failing cell's traceback
    gives the line of the .md and shows it (Python's own hook printed a bare AssertionError
    for a cell's frame); and every cell of the book is found at the line it names."""
    chapter = tmp_path / "99-fails.md"
    chapter.write_text("# A\n\n```{code-cell} ipython3\n:tags: [remove-cell]\nx = 1\n```\n\n"
                       "```{code-cell} ipython3\n---\ntags: [hide-input]\n---\ny = 2\n"
                       "assert x == y, 'the claim'\n```\n")
    run = _run(str(RUNNER), "--run", str(tmp_path / "claims.json"), str(chapter))
    assert run.returncode == 1
    assert '"<99-fails.md cell 2 #' in run.stderr and '", line 13, in <module>' in run.stderr
    assert "    assert x == y, 'the claim'" in run.stderr, run.stderr[-2000:]
    for path in notebooks.chapter_sources():
        lines = path.read_text().splitlines()
        for cell in notebooks.code_cells(path):
            shown = cell.source.splitlines()
            assert lines[cell.line - 1:cell.line - 1 + len(shown)] == shown, (path.name, cell.line)


def _ipython_imports(source: str) -> list[tuple[ast.AST, list[ast.AST]]]:
    """Each import of IPython in ``source``, with the try statements around it."""
    found = []

    def visit(node, tries):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names]
            if any(n.split(".")[0] == "IPython" for n in names):
                found.append((node, tries))
        inner = tries + [node] if isinstance(node, ast.Try) else tries
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.Try) and child in node.handlers + node.orelse + node.finalbody:
                visit(child, tries)            # only the try's body is guarded by it
            else:
                visit(child, inner)

    visit(ast.parse(notebooks.without_magics(source)), [])
    return found


def _catches_import_error(try_node: ast.Try) -> bool:
    names = set()
    for handler in try_node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names |= {k.id for k in kinds if isinstance(k, ast.Name)}
    return bool(names & {"ImportError", "ModuleNotFoundError", "Exception"})


def test_no_chapter_needs_ipython():
    """A chapter imports IPython (to display a table or an image) only where it falls back
    without it: plain Python, as the GPU check's runner and a reader without Jupyter run a
    chapter, has none. The book build always has it, and renders as before."""
    guarded = 0
    for path in notebooks.chapter_sources():
        for k, cell in enumerate(notebooks.code_cells(path), 1):
            for node, tries in _ipython_imports(cell.source):
                assert any(_catches_import_error(t) for t in tries), \
                    f"{path.name}, code cell {k}, line {node.lineno}: IPython imported unguarded"
                guarded += 1
            # or through booktools, whose helpers fall back where no IPython runs
            guarded += len(re.findall(r"\b(?:rich_display|show_image)\(", cell.source))
    assert guarded >= 2      # the appendix's tables, chapter 9's figure: the check sees them


def test_the_appendix_tables_print_without_ipython():
    """The kernel appendix's first cells (its imports, the plans' tables) run without IPython,
    in Triton's interpreter: the tables print as their Markdown text."""
    pytest.importorskip("triton")
    code = f"""
import json, sys
for name in ("IPython", "IPython.display", "myst_nb"):   # no Jupyter here (myst-nb needs IPython)
    sys.modules[name] = None
sys.path.insert(0, {str(RUNNER.parent)!r})
import notebooks
cells = notebooks.code_cells(notebooks.ROOT / "book" / "appendix-kernels.md")[:2]
assert "display(md_table(" in cells[1].source
print(json.dumps(notebooks.glue_by_running(cells, "appendix")))
"""
    run = _run("-c", code, TRITON_INTERPRET="1")
    assert run.returncode == 0, run.stderr[-3000:]
    claims = json.loads(run.stdout.splitlines()[-1])
    assert claims["app_m"].isdigit() and claims["kern_ring"].isdigit()


@pytest.mark.slow
def test_the_closing_chapter_runs_outside_the_repository(tmp_path, monkeypatch):
    """A downloaded notebook runs where no _toc.yml or chapter source is: chapter 11's count
    of the chapters before it read _toc.yml from the checkout and raised StopIteration in its
    second cell there (found by running the converted notebook from /tmp)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    claims = notebooks.run_chapter(ROOT / "book" / "11-closing.md", where=tmp_path)
    assert claims["close_n_before"] == "The"


@pytest.mark.slow
@pytest.mark.parametrize("page", ["intro", "cheatsheet", "status"])
def test_the_other_executed_pages_run_outside_the_repository(page, tmp_path, monkeypatch):
    """The book offers every executed page as a notebook, not only the chapters: the
    introduction's reading times read _toc.yml from the checkout and raised StopIteration in a
    downloaded notebook (found by running the downloads from /tmp)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    notebooks.run_chapter(ROOT / "book" / f"{page}.md", where=tmp_path)


def test_no_page_looks_for_the_book_s_source_without_a_way_out():
    """Where a cell searches the folders above it for the book's source (_toc.yml), it must
    have a default for a downloaded notebook, which has none: ``next(..., None)``."""
    bare = {p.name: n for p in sorted((ROOT / "book").glob("*.md"))
            if (n := len(re.findall(r"next\(p for p in", p.read_text())))}
    assert not bare, bare
