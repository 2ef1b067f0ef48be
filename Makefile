# normbook: two commands. `make book` builds the HTML book, `make test` runs the three gates.
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

.PHONY: book test pytest nbval book-check notebooks clean

$(STAMP): requirements.txt pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

book: $(STAMP)
	$(VENV)/bin/jupyter-book build . -W -n --keep-going --path-output build
	@echo "Open build/_build/html/index.html in a browser."

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

## Gate 3: the warnings-as-errors book build.
test: pytest nbval book

clean:
	rm -rf build _build
