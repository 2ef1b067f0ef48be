"""normbook.kernels._interpret: Triton's interpreter without its rescans gives the same bits,
and it rounds float32 to bfloat16 as torch and a GPU do."""

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


# ---- the rounding: float32 to bfloat16 to nearest, ties to even ------------------------------

def _awkward_floats() -> torch.Tensor:
    """Float32 values of every magnitude, subnormals and the edges included: halfway cases
    (ties), carries into the next exponent (odd and even), overflow to infinity, NaN."""
    g = torch.Generator().manual_seed(0)
    scale = 10.0 ** torch.randint(-44, 39, (20000,), generator=g).float()
    edges = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4e38, -3.39e38, 1e-40,
             -1e-41, 0.99999938, 1.00390625, 1.001953125, 1.005859375, 3.9921875 + 2 ** -8]
    return torch.cat([torch.randn(20000, generator=g) * scale, torch.tensor(edges)]).float()


def test_bf16_bits_round_as_torch():
    x = _awkward_floats()
    want = x.to(torch.bfloat16).view(torch.int16).numpy().view("uint16")
    got = _interpret.bf16_bits(x.numpy())
    number = ~torch.isnan(x).numpy()
    assert (got[number] == want[number]).all()
    assert torch.isnan(torch.from_numpy(got.view("int16")).view(torch.bfloat16)[~number]).all()
    assert _interpret.bf16_bits(torch.tensor(0.99999938).numpy()).shape == ()


@triton.jit
def _to_bf16(x_ptr, cast_ptr, stored_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(cast_ptr + offs, v.to(tl.bfloat16).to(tl.float32), mask=offs < n)
    tl.store(stored_ptr + offs, v, mask=offs < n)         # cast by the store


def _rounded_by_a_kernel(x):
    cast, stored = torch.empty_like(x), torch.empty(x.shape, dtype=torch.bfloat16)
    _to_bf16[(triton.cdiv(x.numel(), 1024),)](x, cast, stored, x.numel(), BLOCK=1024)
    return cast, stored


def test_a_kernel_rounds_to_bf16_as_torch_and_as_shipped_it_truncates():
    """With the rounding installed, a kernel's ``.to(tl.bfloat16)`` and its store of float32
    values through a bfloat16 pointer give torch's bits (a GPU's); as Triton ships (3.6, 3.9)
    the interpreter truncates, which is what the patch is for."""
    x = _awkward_floats()
    x = x[~torch.isnan(x)]
    want = x.to(torch.bfloat16)
    cast, stored = _rounded_by_a_kernel(x)
    assert torch.equal(cast, want.float()) and torch.equal(stored, want)
    _interpret.uninstall_rounding()
    try:
        cast, stored = _rounded_by_a_kernel(torch.tensor([0.99999938]))
    finally:
        assert _interpret.install_rounding()
    assert cast.item() == stored.float().item() == 0.99609375     # truncated: 1 - 2^-8


def test_the_rounding_install_is_idempotent_and_uninstall_restores():
    from triton.runtime import interpreter as interp

    ours = interp.InterpreterBuilder.cast_impl
    assert _interpret.install_rounding() and interp.InterpreterBuilder.cast_impl is ours
    _interpret.uninstall_rounding()
    try:
        assert interp.InterpreterBuilder.cast_impl is not ours
    finally:
        assert _interpret.install_rounding()
