"""The chapters as notebooks that read outside the book (book/_ext/notebooks.py, make notebooks):
no MyST markup left, glued values, equation numbers and included code written in, an install
cell first that does nothing where normbook is installed."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("jupytext")
sys.path.insert(0, str(ROOT / "book" / "_ext"))
notebooks = importlib.import_module("notebooks")
PYPROJECT_URLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]


@pytest.fixture(scope="module")
def index():
    return notebooks.build_index()


def test_the_index_numbers_as_the_book_does(index):
    assert index.pages["01-one-token"].number == 1
    assert index.pages["appendix-kernels"].number is None
    assert index.equations["ln-mean"] == "1.1" and index.equations["ln-dx"].startswith("3.")
    assert index.exercises["ex-derive-ln-backward"] == "3.2"
    assert index.exercises["ex-backward-nodes"] == "3.1"
    # figures as the book numbers them (the front matter's kernelspec name is no figure)
    assert index.figures["fig-why-normalize"] == "1.1"
    assert index.figures["fig-backward-projection"] == "3.1"
    assert index.sections["ch-backward"] == "The backward pass"
    assert index.citations["ba2016layer"] == ("Ba et al.", "2016")
    assert index.citations["zhang2019root"] == ("Zhang and Sennrich", "2019")
    assert index.citations["nvidia2018apex"] == ("NVIDIA", "2018")
    # a group author, in braces, is cited whole ("authors" before)
    assert index.citations["triton2024layernorm"] == ("The Triton authors", "2024")
    assert index.citations["pytorch2024fsdp2"][0] == "The PyTorch authors"
    assert index.macros["xhat"] == r"\hat{x}"


def test_markdown_loses_every_myst_marker(index):
    page = index.pages["03-backward"]
    text = "\n".join([
        "(sec-x)=",
        "## A section",
        "By {eq}`ln-dx`, with {glue}`value` and {cite}`ba2016layer`; {cite:t}`zhang2019root`.",
        "See {ref}`ch-backward`, {ref}`the exercise <ex-derive-ln-backward>`, {numref}`fig-x`,",
        "{ref}`ex-derive-ln-backward` and {math}`\\xhat_d`.",
        "",
        "$$",
        "\\ghat = g \\odot \\gamma",
        "$$ (ln-ghat)",
        "",
        "```{exercise} Try it",
        ":label: ex-derive-ln-backward",
        "",
        "Write it.",
        "```",
        "",
        ":::{dropdown} More",
        "```{literalinclude} ../src/normbook/reference.py",
        ":language: python",
        ":pyobject: layer_norm_token_backward",
        "```",
        ":::",
    ])
    out = notebooks.convert_markdown(text, index, {"value": "0.25"}, page, ROOT / "book")
    assert not notebooks.MYST_MARKERS.search(out), out
    assert f"By ({index.equations['ln-dx']}), with 0.25 and (Ba et al., 2016);" in out
    assert "Zhang and Sennrich (2019)" in out
    assert "[The backward pass](#ch-backward)" in out       # this page: its anchor
    assert "the exercise" in out and "Exercise 3.2 and" in out
    assert '<a id="sec-x"></a>' in out and "$\\hat{x}_d$" in out
    assert f"\\tag{{{index.equations['ln-ghat']}}}" in out and "\\hat{g} = g" in out
    assert "**Exercise 3.2** (Try it)" in out
    assert "<details><summary>More</summary>" in out
    assert "def layer_norm_token_backward(" in out and "```python" in out


def test_a_directive_inside_a_list_item_is_converted_in_place(index):
    """The appendix includes kernel helpers inside a list item: indented directives convert
    too, and their output keeps the item's indentation."""
    text = "\n".join([
        "- The ring:",
        "",
        "  ```{literalinclude} ../src/normbook/reference.py",
        "  :language: python",
        "  :pyobject: layer_norm_token_backward",
        "  ```",
        "",
        "- next item",
    ])
    out = notebooks.convert_markdown(text, index, {}, index.pages["03-backward"], ROOT / "book")
    assert "literalinclude" not in out and not notebooks.MYST_MARKERS.search(out), out
    assert "\n  ```python\n  def layer_norm_token_backward(" in out


def test_references_to_other_pages_link_to_the_book_s_site(index):
    """{ref} to another page's section and {doc} become links to the rendered book, where a
    bare title ("RMSNorm (“RMSNorm”)") led nowhere."""
    out = notebooks.convert_markdown("See {ref}`ch-rmsnorm` and {doc}`the notation <notation>`.",
                                     index, {}, index.pages["03-backward"], ROOT / "book")
    site = notebooks.SITE
    assert out == (f"See [RMSNorm]({site}book/05-rmsnorm.html#ch-rmsnorm) and "
                   f"[the notation]({site}book/notation.html).")
    assert site == PYPROJECT_URLS["Documentation"]


def test_a_labelled_equation_keeps_its_block_whole(index):
    """The number of a labelled equation goes inside the block that holds it: the boxed
    LayerNorm backward (3.4) sits in an admonition, whose quoting ended above its \\tag and
    closing $$ (the equation showed as raw TeX in Jupyter); in a list item, at its indent."""
    page = index.pages["03-backward"]
    boxed = "\n".join([":::{admonition} The result", "$$", "dx = 1", "$$ (ln-dx)",
                       "", "Three terms.", ":::"])
    out = notebooks.convert_markdown(boxed, index, {}, page, ROOT / "book")
    lines = out.splitlines()
    assert lines[0].startswith("> **The result")
    assert all(l.startswith(">") for l in lines), out
    assert f"> \\tag{{{index.equations['ln-dx']}}}" in lines
    item = "\n".join(["- A point:", "", "  $$", "  dx = 1", "  $$ (ln-dx)", "", "- next"])
    out = notebooks.convert_markdown(item, index, {}, page, ROOT / "book")
    assert f"\n  \\tag{{{index.equations['ln-dx']}}}\n  $$\n" in out, out


def test_the_execution_table_points_to_the_book(index):
    out = notebooks.convert_markdown("```{nb-exec-table}\n```", index, {},
                                     notebooks.Page("status", None, "Execution status"),
                                     ROOT / "book")
    assert out == f"(The table is on the book's page: [Execution status]({notebooks.SITE}" \
                  "book/status.html).)"


def test_a_missing_glued_value_is_an_error(index):
    with pytest.raises(KeyError, match="no glued value"):
        notebooks.convert_markdown("{glue}`nope`", index, {}, index.pages["01-one-token"],
                                   ROOT / "book")


@pytest.mark.slow
def test_a_chapter_converts_whole(index, tmp_path):
    """Chapter 3 through the command make notebooks runs, its glued values computed by running
    it (in its own process): an install cell first, no marker in any markdown cell, the folded
    cells folded, the listing inlined."""
    import os

    import nbformat

    out = tmp_path / "notebooks"
    run = subprocess.run([sys.executable, str(ROOT / "book/_ext/notebooks.py"), str(out),
                          str(ROOT / "book/03-backward.md")], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "MPLBACKEND": "Agg"})
    assert run.returncode == 0, run.stdout + run.stderr
    nb = nbformat.read(out / "03-backward.ipynb", as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "code" and "pip" in first.source and "normbook[book]" in first.source
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert not notebooks.MYST_MARKERS.search(markdown)
    assert "def layer_norm_rows_backward(" in markdown
    assert "**Exercise 3.1**" in markdown and "\\tag{3.4}" in markdown
    hidden = [c for c in nb.cells if c.cell_type == "code"
              and "remove-cell" in c.metadata.get("tags", [])]
    assert hidden and all(c.metadata["jupyter"]["source_hidden"] for c in hidden)
    assert all(c.metadata["jupyter"]["outputs_hidden"] and c.metadata["cellView"] == "form"
               for c in hidden)


def test_the_install_cell_does_nothing_where_normbook_is_installed(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pip was called although normbook is installed")

    monkeypatch.setattr(subprocess, "run", refuse)
    exec(notebooks.INSTALL_CELL, {})


def test_the_install_cell_adds_only_the_missing_extra_beside_a_plain_install(monkeypatch):
    """normbook installed without its "book" extra (a plain pip install, then a downloaded
    notebook): the cell installs the extra's missing packages by name, not normbook again."""
    import importlib.metadata as md

    calls, version = [], md.version

    def without_matplotlib(name):
        if name == "matplotlib":
            raise md.PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(md, "version", without_matplotlib)
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: calls.append(args))
    exec(notebooks.INSTALL_CELL, {})
    assert len(calls) == 1 and calls[0][-1] == "matplotlib" and "normbook" not in " ".join(calls[0])


def test_a_kernel_chapter_installs_triton_and_pins_the_commit(monkeypatch):
    """A chapter that runs the kernels (chapter 9, say) installs the "kernels" extra too: in a
    fresh session normbook[book,kernels] from the commit the notebook was built from (the book
    workflow's GITHUB_SHA), beside a plain install only Triton where it is missing (on Linux,
    where its wheels are). The other chapters keep the "book" extra alone."""
    import importlib.metadata as md
    import importlib.util

    import nbformat

    code = nbformat.v4.new_code_cell("WHY_NOT = why_no_kernels()")
    monkeypatch.setenv("GITHUB_SHA", "0123abc")
    nb = notebooks.convert_notebook(nbformat.v4.new_notebook(cells=[code]), "09-kernels", {})
    cell = nb.cells[0].source
    assert "normbook[book,kernels] @ git+https://github.com/normbook/normbook@0123abc" in cell
    plain = nbformat.v4.new_code_cell("import torch")
    nb = notebooks.convert_notebook(nbformat.v4.new_notebook(cells=[plain]), "01-one-token", {})
    assert "normbook[book] @ git+https://github.com/normbook/normbook@0123abc" in nb.cells[0].source

    calls, version, find_spec = [], md.version, importlib.util.find_spec
    monkeypatch.setattr(md, "version", lambda name: (_ for _ in ()).throw(
        md.PackageNotFoundError(name)) if name == "triton" else version(name))
    monkeypatch.setattr(md, "requires", lambda name: ['matplotlib; extra == "book"',
                                                      'triton>=3.6; sys_platform == "linux" and extra == "kernels"'])
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: calls.append(args))
    monkeypatch.setattr(sys, "platform", "linux")
    exec(cell, {})
    assert len(calls) == 1 and calls[0][-1] == "triton"
    monkeypatch.setattr(sys, "platform", "darwin")          # no Triton wheels: nothing to do
    exec(cell, {})
    assert len(calls) == 1
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "normbook" else find_spec(name, *a))
    exec(cell, {})                                          # a fresh session: all of it, pinned
    assert calls[-1][-1] == "normbook[book,kernels] @ git+https://github.com/normbook/normbook@0123abc"


def test_every_chapter_that_runs_a_kernel_installs_triton():
    """The download's install cell follows KERNEL_CELLS: every chapter with a code cell that
    puts tensors where the kernels run (``kernel_device()``) must be recognised by it, however
    the cell asks whether the kernels are there, or its notebook would come without Triton and
    skip the kernel."""
    chapters = notebooks.chapter_sources()
    assert ROOT / "book" / "05-rmsnorm.md" in chapters and ROOT / "book" / "appendix-kernels.md" in chapters
    for path in chapters:
        cells = [c.source for c in notebooks.code_cells(path)]
        if any("kernel_device(" in c for c in cells):
            assert any(notebooks.KERNEL_CELLS.search(c) for c in cells), path.name


def test_the_builds_checks_of_placeholders_stay_out_of_the_readers_notebook():
    """A cell that asserts an exercise's placeholder fails its check is the build's: tagged
    book-only, and the notebook the reader downloads leaves it out (there it would fail as
    soon as the reader's answer is right), while a plain removed cell is kept, folded."""
    import re

    import nbformat

    for page in sorted((ROOT / "book").glob("*.md")):
        for cell in re.findall(r"^```\{code-cell\}[^\n]*\n(.*?)^```$", page.read_text(),
                               re.S | re.M):
            if re.search(r"assert not \(?(stub_|[a-z_0-9]+_ok\b)", cell):
                assert cell.startswith(":tags: [remove-cell, book-only]"), (page.name, cell)
    build = nbformat.v4.new_code_cell("assert not mine_ok", metadata={
        "tags": ["remove-cell", "book-only"]})
    folded = nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["remove-cell"]})
    nb = notebooks.convert_notebook(nbformat.v4.new_notebook(cells=[build, folded]),
                                    "01-one-token", {})
    sources = [c.source for c in nb.cells]
    assert "assert not mine_ok" not in sources and "x = 1" in sources


def test_the_download_shows_a_cell_s_streams_once():
    """myst-nb's stream merge (nb_merge_streams) appends a cell's later stream outputs to its
    first in place and leaves them in the executed notebook it writes: the download repeated
    them (a row of chapter 9's table twice). The book's extension drops them where the first
    already holds them, and only there."""
    import nbformat
    pytest.importorskip("sphinxcontrib.bibtex")
    coalesce_streams = pytest.importorskip("myst_nb.core.utils").coalesce_streams

    sphinx_ext = importlib.import_module("normbook_sphinx")
    texts = ["head\n   4096  2.3e+01\n", "   40960  2.5e+01\n", "\n"]

    def cell():
        return nbformat.v4.new_code_cell(outputs=[
            nbformat.v4.new_output("stream", name="stdout", text=t) for t in texts])

    rendered = nbformat.v4.new_notebook(cells=[cell()])
    shown = coalesce_streams(rendered.cells[0].outputs)      # what the page shows
    sphinx_ext._merged_as_rendered(rendered)                  # what the download keeps
    assert [o.text for o in rendered.cells[0].outputs] == [o.text for o in shown]
    assert len(shown) == 1 and shown[0].text.count("40960") == 1
    untouched = nbformat.v4.new_notebook(cells=[cell()])     # never merged: all stay
    sphinx_ext._merged_as_rendered(untouched)
    assert [o.text for o in untouched.cells[0].outputs] == texts
