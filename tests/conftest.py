"""Shared pytest configuration for tests/."""

from __future__ import annotations

import os

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
