# normbook: two commands. `make book` builds the HTML book; `make test` runs the package's tests,
# then two lines side by side (the book build and its browser check; the kernels under Triton
# 3.6, 3.7 and 3.8, the GPU dry run and the torch floor): see the test target below.
# Both create .venv on first use from the pinned requirements.txt and are idempotent; `make venv`
# creates it alone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CHAPTERS := $(sort $(wildcard book/[0-9][0-9]-*.md)) book/appendix-kernels.md
NOTEBOOK_DIR := build/notebooks
export TRITON_INTERPRET := 1
export MPLBACKEND := Agg
export PYTHONHASHSEED := 0
HTML_DIR := build/_build/html
PORT ?= 8000

TRITON36 := build/triton36

.PHONY: venv book test quick pytest triton36 triton-versions torch-floor gpu-dry-run gpu-wheels nbval notebooks pdf browser-check test-book test-kernels serve clean

## The pins are installed by uv (itself pinned, into the venv by pip): under a minute where pip
## took three. Bytecode is compiled at install, as pip does: left to the first imports, it slowed
## the first test processes (a rank importing torch took over 15 s). uv reads none of pip's
## settings, so pip's find-links (the folder where this machine keeps its CPU wheel of torch) are
## passed on to it: without them torch 2.13.0 would come from the index as a CUDA build of GBs.
UV_PIP := $(VENV)/bin/uv pip install --quiet --python $(PY)
UV_LINKS = $(addprefix --find-links ,$(sort $(shell $(PYTHON) -m pip config list 2>/dev/null \
  | sed -n "s/.*find-links='\(.*\)'/\1/p")))
## PyPI's torch 2.13.0 is on Linux a CUDA build that pins Triton 3.7.1, and the pins here take
## Triton 3.9.0: no resolver can install both. Where pip's configuration names no find-links
## folder at all (the machines this is tested on keep torch's CPU wheel in one), torch comes first
## from PyTorch's CPU index (no Triton pin, and not 5 GB).
CPU_TORCH = if [ -z "$(strip $(UV_LINKS))" ] && [ "$$(uname)" = Linux ] \
  && ! $(1)/bin/python -c "import torch" 2>/dev/null; then \
  echo "torch 2.13.0, CPU build, from download.pytorch.org (PyPI's pins another Triton)"; \
  $(1)/bin/python -m pip install --quiet torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; fi
$(STAMP): requirements.txt pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	@$(call CPU_TORCH,$(VENV))
	$(PY) -m pip install --quiet uv==0.13.9
	$(UV_PIP) --compile-bytecode $(UV_LINKS) -r requirements.txt
	$(UV_PIP) --no-deps -e .
	touch $(STAMP)

## The venv alone: the pins, and the package in it as an editable install.
venv: $(STAMP)

## The warnings-as-errors book build. --all re-reads (and so re-executes) every page:
## an incremental build would neither re-run a chapter when only src/ changed nor repeat the
## warnings of unchanged pages. Source pages (_modules/) are regenerated for the same reason.
## One torch thread per chapter: in make test the book shares the two cores with the kernel line,
## and torch's two OpenMP threads then spin waiting for a core (chapter 1's training cell: 11 s
## alone, 35 s beside two busy processes with two threads, 14 s with one; in one fresh run it
## passed myst-nb's 300 s cell limit). The chapters' tensors are small: alone, one thread is as fast.
book: $(STAMP)
	rm -rf $(HTML_DIR)/_modules
	OMP_NUM_THREADS=1 $(VENV)/bin/jupyter-book build . --all -W -n --keep-going --path-output build
	@echo "The book is in $(HTML_DIR)/: open $(HTML_DIR)/index.html in a browser, or run make serve."

## The package's tests, with Triton in its interpreter on the CPU.
pytest: $(STAMP)
	$(PY) -m pytest tests -q -n auto

## The package's tests without those marked slow (several processes, compiles, the widest rows
## in the interpreter): the loop to run while editing; make test runs them all.
quick: $(STAMP)
	$(PY) -m pytest tests -q -n auto -m "not slow"

## The GPU machine runs Triton 3.6.0 (this one 3.9): every kernel compiles for sm_80/sm_90 under it
## too. numpy 2.2.6 goes with it: 3.6's interpreter breaks on numpy 2.4. Both live in $(TRITON36),
## first on PYTHONPATH, apart from the venv. The interpreter's tests under 3.6 run in make
## torch-floor, beside torch 2.11 as on the GPU machine (they ran here too, beside torch 2.13, which
## never meets Triton 3.6 outside this Makefile: 2 min 45 s of make test repeating the floor's).
$(TRITON36)/.installed: $(STAMP)
	$(UV_PIP) --compile-bytecode --target $(TRITON36) --no-deps triton==3.6.0 numpy==2.2.6
	touch $@

triton36: $(TRITON36)/.installed
	env -u TRITON_INTERPRET PYTHONPATH=$(TRITON36) $(PY) -m normbook.kernels.report --json build/report-triton36.json --force

## Two things of normbook mirror Triton's own code, on the Tritons they were read against and
## are tested on: the direct launch (_launch.TESTED: a compiled kernel's launcher called as
## JITFunction.run calls it) and the interpreter's patches (_interpret.TESTED: no rescan of
## triton.language per call, bfloat16 rounded as a GPU rounds it). 3.6 is tested in make
## torch-floor, 3.9 by the pins, and here 3.7 and 3.8 (what PyPI's CUDA builds of torch 2.12 to
## 2.14 pin), each in a folder of its own first on PYTHONPATH: the tests that compare the direct
## launch with Triton's argument for argument, and the interpreter's with and without the
## patches bit for bit (about half a minute each).
OTHER_TRITONS := 3.7.1 3.8.0
build/triton-%/.installed: $(STAMP)
	$(UV_PIP) --compile-bytecode --target build/triton-$* --no-deps triton==$*
	touch $@

triton-versions: $(foreach v,$(OTHER_TRITONS),build/triton-$(v)/.installed)
	for v in $(OTHER_TRITONS); do echo "the direct launch and the interpreter under Triton $$v"; \
	  PYTHONPATH=build/triton-$$v $(PY) -m pytest -q -n auto -p no:cacheprovider \
	  -W ignore::DeprecationWarning tests/test_kernels_launch.py tests/test_kernels_interpret.py \
	  || exit 1; done

## The declared torch floor (pyproject: torch>=2.11) is tested too: torch 2.11 with Triton 3.6, the
## GPU machine's versions, in a venv of their own, the rest at requirements.txt's pins, and the
## package's tests under them (not the browser's). torch 2.11 from the index is a CUDA build,
## about 5 GB with its CUDA libraries (a minute to install here); on a CPU it runs as any
## build does. numpy 2.2.6: Triton 3.6's interpreter breaks on numpy 2.4.
FLOOR := build/torch-floor
FLOOR_PINS := torch==2.11.0 triton==3.6.0 numpy==2.2.6 "setuptools>=77,<82"
$(FLOOR)/.installed: requirements.txt pyproject.toml
	test -d $(FLOOR) || $(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install --quiet uv==0.13.9
	printf '%s\n' $(FLOOR_PINS) > $(FLOOR)/overrides.txt
	$(FLOOR)/bin/uv pip install --quiet --python $(FLOOR)/bin/python --compile-bytecode \
	  --override $(FLOOR)/overrides.txt -r requirements.txt
	$(FLOOR)/bin/uv pip install --quiet --python $(FLOOR)/bin/python --no-deps -e .
	touch $@

## Not rerun there: the browser's pages, and the compile report and the GPU dry run, which
## depend on Triton alone (make triton36 runs the report under 3.6).
torch-floor: $(FLOOR)/.installed
	$(FLOOR)/bin/python -c "import torch, triton; assert torch.__version__.startswith('2.11.'), \
	  torch.__version__; print('the torch floor: torch', torch.__version__, 'Triton', triton.__version__)"
	$(FLOOR)/bin/python -m pytest tests -q -n auto -p no:cacheprovider --ignore=tests/browser \
	  --ignore=tests/test_kernels_report.py --ignore=tests/test_gpu_check.py \
	  -W ignore::DeprecationWarning:triton.runtime.interpreter

## benchmarks/gpu_check.sh with DRY_RUN=1: the GPU check's every step on the CPU, so a broken
## script is found here and not in the GPU's few minutes.
gpu-dry-run: $(STAMP)
	rm -rf build/gpu-dry-run
	DRY_RUN=1 OUT=build/gpu-dry-run PYTHON=$(abspath $(PY)) bash benchmarks/gpu_check.sh
	@cd build/gpu-dry-run && ls results.json summary.txt report.json overview.png logs.tar.gz >/dev/null \
	  && test -z "$$(find . -mindepth 1 -type d)" && test "$$(ls | wc -l)" -le 8 \
	  && echo "gpu-dry-run: $$(ls | wc -l) files, no folders: what the device tool brings back"

## Wheels for the GPU machine (Python 3.12, no network), into .whl/ (git-ignored), which the
## device tool carries along (benchmarks/README.md): Liger-Kernel (pure Python), transformers at
## requirements.txt's pin with what it needs, for the Llama step (about 28 MB), and hypothesis,
## for README step 6. numpy is left out: the machine's own serves its torch and matplotlib.
## gpu_check.sh puts .whl's packages on PYTHONPATH, before the machine's site-packages, so the
## carried versions win over the machine's copies of the same packages.
GPU_WHEEL_FLAGS := --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl
gpu-wheels:
	$(PYTHON) -m pip download --no-deps $(GPU_WHEEL_FLAGS) liger-kernel==0.8.5
	$(PYTHON) -m pip download $(GPU_WHEEL_FLAGS) $$(grep '^transformers==' requirements.txt)
	$(PYTHON) -m pip download $(GPU_WHEEL_FLAGS) $$(grep '^hypothesis==' requirements.txt)
	rm -f .whl/numpy-*.whl

## Each chapter as a notebook that reads outside the book (no MyST markup, glued values written
## in, an install cell first: book/_ext/notebooks.py), into build/notebooks (outside book/: a
## .ipynb beside its .md breaks -W). Its own small venv: jupytext, nbformat and the package with
## the extras the chapters import, at requirements.txt's pins, not the book's whole toolchain.
## The glued values are computed by running each chapter once.
NB_VENV := build/notebooks-venv
$(NB_VENV)/.installed: requirements.txt pyproject.toml
	test -d $(NB_VENV) || $(PYTHON) -m venv $(NB_VENV)
	@$(call CPU_TORCH,$(NB_VENV))
	$(NB_VENV)/bin/python -m pip install --quiet -c requirements.txt jupytext nbformat -e ".[book,kernels]"
	touch $@

notebooks: $(NB_VENV)/.installed
	$(NB_VENV)/bin/python book/_ext/notebooks.py $(NOTEBOOK_DIR) $(CHAPTERS)
	@echo "Chapters written as notebooks to $(NOTEBOOK_DIR)/"

## Every chapter notebook under nbval, cell by cell (every claim is an assert inside a cell). Not
## part of make test: the book build executes every chapter once and fails on a raising cell.
nbval: notebooks $(STAMP)
	$(PY) -m pytest --nbval-lax -p no:cacheprovider -q $(NOTEBOOK_DIR)

## The whole book as one PDF, build/normbook.pdf: a single-page HTML build (every chapter
## executed again, into build/pdf) printed by headless Chromium once MathJax has typeset it
## (book/_ext/pdf.py; needs chromium and chromium-driver, as the browser check does).
PDF := build/normbook.pdf
pdf: $(STAMP)
	$(VENV)/bin/jupyter-book build . --builder singlehtml --path-output build/pdf
	$(PY) book/_ext/pdf.py build/pdf/_build/singlehtml/index.html $(PDF)

## After the build: every page of $(HTML_DIR) in headless Chromium (math typeset, images loaded,
## internal links and anchors resolve, no JavaScript errors); screenshots in build/screenshots/.
browser-check: $(STAMP)
	$(PY) -m pytest tests/browser -q -p no:cacheprovider

## Preview the built book at http://localhost:$(PORT)/ (make book first).
serve:
	@test -f $(HTML_DIR)/index.html || { echo "No built book in $(HTML_DIR): run make book first."; exit 1; }
	@echo "Serving $(HTML_DIR) at http://localhost:$(PORT)/ (Ctrl-C stops)"
	$(PYTHON) -m http.server $(PORT) --bind 127.0.0.1 --directory $(HTML_DIR)

## The gates: the package's tests first (a failure there stops everything); then two lines side
## by side, each in order: the book build and its browser check; Triton 3.6's compile report,
## the direct launch and the interpreter under Triton 3.7 and 3.8, the GPU dry run and the
## torch floor.
## The book executes one chapter at a time, a core at most, so alone it leaves the other core
## idle; the dry run's step caps assume a core of its own, which it has once Triton 3.6 is done.
## Each target's output is printed whole when it ends (--output-sync), and make starts nothing
## new once one has failed.
test:
	$(MAKE) pytest
	$(MAKE) -j2 --output-sync=target test-book test-kernels

test-book: book
	$(MAKE) browser-check

test-kernels: triton36
	$(MAKE) triton-versions
	$(MAKE) gpu-dry-run
	$(MAKE) torch-floor

clean:
	rm -rf build _build
