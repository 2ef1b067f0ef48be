"""The reference layer against torch.nn.functional and autograd, in float64."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from normbook import numpy_ref, reference

f64 = dict(dtype=torch.float64)
# float64 roundoff is 1.1e-16; a reduction over D <= 4097 terms stays far below 1e-12 relative.
REL = 1e-12
SHAPES = [(1,), (3,), (7, 11), (2, 3, 760), (5, 1000), (2, 4097), (4, 1)]


def rel_err(a, b):
    # Relative to the largest entry, floored at 1: at D = 1 every exact value is 0 and torch
    # returns roundoff (~1e-17) there, which is an absolute, not a relative, disagreement.
    scale = b.abs().max().clamp_min(1.0)
    return ((a - b).abs().max() / scale).item() if b.numel() else 0.0


def make(shape, seed):
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    x = torch.randn(shape, generator=g, **f64) * 3 + 2    # deliberately not zero-mean
    return x, torch.randn(D, generator=g, **f64), torch.randn(D, generator=g, **f64), torch.randn(shape, generator=g, **f64)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", [1e-5, 1e-1])
def test_layer_norm_forward_and_backward_match_torch(shape, eps):
    x, w, b, dy = make(shape, 0)
    y, mean, rstd = reference.layer_norm_forward(x, w, b, eps)
    assert mean.shape == rstd.shape == x.shape[:-1]
    assert rel_err(y, F.layer_norm(x, shape[-1:], w, b, eps)) <= REL

    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    F.layer_norm(xg, shape[-1:], wg, bg, eps).backward(dy)
    dx, dw, db = reference.layer_norm_backward(dy, x, w, mean, rstd)
    assert dx.shape == x.shape and dw.shape == db.shape == w.shape
    assert rel_err(dx, xg.grad) <= REL
    assert rel_err(dw, wg.grad) <= REL
    assert rel_err(db, bg.grad) <= REL


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", [1e-5, 1e-1])
def test_rms_norm_forward_and_backward_match_torch(shape, eps):
    x, w, _, dy = make(shape, 1)
    y, rstd = reference.rms_norm_forward(x, w, eps)
    assert rstd.shape == x.shape[:-1]
    assert rel_err(y, F.rms_norm(x, shape[-1:], w, eps)) <= REL

    xg, wg = (t.clone().requires_grad_() for t in (x, w))
    F.rms_norm(xg, shape[-1:], wg, eps).backward(dy)
    dx, dw = reference.rms_norm_backward(dy, x, w, rstd)
    assert rel_err(dx, xg.grad) <= REL
    assert rel_err(dw, wg.grad) <= REL


def test_weight_grads_are_summed_for_a_1d_input():
    x, w, b, dy = make((9,), 2)
    y, mean, rstd = reference.layer_norm_forward(x, w, b, 1e-5)
    _, dw, db = reference.layer_norm_backward(dy, x, w, mean, rstd)
    xhat = (x - mean) * rstd
    torch.testing.assert_close(dw, dy * xhat, rtol=0, atol=1e-15)
    torch.testing.assert_close(db, dy, rtol=0, atol=0)


def test_backward_without_weight():
    x, _, _, dy = make((4, 6), 3)
    xg = x.clone().requires_grad_()
    F.layer_norm(xg, (6,), eps=1e-5).backward(dy)
    _, mean, rstd = reference.layer_norm_forward(x, None, None, 1e-5)
    dx, dw, db = reference.layer_norm_backward(dy, x, None, mean, rstd)
    assert dw is None and db.shape == (6,)
    assert rel_err(dx, xg.grad) <= REL


@pytest.mark.parametrize("D", [1, 2, 5, 16])
@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_jacobians_match_autograd(D, eps):
    x = torch.randn(D, **f64) * 2 + 1
    J = reference.layer_norm_jacobian(x, eps)
    Ja = torch.autograd.functional.jacobian(lambda v: F.layer_norm(v, (D,), eps=eps), x)
    torch.testing.assert_close(J, Ja, rtol=1e-12, atol=1e-12)
    J = reference.rms_norm_jacobian(x, eps)
    Ja = torch.autograd.functional.jacobian(lambda v: F.rms_norm(v, (D,), eps=eps), x)
    torch.testing.assert_close(J, Ja, rtol=1e-12, atol=1e-12)


def test_jacobian_rejects_a_batch():
    with pytest.raises(ValueError, match=r"x: expected a 1-D vector.*\(2, 3\)"):
        reference.layer_norm_jacobian(torch.zeros(2, 3, **f64), 1e-5)


def test_jacobian_contracted_with_ghat_is_the_backward():
    """dx = J^T ghat: the backward is the Jacobian contracted with the incoming gradient."""
    x, w, b, dy = make((12,), 4)
    _, mean, rstd = reference.layer_norm_forward(x, w, b, 1e-5)
    dx, _, _ = reference.layer_norm_backward(dy, x, w, mean, rstd)
    J = reference.layer_norm_jacobian(x, 1e-5)
    torch.testing.assert_close(J.T @ (dy * w), dx, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("shape", [(4,), (3, 5), (2, 3, 8)])
def test_numpy_forward_matches_torch_reference(shape):
    x, w, b, _ = make(shape, 5)
    y, _, _ = reference.layer_norm_forward(x, w, b, 1e-5)
    np.testing.assert_allclose(numpy_ref.layer_norm(x.numpy(), w.numpy(), b.numpy(), 1e-5), y.numpy(), rtol=1e-13, atol=1e-13)
    y, _ = reference.rms_norm_forward(x, w, 1e-5)
    np.testing.assert_allclose(numpy_ref.rms_norm(x.numpy(), w.numpy(), 1e-5), y.numpy(), rtol=1e-13, atol=1e-13)


def test_empty_batch():
    x = torch.zeros(0, 7, **f64)
    w = torch.ones(7, **f64)
    y, mean, rstd = reference.layer_norm_forward(x, w, w, 1e-5)
    assert y.shape == (0, 7) and mean.shape == (0,)
    dx, dw, db = reference.layer_norm_backward(x, x, w, mean, rstd)
    assert dx.shape == (0, 7) and torch.equal(dw, torch.zeros(7, **f64)) and torch.equal(db, torch.zeros(7, **f64))
    y, rstd = reference.rms_norm_forward(x, w, 1e-5)
    dx, dw = reference.rms_norm_backward(x, x, w, rstd)
    assert dx.shape == (0, 7) and torch.equal(dw, torch.zeros(7, **f64))
