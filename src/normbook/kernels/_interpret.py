"""Triton's interpreter without its repeated scan of ``triton.language`` (the same results,
about twice as fast on normbook's kernels), and rounding float32 to bfloat16 as a GPU does.

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
3.6, the GPU machine's, 3.7 and 3.8, what PyPI's CUDA builds of torch 2.12 to 2.14 pin, and
3.9, the pinned one; what it replaces is the same in all four, but for the semantic object the
patched builtins are bound to, which it does not touch); on any other it leaves Triton as it
is.
:func:`uninstall` puts the originals back (tests/test_kernels_interpret.py runs kernels both
ways and compares them bit by bit).

The rounding (:func:`install_rounding`, also installed by :mod:`normbook.kernels` under the
interpreter, on the same versions). A GPU converts float32 to bfloat16 to the nearest value,
ties to even (``cvt.rn.bf16.f32``), for ``x.to(tl.bfloat16)`` and for a float32 value stored
through a bfloat16 pointer alike. Triton's interpreter (3.6 to 3.9, ``_convert_float``)
truncates instead: its casts pass no rounding mode, and its "round to nearest even" branch
rounds halves up and drops the carry into an odd exponent. So bfloat16 results on the CPU
trailed the GPU's by up to an ulp, toward zero: a bfloat16 xhat of 0.99999938 (``rms_norm(...,
round_xhat=True)`` on a row of one value) became 0.99609375, not 1, and the float32 y that the
weight then gives was off by 2^-8 (found by tests/test_call_sequences.py). The patch converts
float32 to bfloat16 by :func:`bf16_bits` (to nearest, ties to even, as torch's ``.to`` and the
GPU; NaN stays NaN) wherever the interpreter casts with no rounding mode or asks for round to
nearest even; ``rtz``, asked for by name, keeps truncating. It also widens bfloat16 to float32
exactly (the bits as the high half): the interpreter's widening lost subnormal values (1.2e-40
came back as 0, -3.0e-40 as -5.9e-39). Nothing else changes: float16 conversions were already
numpy's, which round to nearest even.
"""

from __future__ import annotations

import inspect

import numpy as np

__all__ = ["install", "uninstall", "installed", "install_rounding", "uninstall_rounding",
           "bf16_bits", "TESTED"]

TESTED = ("3.6", "3.7", "3.8", "3.9")   # Triton major.minor versions read against, tested on

_saved: dict = {}     # the originals while installed: {"_patch_builtin": f, "_patch_lang": g}
_saved_casts: dict = {}   # InterpreterBuilder's originals while the rounding is installed


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


def _restore(saved: dict, owner) -> None:
    """Set each saved original back on ``owner`` and forget them."""
    for name, f in saved.items():
        setattr(owner, name, f)
    saved.clear()


def uninstall() -> None:
    """Put Triton's own ``_patch_builtin`` and ``_patch_lang`` back."""
    if _saved:
        from triton.runtime import interpreter as interp

        _restore(_saved, interp)


def bf16_bits(values) -> np.ndarray:
    """The bfloat16 nearest each float32 value (ties to even; NaN a quiet NaN of the same sign),
    as the uint16 bit patterns the interpreter holds bfloat16 data in, of the same shape."""
    shape = np.shape(values)
    f32 = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)   # (0-d: one value)
    bits = f32.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16     # a carry runs into the exponent
    out = rounded.astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return out.reshape(shape)


def install_rounding() -> bool:
    """Make the interpreter convert float32 to bfloat16 to nearest, ties to even, and bfloat16
    to float32 exactly (see the module docstring); True when installed (now or before), False on a Triton not in
    :data:`TESTED` or one that lacks what it replaces."""
    try:
        import triton
        from triton.runtime import interpreter as interp
        from triton.runtime.interpreter import TensorHandle
        builder, tl, rtz = interp.InterpreterBuilder, interp.tl, interp._ir.ROUNDING_MODE.RTZ
        cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp
    except (ImportError, AttributeError):
        return False
    if ".".join(triton.__version__.split(".")[:2]) not in TESTED:
        return False
    if _saved_casts:
        return True
    f32, bf16 = tl.float32, tl.bfloat16

    def _cast_impl(self, src, dst_type):     # every cast without a rounding mode
        if src.dtype.scalar == f32 and dst_type.scalar == bf16:
            return TensorHandle(bf16_bits(src.data), bf16)
        if src.dtype.scalar == bf16 and dst_type.scalar == f32:    # exact: the high half
            return TensorHandle((np.asarray(src.data, dtype=np.uint32) << 16).view(np.float32),
                                f32)
        return cast_impl(self, src, dst_type)

    def _fp_to_fp(self, src, dst_type, rounding_mode):   # .to(..., fp_downcast_rounding=)
        if src.dtype.scalar == f32 and dst_type.scalar == bf16 and rounding_mode != rtz:
            return TensorHandle(bf16_bits(src.data), bf16)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    _saved_casts.update(cast_impl=cast_impl, create_fp_to_fp=fp_to_fp)
    builder.cast_impl, builder.create_fp_to_fp = _cast_impl, _fp_to_fp
    return True


def uninstall_rounding() -> None:
    """Put the interpreter's own conversions between float32 and bfloat16 back."""
    if _saved_casts:
        from triton.runtime import interpreter as interp

        _restore(_saved_casts, interp.InterpreterBuilder)
