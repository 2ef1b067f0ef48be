"""normbook._math: its eager shortcuts against its own formulas and the float64 reference.

Where no graph records a call, ``_math.forward`` takes ``torch.native_layer_norm`` for an fp32
LayerNorm, and ``_math.backward`` hands a LayerNorm's centred rows to torch's fused backward
kernel or reuses two buffers in place; a recorded call (double backward,
torch.func, torch.compile) keeps the plain formulas. Each test compares the two, or the eager
path against :mod:`normbook.reference` in float64, and the double-backward tests check that a
graph through ``_math.backward`` still gives torch's second derivatives.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import normbook
from normbook import _math, reference

EPS = 1e-5
F32 = torch.finfo(torch.float32).eps


def _recorded(fn, *ts):
    """``fn(*ts)`` through the formulas: with grad enabled and x requiring grad, a graph records
    the call, so no shortcut may be taken. Outputs detached, Nones kept."""
    x, *rest = ts
    with torch.enable_grad():
        out = fn(x.detach().requires_grad_(), *rest)
    return tuple(None if o is None else o.detach() for o in out)


def _forward(x, w, b, eps=EPS, is_rms=False):
    return _math.forward(x, w, b, eps, is_rms)


def _inputs(shape, seed=0, dtype=torch.float32, offset=0.5):
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + offset).to(dtype)
    w = (1 + 0.5 * torch.randn(D, generator=g, dtype=torch.float64)).to(dtype)
    b = (0.5 * torch.randn(D, generator=g, dtype=torch.float64)).to(dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, w, b, dy


@pytest.fixture
def native_calls(monkeypatch):
    """Counts the calls of torch.native_layer_norm, to see which path a forward took."""
    calls = []
    real = torch.native_layer_norm

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)
    monkeypatch.setattr(torch, "native_layer_norm", spy)
    return calls


@pytest.fixture(params=["fused", "fused-blocks", "blocked", "formulas"])
def backward_path(request, monkeypatch):
    """Each backward test through each eager path, whatever the test's shape: LayerNorm's fused
    kernel on the centred rows (``_backward_fused``, which an fp32 LayerNorm takes where every
    rstd is moderate), all rows at once and in blocks (3 rows at D = 4097, more if narrower);
    the blocked formulas (``_backward_eager``, which other calls of at least ``_BLOCKED_MIN``
    values take); and the plain formulas (which smaller calls take). RMSNorm has no fused path:
    its "fused" runs take the blocked formulas."""
    fused = request.param.startswith("fused")
    monkeypatch.setattr(_math, "_takes_fused", _math._takes_fused if fused else lambda *a: False)
    monkeypatch.setattr(_math, "_BLOCKED_MIN", 1 << 62 if request.param == "formulas" else 0)
    if request.param == "fused-blocks":
        monkeypatch.setattr(_math, "_FUSED_MAX", 0)
        monkeypatch.setattr(_math, "_BLOCK_PER_THREAD", 3 * 4097 // torch.get_num_threads() + 1)
    return request.param


# ---- forward: torch's fused kernel against the formulas ----------------------------------------

# fp32 tolerance: the fused kernel sums each row in another order than torch's mean (both
# vectorised, error growing like log D), so the statistics may differ in the last few bits, and
# y = xhat * weight + bias by a few ulps of its largest value.
TOL = dict(rtol=8 * F32, atol=8 * F32)


@pytest.mark.parametrize("shape", [(1,), (3,), (4, 1), (5, 3), (2, 3, 760), (7, 1000), (2, 4097)])
@pytest.mark.parametrize("params", ["both", "weight", "none"])
def test_fused_forward_matches_the_formulas(shape, params, native_calls):
    x, w, b, _ = _inputs(shape)
    w, b = {"both": (w, b), "weight": (w, None), "none": (None, None)}[params]
    y, mean, rstd = _forward(x, w, b)
    assert native_calls, "an fp32 LayerNorm outside a graph takes torch.native_layer_norm"
    y0, mean0, rstd0 = _recorded(_forward, x, w, b)
    assert mean.shape == rstd.shape == (*shape[:-1], 1)
    torch.testing.assert_close(mean, mean0, **TOL)
    torch.testing.assert_close(rstd, rstd0, **TOL)
    torch.testing.assert_close(y, y0, **TOL)


def test_bf16_inputs_upcast_by_the_caller(native_calls):
    """The caller hands _math bf16 inputs upcast to fp32: exact values, the same fused path."""
    x, w, b, _ = (t.bfloat16().float() for t in _inputs((64, 1024), seed=1))
    y, mean, rstd = _forward(x, w, b)
    assert native_calls
    for got, want in zip((y, mean, rstd), _recorded(_forward, x, w, b)):
        torch.testing.assert_close(got, want, **TOL)


def test_overflowing_rows_fall_back_to_the_rescue(native_calls):
    """Rows near 1e20 (their squares overflow fp32: the fused kernel gives rstd NaN) among ordinary
    rows: the call is redone by the formulas, whose rescue gives every row finite and right
    against float64: a few ulps of the output scale, as the other overflow tests allow."""
    x, w, b, _ = _inputs((6, 300), seed=2)
    x[1] *= 1e20
    x[4] = x[4] * 3e19 + 1e20
    y, mean, rstd = _forward(x, w, b)
    assert native_calls
    assert torch.isfinite(y).all() and (rstd > 0).all()
    y64, mean64, rstd64 = reference.layer_norm_forward(x.double(), w.double(), b.double(), EPS)
    assert (y.double() - y64).abs().max() <= 16 * F32 * y64.abs().max()
    torch.testing.assert_close(mean.squeeze(-1).double(), mean64, rtol=4 * F32, atol=0)
    torch.testing.assert_close(rstd.squeeze(-1).double(), rstd64, rtol=16 * F32, atol=0)


def test_zero_rows_and_one_feature():
    """A zero row and D = 1: var = 0, so rstd = 1/sqrt(eps), xhat = 0 and y = bias exactly."""
    for shape in ((3, 8), (5, 1)):
        x, w, b, _ = _inputs(shape, seed=3)
        if shape[-1] == 8:
            x[1] = 0
        y, mean, rstd = _forward(x, w, b)
        zero = slice(1, 2) if shape[-1] == 8 else slice(None)
        torch.testing.assert_close(y[zero], b.expand_as(y[zero]), rtol=0, atol=0)
        torch.testing.assert_close(rstd[zero], torch.full_like(rstd[zero], 1 / math.sqrt(EPS)),
                                   rtol=F32, atol=0)


def test_eps_as_a_tensor_gives_the_float_eps_result():
    """A 0-d tensor eps takes the formulas (the fused kernel wants a float) and agrees."""
    x, w, b, _ = _inputs((4, 33), seed=4)
    for is_rms in (False, True):
        got = _forward(x, w, b, torch.tensor(EPS), is_rms)
        want = _forward(x, w, b, EPS, is_rms)
        for g, t in zip(got, want):
            if t is None:
                assert g is None
            else:
                torch.testing.assert_close(g, t, **TOL)


def test_float64_and_recorded_calls_keep_the_formulas(native_calls):
    """float64 (the precision other code compares against, to 1e-12) and any call a graph records
    never take the fused kernel."""
    x, w, b, _ = _inputs((4, 16), dtype=torch.float64)
    _forward(x, w, b)
    _recorded(_forward, x.float(), w.float(), b.float())
    assert not native_calls


# ---- backward: the in-place form against float64 and against the formulas ---------------------

@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("shape", [(1,), (5,), (3, 1), (4, 3), (2, 3, 760), (64, 1000), (3, 4097)])
def test_backward_within_twice_the_formulas_error(shape, is_rms, backward_path):
    """The eager backward (blocks of rows, c2 as a matrix-vector product) against the float64
    reference: within twice the error of the plain formulas on the same fp32 inputs, plus 2 ulps
    of the scale of the terms (either may round a borderline value the other way). dx is the
    difference ghat - c1 - c2 * xhat, times rstd, so its scale is that of rstd * ghat, not of dx
    (at D = 1 the terms cancel exactly, and a product rounded once in one order and fused in the
    other leaves an ulp of rstd * ghat). dweight and dbias sum over the rows, whose rounding
    grows like sqrt(rows), hence the sqrt in their allowance."""
    x, w, b, dy = _inputs(shape, seed=5)
    mean, rstd = _math.stats(x, EPS, is_rms)
    got = _math.backward(dy, x, w, mean, rstd, not is_rms)
    base = _recorded(lambda x_, *a: _math.backward(dy, x_, *a), x, w, mean, rstd, not is_rms)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    if is_rms:
        _, r64 = reference.rms_norm_forward(x64, w64, EPS)
        ref = (*reference.rms_norm_backward(dy64, x64, w64, r64), None)
    else:
        _, m64, r64 = reference.layer_norm_forward(x64, w64, None, EPS)
        ref = reference.layer_norm_backward(dy64, x64, w64, m64, r64)
    rows = math.prod(shape[:-1])
    terms = (r64.unsqueeze(-1) * dy64 * w64).abs().max().item()      # scale of rstd * ghat
    scales = [terms] + [None if r is None else r.abs().max().item() for r in ref[1:]]
    for name, g, b0, r, n, scale in zip(("dx", "dweight", "dbias"), got, base, ref,
                                        (1, rows, rows), scales):
        if r is None:
            assert g is None and b0 is None, name
            continue
        assert g.shape == r.shape and g.dtype == torch.float32, name
        allow = 2 * F32 * scale * math.sqrt(n)
        err, err0 = (g.double() - r).abs().max().item(), (b0.double() - r).abs().max().item()
        assert err <= 2 * err0 + allow, (name, err, err0, allow)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["blocked LayerNorm", "blocked RMSNorm", "fused LayerNorm"])
def test_backward_blocks_add_up_to_one_block(monkeypatch, path, dtype):
    """Rows taken a few at a time (blocks of 3 rows on one thread, 6 on two, the last one
    short: 67 rows) give what one block of every row gives, within rounding: each row's c1
    and c2 are its own (a matrix-vector product over a block of another height may add in
    another order: ulps of rstd * ghat), and dweight and dbias add the blocks in another order.
    The test shapes above fit in one block; this one crosses 12 or more of them. The fused
    path's one block is, in fp32, all rows at once (no buffer, no copy)."""
    is_rms = path.endswith("RMSNorm")
    fn = _math._backward_fused if path.startswith("fused") else _math._backward_eager
    x, w, b, dy = _inputs((67, 300), seed=11)
    x, dy = x.to(dtype), dy.to(dtype)
    mean, rstd = _math.stats(x.float(), EPS, is_rms)
    with torch.no_grad():
        one = fn(dy, x, w, mean, rstd, not is_rms)
        monkeypatch.setattr(_math, "_BLOCK_PER_THREAD", 3 * 300 // torch.get_num_threads() + 1)
        monkeypatch.setattr(_math, "_FUSED_MAX", 0)
        blocks = fn(dy, x, w, mean, rstd, not is_rms)
    terms = (rstd * dy.float() * w).abs().max().item()              # scale of rstd * ghat
    assert (blocks[0].float() - one[0].float()).abs().max().item() <= 4 * F32 * terms + (
        0 if dtype == torch.float32 else torch.finfo(dtype).eps * one[0].abs().max().item())
    for got, ref in zip(blocks[1:], one[1:]):
        if ref is None:
            assert got is None
        else:
            assert torch.allclose(got, ref, rtol=0, atol=8 * F32 * ref.abs().max().item())


@pytest.mark.parametrize("is_rms", [False, True])
def test_backward_of_rows_near_the_fp32_limits(is_rms, backward_path):
    """Rows near 1e20 and 1e36 (their squares overflow fp32; rstd near 1e-20 and 1e-36) beside
    ordinary ones: the eager backward stays finite and within the formulas' error of float64
    (xhat is formed before any product, so nothing of size x^2 or rstd^2 appears)."""
    x, w, _, dy = _inputs((4, 200), seed=10)
    x[1] *= 1e20
    x[2] *= 1e36
    mean, rstd = _math.stats(x, EPS, is_rms)
    got = _math.backward(dy, x, w, mean, rstd, False)
    base = _recorded(lambda x_, *a: _math.backward(dy, x_, *a), x, w, mean, rstd, False)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    if is_rms:
        _, r64 = reference.rms_norm_forward(x64, w64, EPS)
        ref = reference.rms_norm_backward(dy64, x64, w64, r64)
    else:
        _, m64, r64 = reference.layer_norm_forward(x64, w64, None, EPS)
        ref = reference.layer_norm_backward(dy64, x64, w64, m64, r64)[:2]
    for row in range(4):          # per row: each has its own scale
        terms = (r64[row] * dy64[row] * w64).abs().max().item()
        g, b0, r = got[0][row], base[0][row], ref[0][row]
        assert torch.isfinite(g).all()
        err, err0 = (g.double() - r).abs().max().item(), (b0.double() - r).abs().max().item()
        assert err <= 2 * err0 + 2 * F32 * terms, (row, err, err0, terms)
    scale = ref[1].abs().max().item()
    err, err0 = ((t.double() - ref[1]).abs().max().item() for t in (got[1], base[1]))
    assert err <= 2 * err0 + 4 * F32 * scale, (err, err0)


def _ln_reference(x, w, dy):
    """dx, dweight, dbias of a LayerNorm of x in float64 (the reference's own statistics)."""
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    _, m64, r64 = reference.layer_norm_forward(x64, w64, None, EPS)
    return reference.layer_norm_backward(dy64, x64, w64, m64, r64)


def _rel_errors(got, ref):
    return [((g.double() - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref)]


def test_fused_backward_keeps_the_centred_precision():
    """Rows whose mean is some 1500 standard deviations from 0: torch's fused kernel, handed the
    centred rows, is as close to float64 as the book's formulas (within twice their error plus
    an ulp), while the same kernel handed x itself and the mean (torch's own form, which
    centres inside a difference of two row sums) is not: the bound the test sets is one that
    form fails."""
    x, w, _, dy = _inputs((256, 1000), seed=12, offset=3000.0)
    mean, rstd = _math.stats(x, EPS, False)
    assert _math._takes_fused(dy, x, w, mean, rstd)
    ref = _ln_reference(x, w, dy)
    fused = _rel_errors(_math._backward_fused(dy, x, w, mean, rstd, True), ref)
    formulas = _rel_errors(_recorded(lambda x_, *a: _math.backward(dy, x_, *a),
                                     x, w, mean, rstd, True), ref)
    uncentred = _rel_errors(_math._native_backward(dy, x, (1000,), mean, rstd, w, w,
                                                   [True, True, True]), ref)
    for name, f, b in zip(("dx", "dweight", "dbias"), fused, formulas):
        assert f <= 2 * b + F32, (name, f, b)
    assert uncentred[0] > 2 * formulas[0] + F32, (uncentred[0], formulas[0])


@pytest.mark.parametrize("bad", ["near 1e20", "NaN"])
def test_extreme_or_nan_rstd_keeps_the_fused_kernel_out(bad):
    """A row whose rstd^3 would not be a normal fp32 number (values near 1e20: rstd near 1e-20),
    or a NaN row, sends the whole call to the paths that form no power of rstd; ordinary rows
    take the fused kernel."""
    x, w, _, dy = _inputs((64, 1000), seed=13)
    mean, rstd = _math.stats(x, EPS, False)
    assert _math._takes_fused(dy, x, w, mean, rstd)
    if bad == "NaN":
        x[5, 7] = float("nan")
    else:
        x[5] *= 1e20
    mean, rstd = _math.stats(x, EPS, False)
    assert not _math._takes_fused(dy, x, w, mean, rstd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_bf16_sums_the_parameters_in_fp32(dtype):
    """bf16 rows: the fused path copies each block into fp32 before the kernel, so dweight and
    dbias sum in fp32 (torch's kernel on the bf16 rows themselves sums them in bf16: 8e-2 of
    dweight's largest value at 4096 x 1024, measured): within 1e-5 of float64 on the same bf16 values,
    and dx within an ulp of bf16."""
    x, w, _, dy = _inputs((2048, 1024), seed=14, offset=30.0)
    x, dy = x.to(dtype), dy.to(dtype)
    mean, rstd = _math.stats(x.float(), EPS, False)
    got = _math._backward_fused(dy, x, w, mean, rstd, True)
    assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == torch.float32
    dx, dweight, dbias = _rel_errors(got, _ln_reference(x, w, dy))
    assert dweight <= 1e-5 and dbias <= 1e-5, (dweight, dbias)
    assert dx <= 2 * torch.finfo(dtype).eps, dx


def test_fused_scratch_is_reused_per_thread_and_never_returned():
    """The fp32 CPU call centres its rows in its thread's scratch buffer, kept from call to
    call: a larger call grows it, a smaller one uses a part of it; no gradient handed back
    shares its memory; another thread has its own; a default dtype of float64 changes
    nothing. Each result is the formulas' to rounding."""
    import threading

    def check(shape, seed):
        x, w, _, dy = _inputs(shape, seed=seed)
        mean, rstd = _math.stats(x, EPS, False)
        got = _math._backward_fused(dy, x, w, mean, rstd, True)
        want = _recorded(lambda x_, *a: _math.backward(dy, x_, *a), x, w, mean, rstd, True)
        for g, t in zip(got, want):
            torch.testing.assert_close(g, t, rtol=16 * F32, atol=16 * F32 * t.abs().max().item())
        return got

    if hasattr(_math._scratch, "rows"):         # this thread's, from an earlier test
        del _math._scratch.rows
    check((8, 100), 20)
    first = _math._scratch.rows
    got = check((64, 300), 21)                               # grows it
    scratch = _math._scratch.rows
    assert scratch.numel() == 64 * 300 and scratch.data_ptr() != first.data_ptr()
    check((5, 7), 22)                                        # a part of it
    assert _math._scratch.rows is scratch
    lo, hi = scratch.data_ptr(), scratch.data_ptr() + scratch.numel() * 4
    assert all(not lo <= g.data_ptr() < hi for g in got)
    seen = []
    thread = threading.Thread(target=lambda: (check((32, 300), 23),
                                              seen.append(_math._scratch.rows)))
    thread.start()
    thread.join()
    assert seen and seen[0].data_ptr() != scratch.data_ptr()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        del _math._scratch.rows
        check((16, 50), 24)
        assert _math._scratch.rows.dtype == torch.float32
    finally:
        torch.set_default_dtype(default)


def test_fused_scratch_made_in_inference_mode_serves_outside_it():
    """A backward run under ``torch.inference_mode()`` (autograd allows it for a graph recorded
    outside) may be the one that makes the scratch: it must be a normal tensor, which a later
    backward outside inference mode can write (an inference tensor it could not)."""
    if hasattr(_math._scratch, "rows"):
        del _math._scratch.rows
    x, w, _, dy = _inputs((16, 64), seed=25)
    x.requires_grad_()
    for inference in (True, False):
        x.grad = None
        with normbook.backend("torch"):
            out = normbook.layer_norm(x, (64,), w)
        with torch.inference_mode(inference):
            out.backward(dy)
        assert not _math._scratch.rows.is_inference()
        want = _recorded(lambda x_, *a: _math.backward(dy, x_, *a),
                         x.detach(), w, *_math.stats(x.detach(), EPS, False), False)[0]
        torch.testing.assert_close(x.grad, want, rtol=16 * F32, atol=16 * F32)


def test_small_calls_keep_the_formulas_and_large_ones_take_blocks(monkeypatch):
    """The blocked backward's dozens of small ops cost a small call more host time than the
    formulas' passes: RMSNorm calls below ``_BLOCKED_MIN`` values keep the formulas, larger
    ones take the blocks (both directly and through the half-precision route of the torch
    backend). A LayerNorm takes the fused kernel at either size (a handful of ops)."""
    taken = {"blocks": [], "fused": []}
    for name, path in (("blocks", "_backward_eager"), ("fused", "_backward_fused")):
        real = getattr(_math, path)
        monkeypatch.setattr(_math, path, lambda *a, real=real, name=name:
                            taken[name].append(a[1].numel()) or real(*a))
    D = 256
    for rows in (_math._BLOCKED_MIN // D - 1, _math._BLOCKED_MIN // D):
        for dtype in (torch.float32, torch.bfloat16):
            for norm in (normbook.rms_norm, normbook.layer_norm):
                x = torch.randn(rows, D, dtype=dtype, requires_grad=True)
                with normbook.backend("torch"):
                    norm(x, (D,), torch.ones(D, requires_grad=True)).sum().backward()
    assert taken["blocks"] == [_math._BLOCKED_MIN] * 2
    assert taken["fused"] == [_math._BLOCKED_MIN - D] * 2 + [_math._BLOCKED_MIN] * 2


def test_backward_of_one_token_returns_its_own_dweight(backward_path):
    """A 1-D x is one token: dweight = dy * xhat itself, which must not share the buffer that
    becomes dx."""
    x, w, _, dy = _inputs((9,), seed=6)
    mean, rstd = _math.stats(x, EPS, False)
    dx, dweight, dbias = _math.backward(dy, x, w, mean, rstd, True)
    torch.testing.assert_close(dweight, dy * _math.xhat(x, mean, rstd), **TOL)
    torch.testing.assert_close(dbias, dy)
    assert dweight.data_ptr() != dx.data_ptr()


def test_backward_does_not_write_its_inputs(backward_path):
    x, w, _, dy = _inputs((4, 50), seed=7)
    mean, rstd = _math.stats(x, EPS, False)
    before = [t.clone() for t in (dy, x, w, mean, rstd)]
    _math.backward(dy, x, w, mean, rstd, True)
    for t, t0 in zip((dy, x, w, mean, rstd), before):
        assert torch.equal(t, t0)


# ---- through the public functions: first and second derivatives ------------------------------

def _norms(D):
    return {"layer": lambda x, w, b: normbook.layer_norm(x, (D,), w, b),
            "rms": lambda x, w, b: normbook.rms_norm(x, (D,), w, eps=EPS)}


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("shape", [(3, 5), (2, 2, 1), (4,)])
def test_gradcheck_and_gradgradcheck_in_float64(norm, shape):
    """float64 finite differences through normbook on the torch backend: first derivatives (the
    eager backward) and second (a graph through _math.backward's formulas)."""
    x, w, b, _ = _inputs(shape, seed=8, dtype=torch.float64)
    D = shape[-1]
    fn, ins = {"layer": (lambda *t: normbook.layer_norm(t[0], (D,), *t[1:]), (x, w, b)),
               "rms": (lambda *t: normbook.rms_norm(t[0], (D,), t[1], eps=EPS), (x, w))}[norm]
    ins = tuple(t.requires_grad_() for t in ins)
    with normbook.backend("torch"):
        assert torch.autograd.gradcheck(fn, ins)
        assert torch.autograd.gradgradcheck(fn, ins)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_double_backward_in_fp32_matches_torch(norm):
    """A gradient penalty, ||dL/dx||^2 differentiated again, in fp32 against torch's own double
    backward: fp32 rounding of a few chained sums, so a relative 1e-4 of the scale."""
    D = 48
    x, w, b, dy = _inputs((6, D), seed=9)
    torch_fn = {"layer": lambda x_, w_, b_: F.layer_norm(x_, (D,), w_, b_, EPS),
                "rms": lambda x_, w_, b_: F.rms_norm(x_, (D,), w_, EPS)}[norm]
    results = []
    for fn in (_norms(D)[norm], torch_fn):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        with normbook.backend("torch"):
            y = fn(*leaves)
            (gx,) = torch.autograd.grad(y, leaves[0], dy, create_graph=True)
            grads = torch.autograd.grad(gx.square().sum(), leaves[:2])
        results.append(grads)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("M, D", [(65536, 8), (4096, 256)])
def test_parameter_gradients_sum_tokens_as_accurately_as_torch(norm, M, D):
    """The blocked backward (_math._backward_eager: RMSNorm's on the torch backend, and
    LayerNorm's for half rows or extreme rstd) summed a block's rows into dweight and dbias with
    addmv, one row after another: with rows whose terms keep a sign its float32 error grew with
    the rows, 10 to 40 times torch's own backward's. Its sums are now within twice torch's.
    Called directly, so that LayerNorm's fp32 rows (which take torch's fused backward through
    the public function) test it too, dbias included."""
    g = torch.Generator().manual_seed(0)
    x = torch.linspace(-2, 2, D) + 0.1 * torch.randn(M, D, generator=g)   # columns keep a sign
    w = (torch.randn(D, generator=g) + 1).requires_grad_()
    b = torch.randn(D, generator=g).requires_grad_()
    dy = torch.randn(M, D, generator=g) + 3                               # so do the gradients
    is_rms = norm == "rms_norm"
    x64 = x.double()
    mean = None if is_rms else x64.mean(-1)
    var = (x64 * x64).mean(-1) if is_rms else x64.var(-1, unbiased=False)
    rstd = torch.rsqrt(var + 1e-5)
    _, dw, db = _math._backward_eager(dy, x, w.detach(), None if is_rms else mean.float(),
                                      rstd.float(), not is_rms)
    args = (w,) if is_rms else (w, b)
    xt = x.clone().requires_grad_()
    ref = torch.autograd.grad(getattr(F, norm)(xt, (D,), *args, eps=1e-5), args, dy)
    p64 = [a.detach().double().requires_grad_() for a in args]
    exact = torch.autograd.grad(getattr(F, norm)(x64, (D,), *p64, eps=1e-5), p64, dy.double())
    for ours, theirs, want in zip((dw, db), ref, exact):
        scale = want.abs().max()
        err, torch_err = ((ours.double() - want).abs().max() / scale,
                          (theirs.double() - want).abs().max() / scale)
        assert err <= 2 * torch_err + 2 * torch.finfo(torch.float32).eps
