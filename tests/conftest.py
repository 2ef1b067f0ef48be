"""The one pytest configuration of tests/: the interpreter switch, the GPU marker, the device
and kernel fixtures, and the browser folder's gate.

Shared plain functions (inputs, the three-way accuracy bound) live in ``helpers.py``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Triton decides when a kernel is decorated whether it is compiled or interpreted, so this has
# to happen before any test module imports triton: without a GPU the kernels of
# normbook.kernels then run in Triton's interpreter on CPU tensors. With a GPU they compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

_BROWSER = Path(__file__).parent / "browser"


def pytest_ignore_collect(collection_path, config):
    """tests/browser checks the built book in a browser, so gate 1 (``pytest tests``), which runs
    before the book is built, skips that folder; ``make browser-check`` runs it by path."""
    if collection_path != _BROWSER:
        return None
    asked = [Path(str(a).split("::")[0]).resolve() for a in config.args]
    if any(a == _BROWSER or _BROWSER in a.parents for a in asked):
        return None
    return True


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device: without one they are skipped, with the reason,
    here once rather than by a ``skipif`` on each."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu; benchmarks/gpu_check.sh runs them)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """Where the kernels' tests put their tensors: "cuda" on a GPU, else "cpu" (the kernels
    then run in Triton's interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernels():
    """:mod:`normbook.kernels`, or a skip where Triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    import normbook.kernels

    return normbook.kernels
