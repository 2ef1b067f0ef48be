"""The hand-written residual backward (fork-rule, residual-grad) against autograd, in float64."""

import pytest
import torch

from normbook import residual


@pytest.mark.parametrize("shape", [(1,), (5,), (7, 11), (2, 3, 16)])
def test_residual_tanh_backward_matches_autograd(shape):
    torch.manual_seed(0)
    D = shape[-1]
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    A = torch.randn(D, D, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(shape, dtype=torch.float64)
    y, t = residual.residual_tanh_forward(x, A)
    y.backward(dy)
    dx, dA = residual.residual_tanh_backward(dy, x.detach(), A.detach(), t.detach())
    # float64, a handful of operations per element: agreement to a few ulps
    torch.testing.assert_close(dx, x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dA, A.grad, rtol=1e-12, atol=1e-12)


def test_identity_path_alone_is_wrong():
    """The hand backward keeps the branch's term, and that term is far above the 1e-12 tolerance
    above, so a backward that returned the identity path alone (= instead of +=) would fail."""
    torch.manual_seed(1)
    D = 8
    x = torch.randn(D, dtype=torch.float64, requires_grad=True)
    A = torch.randn(D, D, dtype=torch.float64)
    dy = torch.randn(D, dtype=torch.float64)
    y, t = residual.residual_tanh_forward(x, A)
    y.backward(dy)
    dx, _ = residual.residual_tanh_backward(dy, x.detach(), A, t.detach())
    torch.testing.assert_close(dx, x.grad, rtol=1e-12, atol=1e-12)
    assert (dx - dy).abs().max() > 1e-2                  # the branch's term, use 2 of x


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(6,), (4, 9), (2, 3, 10)])
def test_pre_norm_tanh_backward_matches_autograd(shape, affine):
    torch.manual_seed(2)
    D, eps = shape[-1], 1e-5
    f64 = dict(dtype=torch.float64)
    x = (3 * torch.randn(shape, **f64) + 1).requires_grad_()
    A = torch.randn(D, D, **f64).requires_grad_()
    w = torch.randn(D, **f64).requires_grad_() if affine else None
    b = torch.randn(D, **f64).requires_grad_() if affine else None
    dy = torch.randn(shape, **f64)
    y, t, mean, rstd = residual.pre_norm_tanh_forward(x, A, w, b, eps)
    ref = x + torch.tanh(torch.nn.functional.layer_norm(x, (D,), w, b, eps) @ A.T)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    ref.backward(dy)
    dx, dA, dw, db = residual.pre_norm_tanh_backward(
        dy, x.detach(), A.detach(), None if w is None else w.detach(),
        None if b is None else b.detach(), eps, t.detach(), mean.detach(), rstd.detach())
    torch.testing.assert_close(dx, x.grad, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(dA, A.grad, rtol=1e-11, atol=1e-11)
    if affine:
        torch.testing.assert_close(dw, w.grad, rtol=1e-11, atol=1e-11)
        torch.testing.assert_close(db, b.grad, rtol=1e-11, atol=1e-11)
    else:
        assert dw is None and db is None
