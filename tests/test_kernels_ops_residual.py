"""The fused residual add, add_layer_norm and add_rms_norm: s = x + residual, y = norm(s).

Forward: s is x + residual rounded to the dtype, exactly as torch computes it; y is the norm of
that s, checked three ways as in test_kernels_launchers. Backward, the (fork-rule): s feeds the
norm and, in a transformer, the next residual branch, so the gradient of s is the gradient
through the norm plus the gradient arriving at s; x and the residual both receive that sum.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import normbook.kernels as K  # noqa: E402
from normbook import reference  # noqa: E402
from helpers import EPS, assert_within_torch, make  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M,D", [(0, 760), (1, 3), (37, 760), (2, 20000), (1, 70000)])   # 20000: forward swept in chunks, backward shared
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_add_norm_forward_and_all_grads(norm, M, D, dtype):
    x, w, b, dy = make(M, D, dtype, seed=1)
    r, _, _, ds = make(M, D, dtype, seed=2)                 # residual stream and dL/ds from above
    is_layer = norm == "layer"

    def fused(x, r, w, b):
        return K.add_layer_norm(x, r, w, b, EPS) if is_layer else K.add_rms_norm(x, r, w, EPS)

    def unfused(x, r, w, b):
        s = x + r
        return (F.layer_norm(s, (D,), w, b, EPS) if is_layer else F.rms_norm(s, (D,), w, EPS)), s

    def run(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, r, w, b)]
        y, s = fn(*leaves)
        torch.autograd.backward((y, s), (dy, ds))
        return y.detach(), s.detach(), [leaf.grad for leaf in leaves]

    y, s, (dx, dr, dw, db) = run(fused)
    yt, st, (dxt, drt, dwt, dbt) = run(unfused)
    assert torch.equal(s, st)       # s = x + r rounded once, to nearest, like torch (on the
    # CPU too: normbook makes Triton's interpreter round to bf16 as a GPU does)
    s64, w64, b64 = s.double(), w.double(), b.double()
    if is_layer:
        y64, mean, rstd = reference.layer_norm_forward(s64, w64, b64, EPS)
        dnorm64, dw64, db64 = reference.layer_norm_backward(dy.double(), s64, w64, mean, rstd)
        assert_within_torch(db, dbt, db64, name="dbias", sum_rows=M)
    else:
        y64, rstd = reference.rms_norm_forward(s64, w64, EPS)
        dnorm64, dw64 = reference.rms_norm_backward(dy.double(), s64, w64, rstd)
        assert db is None
    ds64 = dnorm64 + ds.double()                             # fork rule: the two gradients add
    assert_within_torch(y, yt, y64, name="y")
    assert_within_torch(dx, dxt, ds64, name="dx")
    assert torch.equal(dr, dx)                               # s = x + r: one gradient for both
    assert_within_torch(dw, dwt, dw64, name="dweight", sum_rows=M)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M,D", [(512, 40000), (64, 131072), (3, 70001)])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_gpu_add_norm_wide_rows(norm, M, D, dtype):
    """The shared forward with the add, on rows whose programs really run at once: each
    program stores its slice of h and normalizes the h it holds; a program computing a late
    slice stores the same bits. The interpreter runs programs one by one, so only a GPU runs
    the exchange concurrently."""
    test_add_norm_forward_and_all_grads(norm, M, D, dtype)


def test_add_norm_without_gradient_at_s():
    """When s is not used downstream, only the gradient through the norm reaches x and residual."""
    x, w, b, dy = make(5, 64, torch.float32, seed=3)
    r = next(make(5, 64, torch.float32, seed=4))
    x.requires_grad_(True)
    r.requires_grad_(True)
    y, _ = K.add_layer_norm(x, r, w, b, EPS)
    y.backward(dy)
    s64 = (x + r).detach().double()
    _, mean, rstd = reference.layer_norm_forward(s64, w.double(), b.double(), EPS)
    dx64, _, _ = reference.layer_norm_backward(dy.double(), s64, w.double(), mean, rstd)
    torch.testing.assert_close(x.grad.double(), dx64, rtol=1e-5, atol=1e-5)  # fp32: a few ulps
    assert torch.equal(x.grad, r.grad)


def test_add_norm_reads_strided_inputs():
    """x and the residual may each be a slice of a wider tensor; the results are those of copies."""
    wide_x, w, b, _ = make(37, 1000, torch.bfloat16, seed=5)
    wide_r = next(make(37, 1000, torch.bfloat16, seed=6))
    x, r = wide_x[:, :760], wide_r[:, 200:960]
    assert x.stride() == r.stride() == (1000, 1)
    assert K.ops._rows(r).data_ptr() == r.data_ptr()      # read in place, no copy
    y, s = K.add_rms_norm(x, r, w[:760], EPS)
    y_c, s_c = K.add_rms_norm(x.contiguous(), r.contiguous(), w[:760], EPS)
    assert torch.equal(y, y_c) and torch.equal(s, s_c)
