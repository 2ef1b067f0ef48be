"""The whole book as one PDF: ``make pdf``.

Jupyter Book's single-page HTML build (``--builder singlehtml``: every chapter on one page,
executed) opened in headless Chromium; once MathJax has typeset every equation and the images
have loaded, Chromium's own printer (``Page.printToPDF``) writes A4 pages with page numbers.
The print stylesheet (book/_static/custom.css, ``@media print``) leaves out the navigation.

Usage: ``python book/_ext/pdf.py SINGLE_PAGE_INDEX.html OUT.pdf``; prints the page count.
"""

from __future__ import annotations

import base64
import functools
import http.server
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path

_READY = r"""
const done = arguments[arguments.length - 1];
(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  await Promise.all([...document.images].map(i => i.complete ? null :
      new Promise(r => { i.onload = i.onerror = r; })));
  // folded solutions and dropdowns stay folded; the details of code cells too
  done({math: document.querySelectorAll("mjx-container").length,
        errors: document.querySelectorAll("mjx-merror").length});
})().catch(e => done({error: String(e)}));
"""

_FOOTER = ('<div style="font-size:8px;width:100%;text-align:center;color:#555">'
           '<span class="pageNumber"></span> / <span class="totalPages"></span></div>')


def page_count(pdf: bytes) -> int:
    """Pages of a PDF Chromium wrote (its page objects; /Pages, the tree's root, excluded)."""
    return len(re.findall(rb"/Type\s*/Page(?![s\w])", pdf))


def print_pdf(index: Path, out: Path) -> int:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_bin = shutil.which("chromedriver")
    if not chromium or not driver_bin:
        raise SystemExit("make pdf needs headless Chromium and chromedriver "
                         "(Debian: apt-get install chromium chromium-driver)")
    root = index.parent
    # Sphinx's index.html is a redirect (<meta http-equiv="Refresh" ... url=book/intro.html>):
    # open its target, so that nothing is printed before the real page has loaded
    target = re.search(r'url=([^"\s>]+)', index.read_text()[:500])
    page = target.group(1) if target else index.name
    if "/" in page:
        # the single page's links (_static/, _images/) are written relative to the build's
        # root although the page sits in book/ (the root document's folder): print a copy
        # placed at the root, where they resolve
        shutil.copyfile(root / page, root / "_print.html")
        page = "_print.html"
    handler = functools.partial(_Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    profile = tempfile.mkdtemp(prefix="normbook-pdf-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 f"--user-data-dir={profile}", "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_bin), options=options)
    try:
        driver.set_script_timeout(300)
        driver.set_page_load_timeout(300)
        driver.get(f"http://127.0.0.1:{server.server_address[1]}/{page}")
        state = driver.execute_async_script(_READY)
        if "error" in state or state["errors"]:
            raise SystemExit(f"the page did not typeset cleanly: {state}")
        pdf = base64.b64decode(driver.execute_cdp_cmd("Page.printToPDF", {
            "paperWidth": 8.27, "paperHeight": 11.69,           # A4, inches
            "marginTop": 0.6, "marginBottom": 0.7, "marginLeft": 0.6, "marginRight": 0.6,
            "printBackground": True, "displayHeaderFooter": True,
            "headerTemplate": "<span></span>", "footerTemplate": _FOOTER,
            "preferCSSPageSize": False})["data"])
    finally:
        driver.quit()
        server.shutdown()
        shutil.rmtree(profile, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(pdf)
    return page_count(pdf)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    index, out = Path(args[0]), Path(args[1])
    if not index.is_file():
        print(f"no single-page build at {index}: run jupyter-book build . --builder singlehtml",
              file=sys.stderr)
        return 2
    pages = print_pdf(index, out)
    print(f"{out}: {pages} pages, {out.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
