"""The Triton kernels against the float64 reference, three ways.

For every output, the kernel's error against normbook.reference in float64 must stay within twice
the error of torch in the same dtype (torch.nn.functional on the same device, autograd for the
gradients) plus a small allowance. Runs in Triton's interpreter on a CPU (tests/conftest.py sets
TRITON_INTERPRET=1 there) and compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import normbook  # noqa: E402
import normbook.kernels as K  # noqa: E402
from normbook.kernels import _config  # noqa: E402
from normbook import checks, reference  # noqa: E402
from helpers import DEVICE, EPS, ULPS, assert_within_torch, error, grads, make  # noqa: E402

# (M, D): M in {0, 1, 37}, D in {1, 3, 760, 1000, 4097, 10000, 20000, 70000}. D = 4097 is the
# first D of its power-of-two bucket (BLOCK_D = 8192) with a ragged tail; 10000 uses the fused
# forward with the wide backward (3 slices exchanging sums, the last one ragged), 20000 shares
# rows both ways (past the forward's widest row in registers, 16384); 70000 the shared forward
# (9 slices in 16-bit, 18 in fp32) and 18 slices (bf16) of the backward, so its M stays small
# (the interpreter is slow); 32769 a shared forward whose last slice is one column wide.
SHAPES = [(0, 760), (1, 1), (37, 1), (1, 3), (37, 3), (37, 760), (1, 1000), (37, 1000),
          (1, 4097), (37, 4097), (3, 10000), (2, 20000), (0, 70000),
          pytest.param(1, 70000, marks=pytest.mark.slow),
          pytest.param(1, 32769, marks=pytest.mark.slow)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,D", SHAPES)
def test_layer_norm_three_ways(M, D, dtype):
    x, w, b, dy = make(M, D, dtype)
    y, (dx, dw, db) = grads(lambda x, w, b: K.layer_norm(x, (D,), w, b, EPS), dy, x, w, b)
    yt, (dxt, dwt, dbt) = grads(lambda x, w, b: F.layer_norm(x, (D,), w, b, EPS), dy, x, w, b)
    x64, w64, b64, dy64 = (t.double() for t in (x, w, b, dy))
    y64, mean, rstd = reference.layer_norm_forward(x64, w64, b64, EPS)
    dx64, dw64, db64 = reference.layer_norm_backward(dy64, x64, w64, mean, rstd)
    assert_within_torch(y, yt, y64, name="y")
    assert_within_torch(dx, dxt, dx64, name="dx")
    assert_within_torch(dw, dwt, dw64, name="dweight", sum_rows=M)
    assert_within_torch(db, dbt, db64, name="dbias", sum_rows=M)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,D", SHAPES)
def test_rms_norm_three_ways(M, D, dtype):
    x, w, _, dy = make(M, D, dtype)
    y, (dx, dw) = grads(lambda x, w: K.rms_norm(x, (D,), w, EPS), dy, x, w)
    yt, (dxt, dwt) = grads(lambda x, w: F.rms_norm(x, (D,), w, EPS), dy, x, w)
    x64, w64, dy64 = (t.double() for t in (x, w, dy))
    y64, rstd = reference.rms_norm_forward(x64, w64, EPS)
    dx64, dw64 = reference.rms_norm_backward(dy64, x64, w64, rstd)
    assert_within_torch(y, yt, y64, name="y")
    assert_within_torch(dx, dxt, dx64, name="dx")
    assert_within_torch(dw, dwt, dw64, name="dweight", sum_rows=M)


@pytest.mark.parametrize("D", [1000, pytest.param(70000, marks=pytest.mark.slow)])
def test_no_cancellation_at_mean_1e4(D):
    """fp32 rows with mean 1e4 and spread 1: E[x^2] - E[x]^2 cancels, the kernel's statistics do not.

    E[x^2] ~ 1e8 carries an fp32 rounding error ~ 1e8 * 6e-8 = 6, larger than the variance (1):
    the naive formula fails the same bound the kernel meets. D = 70000 checks Chan's merge of
    the shared row's slices as well as the two-pass row in registers.
    """
    M = 4 if D <= 1000 else 1
    x, w, b, dy = make(M, D, torch.float32, mean=1e4)
    x = x - 2 * x.new_ones(()) + torch.linspace(0, 1, D, device=DEVICE)  # not symmetric
    y, (dx,) = grads(lambda x: K.layer_norm(x, (D,), w, b, EPS), dy, x)
    yt, (dxt,) = grads(lambda x: F.layer_norm(x, (D,), w, b, EPS), dy, x)
    x64 = x.double()
    y64, mean64, rstd64 = reference.layer_norm_forward(x64, w.double(), b.double(), EPS)
    dx64, _, _ = reference.layer_norm_backward(dy.double(), x64, w.double(), mean64, rstd64)
    # The mean is kept in fp32 (it is saved for backward), and rounding 1e4 to fp32 moves it by
    # up to half an ulp, 4.9e-4: every xhat of the row shifts by that times rstd, in torch and in
    # the kernel alike, and luck decides which lands closer. One ulp of the mean covers it.
    mean_ulp = (torch.finfo(torch.float32).eps * mean64.abs() * rstd64).max().item()
    assert_within_torch(y, yt, y64, name="y", extra=mean_ulp * w.abs().max().item())
    assert_within_torch(dx, dxt, dx64, name="dx")
    mean, rstd = torch.ops.normbook.norm_forward(x, None, w, b, EPS, False)[2]
    # fp32 statistics of a two-pass (or Chan) reduction: relative error a few ulps times log D
    torch.testing.assert_close(rstd.double(), rstd64, rtol=1e-5, atol=0)
    torch.testing.assert_close(mean.double(), mean64, rtol=1e-6, atol=0)

    mean_naive = x.mean(-1, keepdim=True)                                  # fp32, as a kernel would
    var_naive = (x * x).mean(-1, keepdim=True) - mean_naive * mean_naive   # E[x^2] - E[x]^2
    y_naive = (x - mean_naive) * torch.rsqrt(var_naive + EPS) * w + b
    bound = (2 * error(yt, y64) + ULPS * torch.finfo(torch.float32).eps * y64.abs().max().item()
             + mean_ulp * w.abs().max().item())
    assert not error(y_naive, y64) <= bound, "the naive formula was expected to fail (NaN fails too)"


# 6 x 8200: the wide backward, 4 groups of 3 slices (the last of 8 values), each group taking
# more than one row, and the finish kernel summing the groups' partials
@pytest.mark.parametrize("M,D", [(37, 1000), pytest.param(6, 8200, marks=pytest.mark.slow)])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_fp32_weight_with_bf16_input(norm, M, D):
    """Mixed precision: bf16 activations, fp32 parameters. y is bf16, dweight fp32.

    Baseline: torch in fp32 on the upcast input, i.e. the best a bf16 output can carry, with the
    output rounded to bf16 and so half a bf16 ulp of error.
    """
    x, w, b, dy = make(M, D, torch.bfloat16)
    w, b = w.float(), b.float()
    if norm == "layer":
        y, (dx, dw, db) = grads(lambda x, w, b: K.layer_norm(x, (D,), w, b, EPS), dy, x, w, b)
        yt, (dxt, dwt, dbt) = grads(lambda x, w, b: F.layer_norm(x.float(), (D,), w, b, EPS), dy.float(), x, w, b)
        x64 = x.double()
        y64, mean, rstd = reference.layer_norm_forward(x64, w.double(), b.double(), EPS)
        dx64, dw64, db64 = reference.layer_norm_backward(dy.double(), x64, w.double(), mean, rstd)
        assert db.dtype == torch.float32
        assert_within_torch(db, dbt, db64, name="dbias", sum_rows=M)
    else:
        y, (dx, dw) = grads(lambda x, w: K.rms_norm(x, (D,), w, EPS), dy, x, w)
        yt, (dxt, dwt) = grads(lambda x, w: F.rms_norm(x.float(), (D,), w, EPS), dy.float(), x, w)
        x64 = x.double()
        y64, rstd = reference.rms_norm_forward(x64, w.double(), EPS)
        dx64, dw64 = reference.rms_norm_backward(dy.double(), x64, w.double(), rstd)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert_within_torch(y, yt.bfloat16(), y64, name="y")
    assert_within_torch(dx, dxt.bfloat16(), dx64, name="dx")
    assert_within_torch(dw, dwt, dw64, name="dweight", sum_rows=M)


# 40000 fp32: the sharing kernels in both directions (10 slices forward, 20 backward), with
# fewer slices than 70000 for the interpreter's one-by-one programs to compute (about 3x
# faster); one row, since the identities hold row by row
WIDE_IDENTITY = pytest.param(1, 40000, marks=pytest.mark.slow)


@pytest.mark.parametrize("M,D", [(37, 760), WIDE_IDENTITY])
def test_layer_norm_identities_on_kernel_dx(M, D):
    """(ln-shift-id) and (ln-eps-residual) hold for the kernel's own dx, at eps > 0 and eps = 0."""
    x, w, b, dy = make(M, D, torch.float32)
    for eps in (EPS, 0.0):
        _, (dx,) = grads(lambda x: K.layer_norm(x, (D,), w, b, eps), dy, x)
        checks.assert_layer_norm_identities(x, dy, w, dx, eps)
        # at eps = 0 the scale identity is exact: sum_d xhat_d dx_d = 0
        if eps == 0.0:
            scale = (dx.abs() * checks._xhat(x, 0.0).abs()).sum(-1)
            assert (checks.scale_identity(x, dx, 0.0).abs() <= 64 * torch.finfo(torch.float32).eps * scale).all()


@pytest.mark.parametrize("M,D", [(37, 760), WIDE_IDENTITY])
def test_rms_norm_scale_identity_on_kernel_dx(M, D):
    """RMSNorm ignores positive rescalings of x at eps = 0, so sum_d x_d dx_d = 0 per row.

    Tolerance: 64 fp32 ulps of the size of the terms summed (sum_d |x_d dx_d|), the rounding of a
    D-term fp32 sum with room to spare.
    """
    x, w, _, dy = make(M, D, torch.float32)
    _, (dx,) = grads(lambda x: K.rms_norm(x, (D,), w, 0.0), dy, x)
    resid = (x * dx).sum(-1).abs()
    assert (resid <= 64 * torch.finfo(torch.float32).eps * (x * dx).abs().sum(-1)).all()


# 8200: the wide backward with the finish kernel (see test_fp32_weight_with_bf16_input). Only
# compiled: the interpreter runs a launch's programs one after another, so two of its runs are
# equal whatever the kernels' order of sums (37 x 1000 stays as the check that a second run
# reads nothing the first one left behind)
@pytest.mark.parametrize("M,D", [(37, 1000), pytest.param(6, 8200, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_parameter_gradients_are_deterministic(M, D, norm):
    """Two runs give bitwise equal dweight and dbias: fixed grid, fixed partials, fixed sum order."""
    x, w, b, dy = make(M, D, torch.bfloat16)
    if norm == "layer":
        fn, inputs = (lambda x, w, b: K.layer_norm(x, (D,), w, b, EPS)), (x, w.float(), b.float())
    else:
        fn, inputs = (lambda x, w: K.rms_norm(x, (D,), w, EPS)), (x, w.float())
    first = grads(fn, dy, *inputs)[1]
    second = grads(fn, dy, *inputs)[1]
    for a, c in zip(first, second):
        assert torch.equal(a, c)


# row stride 800: VEC 8 (16-byte loads), 764: VEC 4, 763: VEC 1
@pytest.mark.parametrize("pad,vec", [(40, 8), (4, 4), (3, 1)])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_strided_rows_are_read_in_place(norm, pad, vec):
    """A slice of a wider tensor is read through its row stride (no copy). In the interpreter the
    results are bitwise those of the contiguous copy; compiled, the two inputs may specialize
    differently (alignment, vector width, so the reduction tree), so a GPU promises equality to
    rounding, and bitwise equality only run to run. D = 760 is a multiple of 8, not of 16: the
    launcher's VEC follows the stride (a VEC the stride does not have would read wrong rows)."""
    M, D = 37, 760
    wide, w, b, dy = make(M, D + pad, torch.bfloat16)
    x = wide[:, 0:D]                                        # row stride D + pad
    assert x.stride() == (D + pad, 1)
    assert _config.vec(D, 2, x.stride(0)) == vec
    assert K.ops._rows(x).data_ptr() == x.data_ptr()        # no copy
    w, b, dy = w[:D], b[:D], dy[:, :D]
    fn = ((lambda x: K.layer_norm(x, (D,), w, b, EPS)) if norm == "layer"
          else (lambda x: K.rms_norm(x, (D,), w, EPS)))
    y, (dx,) = grads(fn, dy, x)
    y_c, (dx_c,) = grads(fn, dy.contiguous(), x.contiguous())
    if K.ops.interpreted():
        assert torch.equal(y, y_c) and torch.equal(dx, dx_c)
    else:  # bf16: two roundings apart at most
        torch.testing.assert_close(y, y_c, rtol=2.0**-7, atol=2.0**-7)
        torch.testing.assert_close(dx, dx_c, rtol=2.0**-7, atol=2.0**-7 * dx_c.abs().max().item())
    y2, (dx2,) = grads(fn, dy, x)
    assert torch.equal(y, y2) and torch.equal(dx, dx2)      # run to run: bitwise


def test_transposed_input_is_copied_and_correct():
    """A non-contiguous last dim (a transpose) is copied to rows first; leading dims any shape."""
    base, w, b, dy = make(64, 3 * 37, torch.float32)
    x = base.t().unflatten(0, (3, 37))                        # (3, 37, 64) with stride(-1) = 111
    assert x.stride(-1) != 1
    dy = dy.t().unflatten(0, (3, 37))
    y, (dx, dw) = grads(lambda x, w: K.layer_norm(x, (64,), w[:64], None, EPS), dy, x, w)
    y_c, (dx_c, dw_c) = grads(lambda x, w: K.layer_norm(x, (64,), w[:64], None, EPS), dy, x.contiguous(), w)
    assert y.shape == (3, 37, 64) and torch.equal(y, y_c) and torch.equal(dx, dx_c)
    assert torch.equal(dw, dw_c)


@pytest.mark.parametrize("which", ["x", "residual", "weight", "bias"])
def test_a_negative_view_is_read_as_its_values(which):
    """torch._neg_view keeps a tensor's sign as a bit, not in its memory, which the kernels
    read as it is: every argument gives what its values give (they once gave the norm of the
    memory, the sign lost), forward and backward, through the fused add too."""
    x, w, b, dy = make(37, 760, torch.bfloat16)
    r = torch.randn_like(x)

    def fn(neg):
        def norm(x, r, w, b):
            args = dict(x=x, residual=r, weight=w, bias=b)
            args[which] = (torch._neg_view if neg else torch.neg)(args[which])
            return K.add_layer_norm(*args.values(), EPS)[0]
        return norm

    y, g = grads(fn(True), dy, x, r, w, b)
    y_want, g_want = grads(fn(False), dy, x, r, w, b)
    assert torch.equal(y, y_want)
    for got, want in zip(g, g_want):
        assert torch.equal(got, want)


@pytest.mark.parametrize("which", ["dy", "dh", "round_xhat x", "round_xhat dy"])
def test_a_negative_view_is_read_as_its_values_in_the_backward_and_round_xhat(which):
    """The same for the gradients arriving at y and at h (autograd hands the backward what
    the graph's next op gave), and for rms_norm's round_xhat, forward and backward (a negative
    x takes the composition, weight * rms_norm(x), whose backward rounds as autograd's does,
    so that is what it is compared with)."""
    x, w, _, dy = make(37, 760, torch.bfloat16)
    r = torch.randn_like(x)
    results = []
    for sign in (torch._neg_view, torch.neg):
        xi, ri, wi = (t.detach().clone().requires_grad_() for t in (x, r, w))
        if which.startswith("round_xhat"):
            xin = sign(xi) if which == "round_xhat x" else xi
            with normbook.backend("kernels"):
                if which == "round_xhat x" and sign is torch.neg:
                    y = wi * normbook.rms_norm(xin, 760, None)
                else:
                    y = normbook.rms_norm(xin, 760, wi, round_xhat=True)
            y.backward(sign(dy) if which == "round_xhat dy" else dy)
            h = y
        else:
            y, h = K.add_layer_norm(xi, ri, wi, None, EPS)
            torch.autograd.backward((y, h), (sign(dy) if which == "dy" else dy,
                                             sign(dy) if which == "dh" else dy))
        results.append([y.detach(), h.detach(), xi.grad, ri.grad, wi.grad])
    for got, want in zip(*results):
        assert (got is None and want is None) or torch.equal(got, want), which


def test_multi_dim_normalized_shape_and_nan_row():
    """normalized_shape (4, 8) flattens to D = 32, as in torch; a NaN stays in its own row."""
    x, w, b, _ = make(6, 32, torch.float32)
    x = x.reshape(2, 3, 4, 8)
    w, b = w.reshape(4, 8), b.reshape(4, 8)
    y = K.layer_norm(x, (4, 8), w, b, EPS)
    torch.testing.assert_close(y, F.layer_norm(x, (4, 8), w, b, EPS))  # fp32, default tolerances
    x[0, 1, 2, 3] = float("nan")
    y_nan = K.layer_norm(x, (4, 8), w, b, EPS)
    assert y_nan[0, 1].isnan().all()
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[0, 1] = False
    assert torch.equal(y_nan[mask], y[mask])
