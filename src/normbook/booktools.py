"""Small helpers the book's chapters use to put computed values into the prose.

Not part of the numerical API. ``claim`` glues a value formatted as text (never a raw float,
which would render as ``1.7e-16``) so that every number in a chapter's prose comes from a cell;
the cell asserts the claim next to it.
"""

from __future__ import annotations

import os


class _Text(str):
    """A string whose repr is itself, so myst-nb's glue shows it without quotes."""

    def __repr__(self) -> str:
        return str(self)


def claim(name: str, value, fmt: str = ""):
    """Glue ``format(value, fmt)`` under ``name`` for ``{glue}`name``` in the prose; return ``value``.

    Outside a notebook kernel (plain python, pytest) it only returns the value.
    """
    text = _Text(format(value, fmt))
    try:
        from myst_nb import glue
    except ImportError:  # pragma: no cover - myst-nb is a book dependency only
        return value
    glue(name, text, display=False)
    return value


def triton_available() -> bool:
    """Whether Triton can run here: installed, and interpreter mode on (no GPU in the book build)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False
    import torch

    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
