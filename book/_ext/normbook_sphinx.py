"""Small build fixes for the normbook book (a Jupyter Book 1 "local extension").

Listed in ``_config.yml`` under ``sphinx.local_extensions``. Each hook fixes one thing that the
stock stack (jupyter-book 1.0.4, sphinx-book-theme 1.3, sphinx-thebe 0.3.1, Sphinx 7.4) gets
wrong for this book:

- ``.ipynb`` download: sphinx-book-theme only copies a MyST notebook's executed ``.ipynb`` into
  ``_sources/`` (and offers it in the download menu) when a Binder/Colab launch button is
  configured. The book has no launch service, so this writes it itself, converted by
  ``notebooks.py`` so that it reads outside the book (no MyST markup, glued values written in,
  an install cell first).
- Duplicate ``<script>`` tags: sphinx-thebe adds its configuration script twice under Sphinx 7.4,
  and the second ``const THEBE_JS_URL`` is a JavaScript SyntaxError on every page.
- Triton missing: ``normbook.kernels`` imports triton. Where triton cannot be installed (macOS),
  autodoc documents the kernels against a stand-in (``autodoc_mock_imports``) so the API page
  still builds; the page says so.
- Citations as "(Ba et al., 2016)": the ``author_year_round`` referencing style, and an
  author-year label style for the bibliography.
- The version: Sphinx's ``version`` and ``release`` are the package's (pyproject.toml, through
  the installed metadata), as is this extension's.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

import notebooks   # book/_ext/notebooks.py: the chapters as plain notebooks
import sphinxcontrib.bibtex.plugin
from pybtex.plugin import register_plugin
from pybtex.style.formatting.plain import Style as PlainStyle
from pybtex.style.labels import BaseLabelStyle
from sphinxcontrib.bibtex.style.referencing import BracketStyle
from sphinxcontrib.bibtex.style.referencing.author_year import AuthorYearReferenceStyle


# -- citations ---------------------------------------------------------------------------------

def _round() -> BracketStyle:
    return BracketStyle(left="(", right=")")


@dataclass
class RoundAuthorYearStyle(AuthorYearReferenceStyle):
    """{cite}`key` -> (Ba et al., 2016); {cite:t}`key` -> Ba et al. (2016)."""

    bracket_parenthetical: BracketStyle = field(default_factory=_round)
    bracket_textual: BracketStyle = field(default_factory=_round)
    bracket_author: BracketStyle = field(default_factory=_round)
    bracket_label: BracketStyle = field(default_factory=_round)
    bracket_year: BracketStyle = field(default_factory=_round)


class AuthorYearLabels(BaseLabelStyle):
    """Bibliography labels "Ba et al. 2016", "Zhang & Sennrich 2019", "van Laarhoven 2017"."""

    def format_labels(self, sorted_entries):
        for entry in sorted_entries:
            people = entry.persons.get("author") or entry.persons.get("editor") or []
            # "van Laarhoven", as the text cites him (sorted under L, as plain sorts)
            last = [" ".join(p.prelast_names + p.last_names) for p in people]
            if len(last) == 1:
                who = last[0]
            elif len(last) == 2:
                who = f"{last[0]} & {last[1]}"
            else:
                who = f"{last[0]} et al." if last else entry.key
            who = who.replace("{", "").replace("}", "")
            yield f"{who} {entry.fields.get('year', '')}".strip()


class NormbookStyle(PlainStyle):
    """pybtex's plain style (sorted by author, year, title) with author-year labels."""

    default_label_style = "normbook_author_year"


register_plugin("pybtex.style.labels", "normbook_author_year", AuthorYearLabels)
register_plugin("pybtex.style.formatting", "normbook", NormbookStyle)
sphinxcontrib.bibtex.plugin.register_plugin(
    "sphinxcontrib.bibtex.style.referencing", "author_year_round", RoundAuthorYearStyle
)


# -- hooks -------------------------------------------------------------------------------------

def normbook_version() -> str:
    """The package's version: pyproject.toml's, from the installed metadata (or, in a checkout
    that was never installed, what ``normbook.__version__`` finds)."""
    try:
        return importlib.metadata.version("normbook")
    except importlib.metadata.PackageNotFoundError:
        import normbook

        return normbook.__version__


def _set_version(app, config):
    if not config.release:
        config.release = normbook_version()
    if not config.version:
        config.version = config.release


def _mock_triton_if_missing(app, config):
    if importlib.util.find_spec("triton") is None:
        config.autodoc_mock_imports = [*config.autodoc_mock_imports, "triton"]


def _executed_notebook(app, pagename):
    """The executed .ipynb of a MyST-notebook page, or None for any other page."""
    if "kernelspec" not in app.env.metadata.get(pagename, {}):
        return None
    executed = Path(app.outdir).parent / "jupyter_execute" / f"{pagename}.ipynb"
    return executed if executed.is_file() else None


def _offer_ipynb(app, pagename, templatename, context, doctree):
    """Put a MyST-notebook page's .ipynb into the download menu (before the theme builds it);
    the file itself is written after the theme, see below."""
    if _executed_notebook(app, pagename):
        context["ipynb_source"] = f"{pagename}.ipynb"


# The branch the book workflow (.github/workflows/book.yml) fills with the chapters as plain
# notebooks (the same files as the download menu's .ipynb), where Colab and Binder open them.
NOTEBOOK_BRANCH = "notebooks"


def _converted_notebook_and_launch_links(app, pagename, templatename, context, doctree):
    """After sphinx-book-theme's launch buttons (priority 501), which copy the raw executed
    notebook into _sources/: write the converted one there (notebooks.py: it reads without the
    book), and point the Colab and Binder buttons at it on the notebooks branch, not at the
    chapter's .md."""
    executed = _executed_notebook(app, pagename)
    if executed is None:
        return
    import nbformat

    target = Path(app.outdir) / "_sources" / f"{pagename}.ipynb"
    target.parent.mkdir(parents=True, exist_ok=True)
    glue = notebooks.glue_from_build(Path(pagename).name, executed.parent) or {}
    nb = nbformat.read(executed, as_version=4)
    if app.config.nb_merge_streams:
        _merged_as_rendered(nb)
    nb = notebooks.convert_notebook(nb, Path(pagename).name,
                                    glue, _book_index(app), Path(app.srcdir) / Path(pagename).parent)
    nbformat.write(nb, target)
    source = f"{pagename}.md"
    notebook = f"{pagename}.ipynb"
    for group in context.get("header_buttons", []):
        if group.get("label") != "launch-buttons":
            continue
        for button in group.get("buttons", []):
            url = button.get("url", "")
            if button.get("text") in ("Colab", "Binder") and source in url:
                url = url.replace(source, notebook)
                url = re.sub(r"/(blob/)?main(/|\?)", rf"/\g<1>{NOTEBOOK_BRANCH}\2", url,
                             count=1)
                button["url"] = url


def _merged_as_rendered(nb) -> None:
    """Each code cell's streams as the page shows them. With ``nb_merge_streams`` myst-nb
    (1.3) merges a cell's stream outputs into the first of each name in place, before the
    executed notebook is written, and leaves the others in it: the download repeated them (a
    row of chapter 9's table twice). Where the first of a name ends with the others' text as
    that merge joins it, they go; otherwise (a myst-nb that merges a copy) all stay."""
    for cell in nb.cells:
        streams: dict = {}
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                streams.setdefault(out.get("name"), []).append(out)
        repeats = []
        for first, *rest in streams.values():
            joined = "".join(t + "\n" for o in rest if (t := "".join(o.text).rstrip()))
            if rest and "".join(first.text).endswith(joined):
                repeats += rest
        if repeats:
            cell.outputs = [o for o in cell.outputs if not any(o is r for r in repeats)]


def _book_index(app):
    if not hasattr(app, "_normbook_index"):
        app._normbook_index = notebooks.build_index(Path(app.srcdir))
    return app._normbook_index


def _dedupe_scripts(app, pagename, templatename, context, doctree):
    seen, unique = set(), []
    for script in context.get("script_files", []):
        # the same script registered twice, once as filename None and once as "": one key
        key = (str(getattr(script, "filename", script) or ""),
               tuple(sorted(getattr(script, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    if "script_files" in context:
        context["script_files"][:] = unique


def _single_page_as_html(app):
    """Extensions (sphinx-design's cards, myst-nb's folded cells) register how their nodes
    render for the "html" builder only, so the single-page build (make pdf) fails on them:
    give the singlehtml builder the same renderers."""
    if app.builder.name != "singlehtml":
        return
    handlers = app.registry.translation_handlers
    handlers["singlehtml"] = {**handlers.get("html", {}), **handlers.get("singlehtml", {})}


def setup(app):
    app.connect("builder-inited", _single_page_as_html)
    app.connect("config-inited", _mock_triton_if_missing)
    app.connect("config-inited", _set_version)
    # before sphinx-book-theme builds its header buttons (priority 501)
    app.connect("html-page-context", _offer_ipynb, priority=400)
    app.connect("html-page-context", _converted_notebook_and_launch_links, priority=600)
    app.connect("html-page-context", _dedupe_scripts, priority=999)  # after every other handler
    return {"version": normbook_version(), "parallel_read_safe": True, "parallel_write_safe": True}
