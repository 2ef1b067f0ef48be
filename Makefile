# normbook: two commands. `make book` builds the HTML book, `make test` runs the three gates and
# then checks the built pages in a headless browser.
# Both create .venv on first use from the pinned requirements.txt and are idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CHAPTERS := $(sort $(wildcard book/[0-9][0-9]-*.md))
NOTEBOOK_DIR := build/notebooks
export TRITON_INTERPRET := 1
export MPLBACKEND := Agg
export PYTHONHASHSEED := 0
HTML_DIR := build/_build/html
PORT ?= 8000

.PHONY: book test pytest nbval notebooks browser-check serve clean

$(STAMP): requirements.txt pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

## Gate 3: the warnings-as-errors book build. --all re-reads (and so re-executes) every page:
## an incremental build would neither re-run a chapter when only src/ changed nor repeat the
## warnings of unchanged pages. Source pages (_modules/) are regenerated for the same reason.
book: $(STAMP)
	rm -rf $(HTML_DIR)/_modules
	$(VENV)/bin/jupyter-book build . --all -W -n --keep-going --path-output build
	@echo "The book is in $(HTML_DIR)/: open $(HTML_DIR)/index.html in a browser, or run make serve."

## Gate 1: the package, with Triton in its interpreter on the CPU.
pytest: $(STAMP)
	$(PY) -m pytest tests -q

## Each chapter as a notebook, into build/notebooks (outside book/: a .ipynb beside its .md breaks -W).
notebooks: $(STAMP)
	@mkdir -p $(NOTEBOOK_DIR)
	for f in $(CHAPTERS); do $(VENV)/bin/jupytext --quiet --to ipynb -o $(NOTEBOOK_DIR)/$$(basename $$f .md).ipynb $$f || exit 1; done
	@echo "Chapters written as notebooks to $(NOTEBOOK_DIR)/"

## Gate 2: nbval executes every chapter notebook; every claim is an assert inside a cell.
nbval: notebooks
	$(PY) -m pytest --nbval-lax -p no:cacheprovider -q $(NOTEBOOK_DIR)

## After the build: every page of $(HTML_DIR) in headless Chromium (math typeset, images loaded,
## internal links and anchors resolve, no JavaScript errors); screenshots in build/screenshots/.
browser-check: $(STAMP)
	$(PY) -m pytest tests/browser -q -p no:cacheprovider

## Preview the built book at http://localhost:$(PORT)/ (make book first).
serve:
	@test -f $(HTML_DIR)/index.html || { echo "No built book in $(HTML_DIR): run make book first."; exit 1; }
	@echo "Serving $(HTML_DIR) at http://localhost:$(PORT)/ (Ctrl-C stops)"
	$(PYTHON) -m http.server $(PORT) --bind 127.0.0.1 --directory $(HTML_DIR)

## The gates in order, each only after the one before passed (also under make -j).
test:
	$(MAKE) pytest
	$(MAKE) nbval
	$(MAKE) book
	$(MAKE) browser-check

clean:
	rm -rf build _build
