"""Packaging as the ecosystem expects: one version, a license, typed public API, declared extras,
and a wheel that builds without a deprecation warning and imports where Triton is absent."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import normbook

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
EXTRAS = PROJECT["optional-dependencies"]

# The typed public API: mypy runs on these files, and every public name in them is annotated.
PUBLIC_MODULES = ["__init__", "functional", "modules", "checks", "reference", "batching",
                  "residual", "numpy_ref", "blocks", "distributed", "swap"]
# torch's autograd.Function protocol fixes these signatures (ctx, *tensors); nothing to state.
UNANNOTATED = {"normbook.functional.NormFunction"}


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


# ------------------------------------------------------------------------------ one version

def test_one_version_everywhere():
    """pyproject.toml is the source; the metadata, normbook.__version__, the book and
    CITATION.cff (which cannot read it) must agree with it."""
    version = PROJECT["version"]
    try:
        installed = importlib.metadata.version("normbook")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    assert installed in (None, version), (
        f"installed metadata says {installed}, pyproject.toml {version}: reinstall "
        "(pip install --no-deps -e .)")
    assert normbook.__version__ == version
    cff = re.search(r"^version:\s*['\"]?([^'\"\s]+)", (ROOT / "CITATION.cff").read_text(), re.M)
    assert cff and cff.group(1) == version, f"CITATION.cff: {cff and cff.group(1)}, not {version}"
    # the book prints normbook.__version__ (the intro) rather than a typed number
    assert 'claim("normbook_version", normbook.__version__)' in (ROOT / "book/intro.md").read_text()


def test_the_sphinx_extension_reports_the_package_version(monkeypatch):
    pytest.importorskip("sphinxcontrib.bibtex")
    monkeypatch.syspath_prepend(str(ROOT / "book/_ext"))
    ext = importlib.import_module("normbook_sphinx")

    class App:
        def connect(self, *args, **kwargs):
            pass

    assert ext.setup(App())["version"] == PROJECT["version"]

    class Config:
        release = version = ""

    ext._set_version(None, Config)
    assert Config.release == Config.version == PROJECT["version"]


def test_no_version_number_is_typed_in_code():
    typed = re.compile(r"""(__version__|["']version["'])\s*[:=]\s*["']\d""")
    files = [*(ROOT / "src").rglob("*.py"), *(ROOT / "book/_ext").glob("*.py")]
    hits = [str(f.relative_to(ROOT)) for f in files if typed.search(f.read_text())]
    assert not hits, f"a version typed by hand (read importlib.metadata instead): {hits}"


# ------------------------------------------------------------------------------ license

def test_license_files_and_where_they_are_named():
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert PROJECT["license"] == "MIT"                     # an SPDX expression, not a table
    assert "LICENSE" in PROJECT["license-files"]
    assert "CC BY 4.0" in (ROOT / "book/LICENSE").read_text()
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## License"):]
    assert "MIT" in section and "CC BY 4.0" in section
    footer = yaml.safe_load((ROOT / "_config.yml").read_text())["html"]["extra_footer"]
    assert "CC BY 4.0" in footer and "MIT" in footer
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert {"MIT", "CC-BY-4.0"} <= set(cff["license"])


def test_metadata_for_an_index():
    assert PYPROJECT["build-system"]["requires"] == ["setuptools>=77"]   # license-files
    urls = PROJECT["urls"]
    assert {"Documentation", "Source", "Issues", "Changelog"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())
    assert "Typing :: Typed" in PROJECT["classifiers"] and PROJECT["keywords"]


# ------------------------------------------------------------------------------ extras

def test_extras_declared():
    assert {"kernels", "book", "bench", "dev"} <= set(EXTRAS)
    assert {"matplotlib", "tqdm"} <= _names(EXTRAS["bench"])
    assert {"pytest", "hypothesis", "expecttest", "nbval", "jupytext", "mypy",
            "transformers"} <= _names(EXTRAS["dev"])


def test_triton_floor_is_the_oldest_triton_the_tests_run():
    (triton,) = [Requirement(r) for r in EXTRAS["kernels"] if Requirement(r).name == "triton"]
    oldest = re.search(r"triton==(\S+)", (ROOT / "Makefile").read_text()).group(1)  # make triton36
    assert triton.specifier.contains(oldest)
    assert not triton.specifier.contains("3.5.1"), f"the floor {triton.specifier} is below {oldest}"


def _chapter_imports() -> set[str]:
    """Top-level modules the chapters' code cells import."""
    mods = set()
    for page in (ROOT / "book").glob("*.md"):
        for cell in re.findall(r"^```\{code-cell\}[^\n]*\n(.*?)^```", page.read_text(), re.S | re.M):
            for line in cell.splitlines():
                m = re.match(r"\s*(?:from\s+([\w.]+)\s+import|import\s+([\w., ]+))", line)
                if m:
                    names = [m.group(1)] if m.group(1) else m.group(2).split(",")
                    mods |= {n.split()[0].split(".")[0] for n in names if n.strip()}
    return mods


def test_book_extra_covers_what_the_chapters_import():
    third_party = {m for m in _chapter_imports() if m not in sys.stdlib_module_names
                   and m != "normbook" and not m.startswith("_")}
    assert {"matplotlib", "torch"} <= third_party
    dists = importlib.metadata.packages_distributions()
    declared = (_names(PROJECT["dependencies"]) | _names(EXTRAS["book"])
                | _names(EXTRAS["kernels"]))
    missing = {m for m in third_party
               if not {canonicalize_name(d) for d in dists.get(m, [m])} & declared}
    assert not missing, f"the chapters import {missing}: add them to the book extra"


# ------------------------------------------------------------------------------ typed API

def test_py_typed_is_shipped():
    assert (ROOT / "src/normbook/py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["normbook"]


def _public_callables():
    for stem in PUBLIC_MODULES:
        name = "normbook" if stem == "__init__" else f"normbook.{stem}"
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if callable(obj) and f"{obj.__module__}.{obj.__qualname__}" not in UNANNOTATED:
                yield f"{name}.{attr}", obj


def _unannotated(fn) -> list[str]:
    fn = inspect.unwrap(fn)
    sig = inspect.signature(fn)
    gaps = [p for p in sig.parameters
            if p not in ("self", "cls") and sig.parameters[p].annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty:
        gaps.append("return")
    return gaps


def test_public_api_is_annotated():
    gaps = {}
    for name, obj in _public_callables():
        if inspect.isclass(obj):
            methods = {k: v for k, v in vars(obj).items()
                       if inspect.isfunction(v) and (k == "__init__" or not k.startswith("_"))}
            for k, v in methods.items():
                if _unannotated(v):
                    gaps[f"{name}.{k}"] = _unannotated(v)
        elif _unannotated(obj):
            gaps[name] = _unannotated(obj)
    assert not gaps, f"public callables without annotations (parameter names): {gaps}"


SHAPE = re.compile(r"\((?:\.\.\.|\*|[A-Z]\w*|\d+)[^()]*\)")     # (..., D), (*, D), (N, D), (D,)
# named for norms, computing none: a model swap, a record of a Hugging Face class, the sizes
# of gradients
NOT_A_NORM = {"normbook.swap_norms", "normbook.swap.swap_norms", "normbook.swap.HFNorm",
              "normbook.blocks.layer_grad_norms"}
EQUATION = re.compile(r"\((?:ln|rms|jac|fork|residual|pre|post|batch|dist|kern)-[\w-]+\)")


def test_the_norms_docstrings_give_shapes_and_equations():
    """The guide's rule: every public function has a docstring, and each that computes a norm
    (a norm, its Jacobian or backward, a check of its identities: its name says norm, or it
    lives in the reference, numpy or checks modules) gives the shapes it takes and the
    equation it implements, by the book's label, e.g. (ln-dx)."""
    undocumented, short = [], {}
    for name, obj in _public_callables():
        doc = inspect.getdoc(obj) or ""
        if not doc:
            undocumented.append(name)
        module = name.rsplit(".", 2)[-2]
        if "norm" in name.rsplit(".", 1)[-1].lower() or module in {"reference", "numpy_ref", "checks"}:
            missing = [what for what, rule in (("shapes", SHAPE), ("equation", EQUATION))
                       if not rule.search(doc)]
            if missing and name not in NOT_A_NORM:
                short[name] = missing
    assert not undocumented, f"public callables without a docstring: {undocumented}"
    assert not short, f"norm docstrings without shapes or an equation label: {short}"


@pytest.mark.slow
def test_mypy_is_clean_on_the_public_api():
    pytest.importorskip("mypy")
    files = [f"src/normbook/{stem}.py" for stem in PUBLIC_MODULES]
    run = subprocess.run([sys.executable, "-m", "mypy", *files], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr



def test_returns_sections_render_as_one_value_each():
    """The API page renders docstrings with napoleon, its "Returns" section in the style of
    "Args" (_config.yml): each line at the first line's indentation starts a value of its own,
    so a description wrapped without a deeper indent became bold bullets of sentence fragments
    (23 public functions did, layer_norm and rms_norm among them)."""
    import ast

    from sphinx.ext.napoleon import Config
    from sphinx.ext.napoleon.docstring import GoogleDocstring

    sphinx = yaml.safe_load((ROOT / "_config.yml").read_text())["sphinx"]["config"]
    config = Config(napoleon_custom_sections=[tuple(s) for s in
                                              sphinx["napoleon_custom_sections"]])
    fragments = {}
    for path in sorted((ROOT / "src" / "normbook").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or "Returns:" not in doc:
                continue
            rendered = str(GoogleDocstring(doc, config))
            if ":Returns:" not in rendered:      # the word in a sentence, not a section
                continue
            section = rendered.split(":Returns:", 1)[1].split("\n\n", 1)[0]
            names = re.findall(r"^\s*(?:\* )?\*\*(.*?)\*\*", section, re.M)
            bad = [n for n in names if not re.fullmatch(r"[\w.]+", n)]
            if bad:
                fragments[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = bad
    assert not fragments, f"Returns values named by a wrapped line (indent it): {fragments}"


# ------------------------------------------------------------------------------ the wheel

def _runtime_closure(requirements: list[str], leave_out: set[str]) -> set[str]:
    """Distributions (canonical names) these requirements pull in, with their own, as installed
    here; ``leave_out`` and what only they need are not followed."""
    seen, todo = set(), list(requirements)
    while todo:
        req = Requirement(todo.pop())
        name = canonicalize_name(req.name)
        needed = req.marker is None or req.marker.evaluate({"extra": ""})
        if name in seen or name in leave_out or not needed:
            continue
        seen.add(name)
        todo += importlib.metadata.distribution(name).requires or []
    return seen


def _site_of(dists: set[str], farm: Path) -> None:
    """Symlink into ``farm`` the top-level files and folders of these installed distributions."""
    for name in dists:
        dist = importlib.metadata.distribution(name)
        site = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            if (site / top).exists() and not (farm / top).exists():
                (farm / top).symlink_to(site / top)


@pytest.mark.slow
def test_the_packages_listed_are_the_source_tree_s():
    """pyproject lists its packages (to map benchmarks/results into the wheel as
    normbook.bench.recorded): a package added under src/ must be listed too."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"]) - {"normbook.bench.recorded"}
    found = {".".join(p.parent.relative_to(ROOT / "src").parts)
             for p in (ROOT / "src").rglob("__init__.py")}
    assert listed == found, (listed, found)
    assert PYPROJECT["tool"]["setuptools"]["package-dir"]["normbook.bench.recorded"] == \
        "benchmarks/results"


def test_the_sdist_carries_the_package_and_its_citation_not_the_tests(tmp_path):
    """setuptools' default put tests/test_*.py in the sdist without conftest.py and helpers.py
    (and without what they read: the book, the benchmarks), so none of them ran from it;
    MANIFEST.in leaves the tests out and puts in the changelog and the citation."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__}: the sdist needs >= 77")
    source = tmp_path / "source"
    source.mkdir()
    for f in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "CHANGELOG.md",
              "CITATION.cff"):
        shutil.copy(ROOT / f, source / f)
    shutil.copytree(ROOT / "src", source / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(ROOT / "benchmarks" / "results", source / "benchmarks" / "results")
    shutil.copytree(ROOT / "tests", source / "tests",
                    ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta;"
                            " print(build_meta.build_sdist(sys.argv[1]))", tmp_path / "dist"],
                           capture_output=True, text=True, cwd=source, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    import tarfile

    with tarfile.open(tmp_path / "dist" / build.stdout.split()[-1]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"CHANGELOG.md", "CITATION.cff", "LICENSE", "README.md",
            "src/normbook/__init__.py"} <= names, sorted(names)
    assert not any(n.startswith("tests") for n in names), sorted(names)


def test_wheel_builds_clean_and_imports_without_triton(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__}: the wheel needs >= 77")
    # a copy of what the wheel is built from, so that the build leaves nothing in the checkout
    source = tmp_path / "source"
    source.mkdir()
    for f in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / f, source / f)
    shutil.copytree(ROOT / "src", source / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(ROOT / "benchmarks" / "results", source / "benchmarks" / "results")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", tmp_path / "dist", source],
        capture_output=True, text=True, timeout=600)
    log = build.stdout + build.stderr
    assert build.returncode == 0, log
    assert "deprecat" not in log.lower(), log
    (wheel,) = (tmp_path / "dist").glob("normbook-*.whl")
    assert wheel.name.startswith(f"normbook-{PROJECT['version']}-py3-none-any")

    # a fresh venv holding only the wheel; torch, numpy and what they need on a path beside it,
    # Triton left out (a CUDA build of torch requires it)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "--no-compile", wheel], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    farm = tmp_path / "deps"
    farm.mkdir()
    # transformers too, when the dev extra is here: the user's first call is a model's swap
    hf = importlib.util.find_spec("transformers") is not None
    _site_of(_runtime_closure(PROJECT["dependencies"] + ["transformers"] * hf,
                              leave_out={"triton"}), farm)
    assert not any(p.name.lower().startswith("triton") for p in farm.iterdir())

    code = f"""
import importlib.metadata, importlib.resources, importlib.util, sys
import torch, normbook
from normbook import batching, blocks, checks, distributed, numpy_ref, reference, residual, swap
assert importlib.util.find_spec("triton") is None
assert normbook.__file__.startswith({str(venv)!r}), normbook.__file__
assert normbook.__version__ == importlib.metadata.version("normbook") == {PROJECT['version']!r}
assert importlib.resources.files("normbook").joinpath("py.typed").is_file()
x = torch.randn(4, 8, requires_grad=True)
normbook.layer_norm(x, (8,)).sum().backward()
normbook.RMSNorm(8)(x)
assert normbook.swap_norms(torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.RMSNorm(8))) == 2
assert "triton" not in sys.modules and "transformers" not in sys.modules
print("imported", normbook.__version__)
# an RMSNorm's backward, checked by the identities alone
assert checks.check_norm_backward(normbook.RMSNorm(8), torch.randn(4, 8), kind="rms", eps=None)
# the recorded GPU runs travel with the wheel: what chapter 9 and the appendix read
from normbook.bench import plot
assert plot.results_folder() == importlib.resources.files("normbook").joinpath("bench", "recorded")
run = plot.newest_gpu_result()
assert run is not None and run["provenance"]["device_type"] == "cuda", run
assert (plot.results_folder() / "2026-12-04-h200" / "report.json").is_file()
assert (plot.results_folder() / "2026-12-04-h200" / "README.md").is_file()
if {hf!r}:
    # a tiny random Llama: its RMSNorm modules swapped, the logits unchanged
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (2, 7))
    before = model(ids).logits
    assert swap.swap_norms(model) == 5
    assert all(type(m).__module__.startswith("normbook") for n, m in model.named_modules()
               if n.endswith("norm"))
    assert torch.equal(model(ids).logits, before)
    print("swapped a Llama")
"""
    env = {"PYTHONPATH": str(farm), "PATH": os.defpath, "HOME": str(tmp_path)}
    run = subprocess.run([python, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"imported {PROJECT['version']}" in run.stdout
    assert ("swapped a Llama" in run.stdout) == hf
