"""The token-by-token loops against the batched reference and against autograd, in float64."""

import pytest
import torch

from normbook import batching, reference


@pytest.mark.parametrize("N,D", [(1, 1), (7, 11), (3, 760), (16, 33)])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_loop_matches_batched_and_autograd(N, D, affine):
    torch.manual_seed(0)
    f64 = dict(dtype=torch.float64)
    x = (2 * torch.randn(N, D, **f64) + 1).requires_grad_()
    w = torch.randn(D, **f64).requires_grad_() if affine else None
    b = torch.randn(D, **f64).requires_grad_() if affine else None
    dy = torch.randn(N, D, **f64)
    _, mean, rstd = reference.layer_norm_forward(x.detach(), w, b, 1e-5)
    dwd = None if w is None else w.detach()
    loop = batching.layer_norm_backward_loop(dy, x.detach(), dwd, mean, rstd)
    batched = reference.layer_norm_backward(dy, x.detach(), dwd, mean, rstd)
    for got, want in zip(loop, batched):
        if want is None:
            assert got is None
        else:
            # same per-token arithmetic; only the order of the n-sum may differ
            torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    torch.nn.functional.layer_norm(x, (D,), w, b, 1e-5).backward(dy)
    torch.testing.assert_close(loop[0], x.grad, rtol=1e-10, atol=1e-10)
    if affine:
        torch.testing.assert_close(loop[1], w.grad, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(loop[2], b.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("N,D", [(1, 1), (7, 11), (5, 257)])
def test_rms_norm_loop_matches_autograd(N, D):
    torch.manual_seed(1)
    f64 = dict(dtype=torch.float64)
    x = (torch.randn(N, D, **f64) + 0.5).requires_grad_()
    w = torch.randn(D, **f64).requires_grad_()
    dy = torch.randn(N, D, **f64)
    _, rstd = reference.rms_norm_forward(x.detach(), w.detach(), 1e-6)
    dx, dw = batching.rms_norm_backward_loop(dy, x.detach(), w.detach(), rstd)
    torch.nn.functional.rms_norm(x, (D,), w, 1e-6).backward(dy)
    torch.testing.assert_close(dx, x.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dw, w.grad, rtol=1e-10, atol=1e-10)
