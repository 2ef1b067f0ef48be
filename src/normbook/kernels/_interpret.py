"""Triton's interpreter without its repeated scan of ``triton.language``: the same results,
about twice as fast on normbook's kernels.

Under TRITON_INTERPRET=1, every call of a ``@triton.jit`` function, the kernel and each helper
it calls (normbook's kernels call helpers inside their loops), begins with
``triton.runtime.interpreter._patch_lang``: ``inspect.getmembers`` over ``triton.language``,
its ``tensor`` class, ``math`` and the descriptor class (some 360 attributes, sorted), to
swap every builtin for the interpreter's version. For a helper called inside a kernel this
finds nothing left to swap: the kernel's own call swapped them, and they stay swapped until the
kernel's grid is done. Measured (Triton 3.9, one fwd+bwd of the fused add LayerNorm, 2 x 40000
bf16): 9.1 s as Triton ships, 4.3 s with :func:`install`, bitwise the same outputs.

:func:`install` changes two things, and nothing a kernel computes:

- ``_patch_builtin`` walks the builtin names found once, at install (when nothing is
  swapped), and swaps those whose attribute is still the builtin, as the original does after
  its full scan: the same swaps;
- ``_patch_lang`` returns an empty scope, without scanning, for a function whose language
  modules are all swapped already (a helper inside a running kernel); anything else (a
  kernel's own launch, a module not yet swapped) takes the original, whose scope the launch
  restores as before.

It is installed by :mod:`normbook.kernels` when the interpreter runs the kernels, and only on
the Triton versions whose interpreter it was read against and is tested on (:data:`TESTED`:
3.6, the GPU machine's, and 3.9, the pinned one); on any other it leaves Triton as it is.
:func:`uninstall` puts the originals back (tests/test_kernels_interpret.py runs kernels both
ways and compares them bit by bit).
"""

from __future__ import annotations

import inspect

__all__ = ["install", "uninstall", "installed", "TESTED"]

TESTED = ("3.6", "3.9")   # Triton's major.minor versions this was read against and is tested on

_saved: dict = {}     # the originals while installed: {"_patch_builtin": f, "_patch_lang": g}


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_saved)


def install() -> bool:
    """Replace the interpreter's two scanning functions (see the module docstring); True when
    installed (now or before), False on a Triton not in :data:`TESTED` or one that lacks what
    it replaces."""
    try:
        import triton
        from triton.runtime import interpreter as interp
        tl = interp.tl
        is_builtin = tl.core.is_builtin
        patch_attr, scope_class = interp._patch_attr, interp._LangPatchScope
        original_builtin, original_lang = interp._patch_builtin, interp._patch_lang
        packages = (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)
    except (ImportError, AttributeError):
        return False
    if ".".join(triton.__version__.split(".")[:2]) not in TESTED:
        return False
    if _saved:
        return True
    names = {id(p): [n for n, m in inspect.getmembers(p) if is_builtin(m)] for p in packages}
    if not is_builtin(getattr(tl, "load", None)) or not is_builtin(getattr(tl.tensor, "to", None)):
        return False   # a kernel is running, or this Triton names its builtins otherwise

    def _patch_builtin(pkg, builder, scope):
        found = names.get(id(pkg))
        if found is None:
            return original_builtin(pkg, builder, scope)
        for name in found:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    langs_of: dict = {}   # fn -> the language modules its globals name, as _patch_lang finds them

    def _patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = [v for v in fn.__globals__.values()
                                    if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and not any(is_builtin(lang.load) or is_builtin(lang.tensor.to) for lang in langs):
            return scope_class()          # all swapped by the running kernel: nothing to do
        return original_lang(fn)

    _saved.update(_patch_builtin=original_builtin, _patch_lang=original_lang)
    interp._patch_builtin, interp._patch_lang = _patch_builtin, _patch_lang
    return True


def uninstall() -> None:
    """Put Triton's own ``_patch_builtin`` and ``_patch_lang`` back."""
    if _saved:
        from triton.runtime import interpreter as interp

        for name, f in _saved.items():
            setattr(interp, name, f)
        _saved.clear()
