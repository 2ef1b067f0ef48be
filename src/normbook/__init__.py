"""normbook: LayerNorm and RMSNorm, derived, checked and fused.

The package behind the normbook textbook. Public names mirror ``torch.nn.functional`` and
``torch.nn``; the derivation lives in :mod:`normbook.reference`, the invariance checks in
:mod:`normbook.checks`, the Triton kernels in :mod:`normbook.kernels` (imported only on demand:
``import normbook`` never imports triton).
"""

from __future__ import annotations

import types as _types

from normbook import _ops  # noqa: F401  (the custom ops, for exported programs)
from normbook.functional import add_layer_norm, add_rms_norm, backend, layer_norm, rms_norm
from normbook.modules import LayerNorm, RMSNorm
from normbook.swap import patch_hf, swap_norms


def _version() -> str:
    """The version in pyproject.toml, its one source: from the installed metadata (a wheel or
    ``pip install -e .``), else, in a source checkout on ``sys.path``, from pyproject.toml."""
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    try:
        return version("normbook")
    except PackageNotFoundError:
        pass
    try:
        import tomllib

        pyproject = Path(__file__).parents[2] / "pyproject.toml"     # src/normbook/ -> the root
        project = tomllib.loads(pyproject.read_text())["project"]
        if project["name"] == "normbook":
            return str(project["version"])
    except (ImportError, OSError, KeyError, ValueError):   # Python 3.10, no pyproject.toml
        pass
    return "0+unknown"


__version__ = _version()

# Submodules a user reaches as attributes after ``import normbook`` alone
# (``normbook.checks.check_norm_backward``, ``normbook.reference.layer_norm_forward``), imported
# on first use (PEP 562), so that ``import normbook`` stays as light as it is. Not the kernels
# (they import Triton, and say so when it is missing) nor the benchmarks: those are imported
# by name, ``import normbook.kernels``.
_SUBMODULES = frozenset({"reference", "checks", "batching", "blocks", "residual", "distributed",
                         "booktools", "numpy_ref"})


def __getattr__(name: str) -> _types.ModuleType:
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"normbook.{name}")
    raise AttributeError(f"module 'normbook' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SUBMODULES)

__all__ = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "LayerNorm", "RMSNorm", "backend",
           "swap_norms", "patch_hf", "__version__"]
