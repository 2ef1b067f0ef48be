"""normbook.kernels._interpret: Triton's interpreter without its rescans gives the same bits."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from normbook.kernels import _interpret, ops  # noqa: E402

pytestmark = pytest.mark.skipif(not ops.interpreted(), reason="Triton's interpreter is not running")


@pytest.fixture
def both_ways():
    """Calls a function with Triton's interpreter as it ships and as installed; returns both."""
    def run(f):
        assert _interpret.installed()
        _interpret.uninstall()
        try:
            as_shipped = f()
        finally:
            assert _interpret.install()
        return as_shipped, f()
    return run


def _fused_add(norm, D, dtype):
    g = torch.Generator().manual_seed(D)
    x, r, dy, dh = (torch.randn(3, D, generator=g).to(dtype) for _ in range(4))
    w = torch.randn(D, generator=g).to(dtype)
    x.requires_grad_(), r.requires_grad_(), w.requires_grad_()
    from normbook import kernels as K
    if norm == "layer":
        y, h = K.add_layer_norm(x, r, w, w)
    else:
        y, h = K.add_rms_norm(x, r, w)
    torch.autograd.backward((y, h), (dy, dh))
    return [t.detach().clone() for t in (y, h, x.grad, r.grad, w.grad)]


@pytest.mark.parametrize("norm,D", [("layer", 300), ("rms", 300), ("layer", 20000)])
def test_normbook_kernels_give_the_same_bits(both_ways, norm, D):
    """Rows in one program, and (D = 20000) a row shared by programs with its helpers called
    in loops: forward and backward, bit for bit, with and without the install."""
    shipped, installed = both_ways(lambda: _fused_add(norm, D, torch.bfloat16))
    for a, b, name in zip(installed, shipped, ("y", "h", "dx", "dresidual", "dweight")):
        assert torch.equal(a, b), name


@triton.jit
def _helper(v, k: tl.constexpr):
    return tl.where(v > 0, v * k, tl.exp(v))


@triton.jit
def _kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, tl.sum(_helper(v, 3.0), axis=0) + _helper(v, 2.0), mask=offs < n)


def test_a_kernel_of_another_module_is_unchanged(both_ways):
    """Someone else's kernel in the same process, with a helper: the same bits, and the
    language is restored after each launch."""
    x = torch.randn(100, generator=torch.Generator().manual_seed(1))

    def run():
        y = torch.empty_like(x)
        _kernel[(4,)](x, y, 100, BLOCK=32)
        return y
    shipped, installed = both_ways(run)
    assert torch.equal(installed, shipped)
    assert tl.core.is_builtin(tl.load)      # restored after the grid
    assert tl.core.is_builtin(tl.tensor.to)


def test_the_same_swaps_as_the_full_scan():
    """The cached walk swaps exactly the attributes the original scan swaps, package by
    package (compared on scopes that are restored at once)."""
    from triton.runtime import interpreter as interp

    tl = interp.tl
    assert _interpret.installed()
    original = _interpret._saved["_patch_builtin"]
    for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        swapped = []
        for f in (original, interp._patch_builtin):
            scope = interp._LangPatchScope()
            f(pkg, interp.interpreter_builder, scope)
            swapped.append(sorted(name for _, name, _ in scope._changes))
            scope.restore()
        assert swapped[0] == swapped[1] and swapped[0], pkg


def test_install_is_idempotent_and_uninstall_restores():
    from triton.runtime import interpreter as interp

    ours = interp._patch_lang
    assert _interpret.install() and interp._patch_lang is ours
    _interpret.uninstall()
    try:
        assert not _interpret.installed()
        assert interp._patch_lang.__module__ == "triton.runtime.interpreter"
    finally:
        assert _interpret.install()


def test_an_untested_triton_is_left_as_it_is(monkeypatch):
    """On a Triton version it was not read against, install changes nothing."""
    from triton.runtime import interpreter as interp

    _interpret.uninstall()
    try:
        shipped = interp._patch_lang
        monkeypatch.setattr(triton, "__version__", "3.10.0")
        assert not _interpret.install() and not _interpret.installed()
        assert interp._patch_lang is shipped
    finally:
        monkeypatch.undo()
        assert _interpret.install()
    assert triton.__version__.startswith(_interpret.TESTED)
