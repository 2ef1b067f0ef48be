"""The built book in a real browser: headless Chromium, no network, every page.

Run by ``make browser-check`` (the last step of ``make test``, after the book is built); gate 1
(``pytest tests``) does not collect this folder (see tests/conftest.py).

Each page is served from a localhost http.server and opened in headless Chromium driven by
Selenium and Debian's chromedriver. Host names do not resolve in that browser, so anything the
book fetched from a CDN would fail here as it fails for a reader offline. A page fails if

- a script throws or logs an error, or a resource fails to load (the console log);
- it has math that MathJax did not typeset: a math element without ``mjx-container``, a MathJax
  error or an undefined macro (drawn in red), or a source with ``$$`` and no typeset math;
- an image does not load (``naturalWidth == 0``), or a figure a chapter draws has no alt text
  that describes it (a few words, not a file hash);
- a code cell, folded or not, a code block (package source shown with ``literalinclude``) or a
  cell's printed output is wider than its column at 1280 px (a reader would have to scroll sideways to see it);
- an internal link points to a missing file, or to a ``#fragment`` with no such id in the target;
- it is a chapter (a MyST notebook) without its ``.ipynb`` download.

Also: at a phone's width (390 px) no page is wider than the screen, no displayed equation is
cut off (a wide one scrolls sideways inside its block) and at most one per page is wider than its
column; at least half of each chapter's visible code cells show an output and its figures are
SVG; the search page finds a word, exercises are numbered and their solutions folded, and
screenshots of a few pages go to build/screenshots/ for a person to look at. Each labelled
equation's printed number is the one the README's table and the notebooks give it.

Where Chromium is missing the tests skip with the reason, except in CI (``CI=true``), where
.ci/run installs it, so a missing browser fails.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HTML = Path(os.environ.get("NORMBOOK_HTML", ROOT / "build" / "_build" / "html"))
SCREENSHOTS = Path(os.environ.get("NORMBOOK_SCREENSHOTS", ROOT / "build" / "screenshots"))
IN_CI = os.environ.get("CI", "").lower() == "true"

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1280,900",
    # no name resolves: the book must not need the network (MathJax, fonts, scripts)
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]
# Chromium asks every site for /favicon.ico; the book has none, and that is not a broken page.
IGNORED_CONSOLE = ("favicon.ico",)


def _unavailable(reason: str):
    """Skip on a developer's machine; fail in CI, where the browser and the book must exist."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: .ci/run installs chromium, make test builds the book)")
    pytest.skip(reason)


def _pages() -> list[str]:
    """Every built HTML page, relative to the HTML root (assets and copied sources excluded)."""
    if not HTML.is_dir():
        return []
    skip = ("_static/", "_sources/", "_images/")
    return sorted(
        p.relative_to(HTML).as_posix()
        for p in HTML.rglob("*.html")
        if not p.relative_to(HTML).as_posix().startswith(skip)
    )


PAGES = _pages()


# -- the server and the browser ----------------------------------------------------------------

class _Server(http.server.ThreadingHTTPServer):
    # a page asks for its scripts, styles and images at once; the default backlog is 5
    request_queue_size = 128


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def base_url():
    if not (HTML / "index.html").is_file():
        _unavailable(f"no built book at {HTML}: run `make book` first")
    handler = functools.partial(_QuietHandler, directory=str(HTML))
    server = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def browser():
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
    driver_bin = shutil.which("chromedriver")
    if chromium is None or driver_bin is None:
        _unavailable("headless Chromium and chromedriver are not installed "
                     "(Debian: apt-get install chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium is not installed (it is in requirements.txt)")

    profile = tempfile.mkdtemp(prefix="normbook-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_bin), options=options)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _console_errors(driver) -> list[str]:
    """Errors logged since the last call: exceptions, console.error, failed loads."""
    return [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE" and not any(s in entry["message"] for s in IGNORED_CONSOLE)
    ]


def _open(driver, url: str, tries: int = 3) -> None:
    """Load url; if Chromium shows its own error page instead (the local server did not answer,
    as happened once in CI with both cores busy), wait and load it again, then fail saying so.

    An error page has no console error and no math, so without this check a page that never
    arrived reads as a page whose MathJax and links are broken."""
    for attempt in range(tries):
        driver.get(url)
        where, text = driver.execute_script(
            "return [location.href, document.body ? document.body.innerText.slice(0, 200) : '']")
        if not where.startswith("chrome-error://"):
            return
        if attempt + 1 < tries:
            time.sleep(2 * (attempt + 1))
    pytest.fail(f"{url} did not load in {tries} tries; Chromium showed: {text!r}")


# JavaScript run in the page once it has loaded: wait for MathJax and the images, then report.
_INSPECT = r"""
const done = arguments[arguments.length - 1];
(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
  }
  const imgs = [...document.images];
  imgs.forEach(img => { img.loading = "eager"; });
  await Promise.all(imgs.map(img => img.complete ? null :
      new Promise(r => { img.onload = img.onerror = r; setTimeout(r, 10000); })));
  const math = [...document.querySelectorAll(".math")];
  // solutions and dropdowns that sphinx-togglebutton folds (display: none measures nothing):
  // open, as a reader opens them, before the code in them is measured
  document.querySelectorAll(".toggle-hidden").forEach(e => e.classList.remove("toggle-hidden"));
  done({
    mathjax: !!(window.MathJax && MathJax.version),
    mathjaxSrc: [...document.scripts].map(s => s.src).filter(s => /mathjax/i.test(s)),
    math: math.length,
    untypeset: math.filter(m => !m.querySelector("mjx-container"))
                   .map(m => m.textContent.trim().slice(0, 80)),
    containers: document.querySelectorAll("mjx-container").length,
    // a TeX error, or an undefined macro (MathJax draws its name in red): report the TeX
    mathErrors: (window.MathJax && MathJax.startup && MathJax.startup.document
                 ? [...MathJax.startup.document.getMathItemsWithin(document.body)] : [])
        .filter(item => item.typesetRoot && item.typesetRoot.querySelector(
            "mjx-merror, [style*='color: red'], [style*='color:red']"))
        .map(item => item.math.slice(0, 80)),
    brokenImages: imgs.filter(i => !i.complete || i.naturalWidth === 0)
                      .map(i => i.getAttribute("src")),
    // code a reader cannot see whole: a code cell wider than its column scrolls sideways
    // (folded cells are measured too: a reader unfolds them)
    wideCode: [...document.querySelectorAll(".cell_input pre")]
        .filter(p => {
          const det = p.closest("details");
          const open = det ? det.open : true;
          if (det) det.open = true;
          // the pre, or a box around it inside the cell, scrolls sideways
          let wide = false;
          for (let el = p; el && !el.classList.contains("cell"); el = el.parentElement) {
            if (el.scrollWidth > el.clientWidth) { wide = true; break; }
          }
          if (det) det.open = open;
          return wide;
        })
        .map(p => p.textContent.split("\n").reduce((a, b) => b.length > a.length ? b : a)
                   .slice(0, 100)),
    // package source shown with literalinclude (and any other code block outside a cell),
    // and a cell's printed output (a table cut off at the right edge hides its last columns)
    wideSource: [...document.querySelectorAll("article div.highlight pre, .cell_output pre")]
        .filter(p => p.closest(".cell_output") || !p.closest(".cell"))
        .filter(p => !p.closest(".autodoc, dl.py, .viewcode-block"))
        .filter(p => {
          for (let el = p; el && el.tagName !== "ARTICLE"; el = el.parentElement) {
            if (el.scrollWidth > el.clientWidth + 1) return true;
          }
          return false;
        })
        .map(p => p.textContent.split("\n").reduce((a, b) => b.length > a.length ? b : a)
                   .slice(0, 100)),
    // figures the chapters draw (cell outputs): their alt text, for a screen reader
    figureAlts: [...document.querySelectorAll(".cell_output img")]
        .map(i => [i.getAttribute("src"), i.getAttribute("alt") || ""]),
    links: [...document.querySelectorAll("a[href]")].map(a => a.href),
    ipynb: [...document.querySelectorAll("a[href$='.ipynb']")].map(a => a.href),
  });
})().catch(e => done({error: String(e)}));
"""


def _describes(alt: str) -> bool:
    """An alt text that says something: a few words, not empty, not a file name or a hash."""
    alt = alt.strip()
    return len(alt.split()) >= 4 and not re.fullmatch(r"[0-9a-f]{16,}(\.\w+)?", alt)


class _Ids(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for key, value in attrs:
            if value and (key == "id" or (key == "name" and tag == "a")):
                self.ids.add(value)


@functools.lru_cache(maxsize=None)
def _ids_of(path: Path) -> frozenset[str]:
    parser = _Ids()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return frozenset(parser.ids)


def _broken_links(page_url: str, links: list[str], base_url: str) -> list[str]:
    broken = []
    for link in dict.fromkeys(links):
        if not link.startswith(base_url):
            continue  # another site, mailto:, javascript:
        parts = urllib.parse.urlsplit(link)
        rel = urllib.parse.unquote(parts.path)[len(urllib.parse.urlsplit(base_url).path):]
        target = HTML / rel
        if target.is_dir() or rel == "":
            target = target / "index.html"
        if not target.is_file():
            broken.append(f"{link} (no file {target.relative_to(HTML)})")
            continue
        fragment = urllib.parse.unquote(parts.fragment)
        if fragment and target.suffix == ".html" and fragment not in _ids_of(target):
            broken.append(f"{link} (no id {fragment!r} in {target.relative_to(HTML)})")
    return broken


def _source_of(page: str) -> str:
    """The page's source as copied into _sources/ ('' if none)."""
    for suffix in (".md", ".ipynb", ".rst", ".md.txt"):
        src = HTML / "_sources" / (page[: -len(".html")] + suffix)
        if src.is_file():
            return src.read_text(encoding="utf-8", errors="replace")
    return ""


def _is_notebook(source: str) -> bool:
    """A MyST notebook: YAML front matter with a kernelspec."""
    if not source.startswith("---"):
        return False
    front = source.split("---", 2)[1]
    return "kernelspec:" in front


# -- the checks --------------------------------------------------------------------------------

def test_the_book_was_built():
    if not PAGES:
        _unavailable(f"no built book at {HTML}: run `make book` first")
    assert "index.html" in PAGES and "search.html" in PAGES, PAGES


def test_equation_numbers_are_the_index_s():
    """The number the built page prints for each labelled equation, (3.4) for ``ln-dx``, is the
    one book/_ext/notebooks.build_index gives: the downloaded notebooks' tags and the README's
    table are written from it."""
    import sys
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    import notebooks
    expected = notebooks.build_index(ROOT).equations
    printed = {}
    for page in PAGES:
        for label, number in re.findall(r'id="equation-([\w-]+)">\s*<span class="eqno">\(([\d.]+)\)',
                                        (HTML / page).read_text(encoding="utf-8")):
            printed[label] = number
    if not printed:
        _unavailable(f"no built book at {HTML}: run `make book` first")
    assert printed == expected, {k: (printed.get(k), expected.get(k))
                                 for k in printed.keys() | expected.keys()
                                 if printed.get(k) != expected.get(k)}


def test_a_page_that_never_arrives_fails_as_such(browser):
    # nothing listens on the discard port: Chromium shows its error page, which must not pass
    # as a page (it has no console error) nor be blamed on MathJax
    with pytest.raises(pytest.fail.Exception, match="did not load in 1 tries"):
        _open(browser, "http://127.0.0.1:9/chapter.html", tries=1)


@pytest.mark.parametrize("page", PAGES or ["(no built book)"])
def test_page(page, browser, base_url):
    url = base_url + page
    _console_errors(browser)  # drop what the previous page left
    _open(browser, url)
    report = browser.execute_async_script(_INSPECT)
    assert "error" not in report, f"{page}: the page inspection script failed: {report}"
    problems = [f"console: {m}" for m in _console_errors(browser)]

    source = _source_of(page)
    if report["math"] or "$$" in source:
        if not report["mathjax"]:
            problems.append("math on the page but MathJax did not load")
        if report["containers"] == 0:
            problems.append(f"no typeset math (no mjx-container) although the page has "
                            f"{report['math']} math elements")
        if any(s.startswith("http") and not s.startswith(base_url) for s in report["mathjaxSrc"]):
            problems.append(f"MathJax loaded from another site: {report['mathjaxSrc']}")
    problems += [f"math not typeset: {t!r}" for t in report["untypeset"]]
    problems += [f"MathJax error or undefined macro: {t!r}" for t in report["mathErrors"]]
    problems += [f"image did not load: {src}" for src in report["brokenImages"]]
    problems += [f"code cell wider than its column: {line!r}" for line in report["wideCode"]]
    if not page.startswith("_modules/"):   # whole source files: they scroll, as a file would
        problems += [f"code block wider than its column: {line!r}" for line in report["wideSource"]]
    problems += [f"figure without a description (alt {alt!r}): {src}"
                 for src, alt in report["figureAlts"] if not _describes(alt)]
    problems += [f"broken link: {b}" for b in _broken_links(url, report["links"], base_url)]
    if _is_notebook(source) and not report["ipynb"]:
        problems.append("a notebook page without its .ipynb download")
    assert not problems, f"{page}:\n  " + "\n  ".join(problems)


_PHONE = r"""
const done = arguments[arguments.length - 1];
(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  // a displayed equation wider than its box must be in a box that scrolls, not one that clips
  const cut = [];
  for (const m of document.querySelectorAll("mjx-container[display='true']")) {
    let scrolls = false, clipped = false;
    for (let el = m.parentElement; el && el.tagName !== "ARTICLE"; el = el.parentElement) {
      const ox = getComputedStyle(el).overflowX;
      if (el.scrollWidth > el.clientWidth + 1) {
        if (ox === "auto" || ox === "scroll") { scrolls = true; break; }
        if (ox === "hidden" || ox === "clip") { clipped = true; break; }
      }
    }
    const r = m.getBoundingClientRect();
    if (clipped || (!scrolls && r.right > document.documentElement.clientWidth + 1))
      cut.push(m.textContent.slice(0, 60));
  }
  // displayed equations wider than their column (whole only by scrolling sideways)
  const wide = [...document.querySelectorAll("mjx-container[display='true']")]
    .filter(m => m.scrollWidth > (m.parentElement || m).clientWidth + 1)
    .map(m => m.textContent.slice(0, 60));
  // what widens the page past the screen (the widest few elements, for the message)
  const view = document.documentElement.clientWidth;
  const scrolled = el => {
    for (let e = el.parentElement; e; e = e.parentElement)
      if (["auto", "scroll", "hidden", "clip"].includes(getComputedStyle(e).overflowX)) return true;
    return false;
  };
  const over = [...document.querySelectorAll("article *")]
    .filter(el => el.getBoundingClientRect().right > view + 1 && !scrolled(el))
    .slice(0, 3).map(el => el.tagName.toLowerCase() + "." + [...el.classList].join("."));
  done({cut, wide, over, pageWidth: document.documentElement.scrollWidth, view});
})().catch(e => done({error: String(e)}));
"""


# pages a reader reads on a phone: everything but whole source files and generated indexes
PHONE_PAGES = [p for p in PAGES if p.startswith("book/")]
# displayed equations per chapter that may be wider than a phone's column (they scroll)
WIDE_EQUATIONS_PER_PAGE = 1


def test_pages_fit_a_phone(browser, base_url):
    """At 390 px: no page is wider than the screen; every displayed equation is whole or scrolls
    inside its block (none is cut off); at most one per page is wider than its column."""
    if not PHONE_PAGES:
        pytest.skip("no page built yet")
    size = browser.get_window_size()
    browser.set_window_size(390, 844)
    problems = []
    try:
        for page in PHONE_PAGES:
            _open(browser, base_url + page)
            info = browser.execute_async_script(_PHONE)
            assert "error" not in info, f"{page}: {info}"
            problems += [f"{page}: equation cut off at 390 px: {t!r}" for t in info["cut"]]
            if info["pageWidth"] > info["view"] + 1:
                problems.append(f"{page}: {info['pageWidth']} px wide on a {info['view']} px "
                                f"screen (widest: {info['over']})")
            if len(info["wide"]) > WIDE_EQUATIONS_PER_PAGE:
                problems.append(f"{page}: {len(info['wide'])} displayed equations wider than "
                                f"the column at 390 px (at most {WIDE_EQUATIONS_PER_PAGE}): "
                                f"{info['wide']}")
    finally:
        browser.set_window_size(size["width"], size["height"])
    assert not problems, "\n".join(problems)


_CELLS = r"""
const cells = [...document.querySelectorAll("div.cell")].filter(c => c.querySelector(".cell_input"));
const shown = cells.filter(c => {
  const out = c.querySelector(".cell_output");
  return out && out.textContent.trim().length + out.querySelectorAll("img, svg").length > 0;
});
const figures = [...document.querySelectorAll(".cell_output img, figure img")]
  .map(i => i.getAttribute("src") || "");
return {cells: cells.length, shown: shown.length, figures};
"""

# the reading pages whose code cells must show what they compute (issue 23)
CHAPTERS = [p for p in PAGES if re.match(r"book/(\d\d-|appendix-).*\.html$", p)]


@pytest.mark.parametrize("page", CHAPTERS or ["(no chapter built)"])
def test_results_are_shown_where_they_are_computed(page, browser, base_url):
    """At least half of a chapter's visible code cells (folded ones included) end with an
    output (a value, a table, a figure); every figure a cell draws is vector (SVG)."""
    if page not in PAGES:
        pytest.skip("no chapter built yet")
    _open(browser, base_url + page)
    info = browser.execute_script(_CELLS)
    assert 2 * info["shown"] >= info["cells"], (
        f"{page}: {info['shown']} of {info['cells']} visible code cells show an output; "
        "at least half must")
    raster = [src for src in info["figures"] if src.startswith("data:image/png") or src.endswith(".png")]
    assert not raster, f"{page}: figures drawn as PNG, not SVG: {[s[:60] for s in raster]}"


def test_search_finds_a_word(browser, base_url):
    _console_errors(browser)
    _open(browser, base_url + "search.html?q=normalization")
    deadline = time.time() + 30
    hits = 0
    while time.time() < deadline:
        hits = browser.execute_script(
            "return document.querySelectorAll('#search-results li, ul.search li').length")
        if hits:
            break
        time.sleep(0.25)
    assert hits > 0, "the search page found nothing for 'normalization'"
    assert not _console_errors(browser)


def test_exercises_are_numbered_and_solutions_folded(browser, base_url):
    chapters = [p for p in PAGES if re.match(r"book/\d\d-.*\.html$", p)]
    if not chapters:
        pytest.skip("no chapter built yet")
    found = 0
    for page in chapters:
        _open(browser, base_url + page)
        info = browser.execute_script(r"""
            const ex = [...document.querySelectorAll('div.exercise > .admonition-title')]
                .map(t => t.textContent.trim());
            const sol = [...document.querySelectorAll('div.solution.dropdown')].map(s => {
                const body = [...s.children].filter(c => !c.classList.contains('admonition-title'));
                // togglebutton folds with visibility: hidden and height 0
                return body.every(c => c.offsetParent === null
                    || getComputedStyle(c).visibility === 'hidden'
                    || c.getBoundingClientRect().height === 0);
            });
            return {ex, sol};""")
        found += len(info["ex"])
        unnumbered = [t for t in info["ex"] if not re.match(r"Exercise \d+(\.\d+)*", t)]
        assert not unnumbered, f"{page}: exercises without a number: {unnumbered}"
        assert all(info["sol"]), f"{page}: a dropdown solution is open when the page loads"
    if not found:
        pytest.skip("no exercises in the built chapters")


def test_screenshots(browser, base_url):
    """Screenshots of the front page, the first chapter (light and dark) and the API page."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    chapters = [p for p in PAGES if re.match(r"book/\d\d-.*\.html$", p)]
    shots = {"intro": "book/intro.html", "api": "book/api.html"}
    if chapters:
        shots["chapter"] = chapters[0]
    for name, page in shots.items():
        if page not in PAGES:
            continue
        _open(browser, base_url + page)
        browser.execute_async_script(_INSPECT)
        browser.save_screenshot(str(SCREENSHOTS / f"{name}.png"))
    if chapters:
        # dark theme, scrolled to the first figure or cell output: is it legible?
        _open(browser, base_url + chapters[0])
        browser.execute_script("localStorage.setItem('mode', 'dark');")
        _open(browser, base_url + chapters[0])
        browser.execute_async_script(_INSPECT)
        browser.execute_script("""
            const fig = document.querySelector('.cell_output img, figure img');
            if (fig) fig.scrollIntoView({block: 'center'});""")
        time.sleep(0.3)
        browser.save_screenshot(str(SCREENSHOTS / "chapter-dark.png"))
        theme = browser.execute_script("return document.documentElement.dataset.theme")
        browser.execute_script("localStorage.setItem('mode', 'auto');")
        assert theme == "dark", theme
    assert (SCREENSHOTS / "intro.png").stat().st_size > 10_000


@pytest.mark.parametrize("page", CHAPTERS or ["(no chapter built)"])
def test_chapters_launch_and_download_plain_notebooks(page):
    """Every chapter offers Colab and Binder, both opening its notebook on the notebooks branch,
    and its download is that notebook: no MyST markup, the install cell first."""
    if page not in PAGES:
        pytest.skip("no chapter built yet")
    import json
    import sys

    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    import notebooks

    stem = Path(page).stem
    html = (HTML / page).read_text()
    colab = re.findall(r'href="(https://colab\.research\.google\.com/[^"]+)"', html)
    binder = re.findall(r'href="(https://mybinder\.org/[^"]+)"', html)
    assert colab == [f"https://colab.research.google.com/github/normbook/normbook/blob/"
                     f"notebooks/book/{stem}.ipynb"], colab
    assert len(binder) == 1 and binder[0].endswith(f"/notebooks?urlpath=lab/tree/book/{stem}.ipynb")
    nb = json.loads((HTML / "_sources" / "book" / f"{stem}.ipynb").read_text())
    first = "".join(nb["cells"][0]["source"])
    assert nb["cells"][0]["cell_type"] == "code" and "pip" in first, first[:80]
    markdown = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    leftover = notebooks.MYST_MARKERS.search(markdown)
    assert not leftover, markdown[leftover.start():leftover.start() + 80]
