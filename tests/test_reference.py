"""The reference layer against torch.nn.functional and autograd, in float64."""

import inspect
import re

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


# One token's vector, x of shape (D,), and the row-by-row loop over it.

TOKEN_DS = [1, 3, 760, 1000, 4097]


def torch_grads(fn, dy, *inputs):
    """Autograd of ``fn`` at ``inputs`` (None stays None), contracted with ``dy``."""
    leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    fn(*leaves).backward(dy)
    return [None if t is None else t.grad for t in leaves]


@pytest.mark.parametrize("D", TOKEN_DS)
@pytest.mark.parametrize("eps", [1e-5, 1e-1])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_token_matches_batched_and_torch(D, eps, affine):
    x, w, b, dy = make((D,), 6)
    w, b = (w, b) if affine else (None, None)
    y, mean, rstd = reference.layer_norm_token_forward(x, w, b, eps)
    assert y.shape == (D,) and mean.shape == rstd.shape == ()
    assert rel_err(y, F.layer_norm(x, (D,), w, b, eps)) <= REL
    yb, meanb, rstdb = reference.layer_norm_forward(x[None], w, b, eps)
    assert rel_err(y, yb[0]) <= REL
    assert rel_err(mean, meanb[0]) <= REL and rel_err(rstd, rstdb[0]) <= REL

    dx, dw, db = reference.layer_norm_token_backward(dy, x, w, mean, rstd)
    want = torch_grads(lambda *t: F.layer_norm(t[0], (D,), t[1], t[2], eps), dy, x, w, b)
    assert rel_err(dx, want[0]) <= REL
    if affine:
        assert rel_err(dw, want[1]) <= REL and rel_err(db, want[2]) <= REL
    else:
        assert dw is None and torch.equal(db, dy)    # dbias = dy, also without a weight
    got_b = reference.layer_norm_backward(dy[None], x[None], w, meanb, rstdb)
    assert rel_err(dx, got_b[0][0]) <= REL and rel_err(db, got_b[2]) <= REL


@pytest.mark.parametrize("D", TOKEN_DS)
@pytest.mark.parametrize("eps", [1e-5, 1e-1])
@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_token_matches_batched_and_torch(D, eps, affine):
    x, w, _, dy = make((D,), 7)
    w = w if affine else None
    y, rstd = reference.rms_norm_token_forward(x, w, eps)
    assert y.shape == (D,) and rstd.shape == ()
    assert rel_err(y, F.rms_norm(x, (D,), w, eps)) <= REL
    yb, rstdb = reference.rms_norm_forward(x[None], w, eps)
    assert rel_err(y, yb[0]) <= REL and rel_err(rstd, rstdb[0]) <= REL

    dx, dw = reference.rms_norm_token_backward(dy, x, w, rstd)
    want = torch_grads(lambda *t: F.rms_norm(t[0], (D,), t[1], eps), dy, x, w)
    dxb, dwb = reference.rms_norm_backward(dy[None], x[None], w, rstdb)
    assert rel_err(dx, want[0]) <= REL and rel_err(dx, dxb[0]) <= REL
    if affine:
        assert rel_err(dw, want[1]) <= REL and rel_err(dw, dwb) <= REL
    else:
        assert dw is None


def test_token_backward_does_not_alias_dy():
    x, w, _, dy = make((5,), 8)
    _, mean, rstd = reference.layer_norm_token_forward(x, w, None, 1e-5)
    _, _, db = reference.layer_norm_token_backward(dy, x, w, mean, rstd)
    db += 1                                           # a caller accumulating into dbias
    assert not torch.equal(db, dy)


@pytest.mark.parametrize("N,D", [(1, 1), (7, 11), (3, 760), (16, 33), (2, 4097)])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_rows_match_batched_and_torch(N, D, affine):
    x, w, b, dy = make((N, D), 9)
    w, b = (w, b) if affine else (None, None)
    eps = 1e-5
    y, mean, rstd = reference.layer_norm_rows_forward(x, w, b, eps)
    assert y.shape == (N, D) and mean.shape == rstd.shape == (N,)
    yb, meanb, rstdb = reference.layer_norm_forward(x, w, b, eps)
    for got, want in ((y, yb), (mean, meanb), (rstd, rstdb)):
        assert rel_err(got, want) <= REL
    assert rel_err(y, F.layer_norm(x, (D,), w, b, eps)) <= REL

    grads = reference.layer_norm_rows_backward(dy, x, w, mean, rstd)
    batched = reference.layer_norm_backward(dy, x, w, meanb, rstdb)
    want = torch_grads(lambda *t: F.layer_norm(t[0], (D,), t[1], t[2], eps), dy, x, w, b)
    # per row the same arithmetic; the parameter sums over N rows may add in another order,
    # still far below REL at these N
    assert rel_err(grads[0], batched[0]) <= REL and rel_err(grads[0], want[0]) <= REL
    assert rel_err(grads[2], batched[2]) <= REL
    if affine:
        assert rel_err(grads[1], batched[1]) <= REL and rel_err(grads[1], want[1]) <= REL
        assert rel_err(grads[2], want[2]) <= REL
    else:
        assert grads[1] is None and rel_err(grads[2], dy.sum(0)) <= REL


def test_layer_norm_rows_empty_batch():
    x = torch.zeros(0, 7, **f64)
    y, mean, rstd = reference.layer_norm_rows_forward(x, None, None, 1e-5)
    assert y.shape == (0, 7) and mean.shape == rstd.shape == (0,)
    dx, dw, db = reference.layer_norm_rows_backward(x, x, torch.ones(7, **f64), mean, rstd)
    assert dx.shape == (0, 7)
    assert torch.equal(dw, torch.zeros(7, **f64)) and torch.equal(db, torch.zeros(7, **f64))


@pytest.mark.parametrize("call", [
    lambda x, dy: reference.layer_norm_token_forward(x, None, None, 1e-5),
    lambda x, dy: reference.layer_norm_token_backward(dy, x, None, 0.0, 1.0),
    lambda x, dy: reference.rms_norm_token_forward(x, None, 1e-5),
    lambda x, dy: reference.rms_norm_token_backward(dy, x, None, 1.0),
], ids=["ln_fwd", "ln_bwd", "rms_fwd", "rms_bwd"])
def test_token_functions_reject_a_batch(call):
    for bad in (torch.zeros(2, 3, **f64), torch.zeros((), **f64)):
        shape = re.escape(str(tuple(bad.shape)))
        with pytest.raises(ValueError, match=rf"^x: expected a 1-D vector of shape \(D,\), got shape {shape}$"):
            call(bad, bad)


def test_token_backward_rejects_a_dy_of_another_shape():
    x = torch.zeros(5, **f64)
    with pytest.raises(ValueError, match=r"^dy: expected shape \(5,\) \(as x\), got shape \(1, 5\)$"):
        reference.layer_norm_token_backward(x[None], x, None, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"^dy: expected shape \(5,\) \(as x\), got shape \(4,\)$"):
        reference.rms_norm_token_backward(x[:4], x, None, 1.0)


def test_rows_loop_rejects_anything_but_rows():
    for bad in (torch.zeros(4, **f64), torch.zeros(2, 3, 4, **f64)):
        shape = re.escape(str(tuple(bad.shape)))
        with pytest.raises(ValueError, match=rf"^x: expected rows of shape \(N, D\), got shape {shape}$"):
            reference.layer_norm_rows_forward(bad, None, None, 1e-5)
    x = torch.zeros(3, 4, **f64)
    with pytest.raises(ValueError, match=r"^dy: expected shape \(3, 4\) \(as x\), got shape \(4, 3\)$"):
        reference.layer_norm_rows_backward(x.T, x, None, x[:, 0], x[:, 0])


def einsum_strings(fn):
    return re.findall(r'torch\.einsum\("([^"]*)"', inspect.getsource(fn))


@pytest.mark.parametrize("token_fn,batched_fn", [
    (reference.layer_norm_token_forward, reference.layer_norm_forward),
    (reference.layer_norm_token_backward, reference.layer_norm_backward),
    (reference.rms_norm_token_forward, reference.rms_norm_forward),
    (reference.rms_norm_token_backward, reference.rms_norm_backward),
])
def test_batching_adds_the_token_index(token_fn, batched_fn):
    """The staging of the book: one token's sums are "d->" and "d,d->"; the batched function's
    per-token sums are the same strings with n kept, and it adds the sums over n ("nd->d")."""
    token, batched = einsum_strings(token_fn), einsum_strings(batched_fn)
    assert token and set(token) <= {"d->", "d,d->"}
    with_n = [",".join("n" + op for op in s.split("->")[0].split(",")) + "->n" for s in token]
    assert [s for s in batched if s.endswith("->n")] == with_n
    assert all(s.endswith("->d") for s in batched if not s.endswith("->n"))


def _bad_shape_calls():
    """(call, the argument it names, the shape in its message): every reference,
    batching and residual function given one argument of a shape the formulas
    would broadcast into a wrong answer (a (1,) weight, a () rstd, a (1, D)
    branch weight) or refuse with torch's unnamed message."""
    from normbook import batching, residual
    x1, x2, x3 = torch.ones(5, **f64), torch.ones(3, 5, **f64), torch.ones(2, 3, 5, **f64)
    w, one = torch.ones(5, **f64), torch.ones(1, **f64)
    A = torch.eye(5, **f64)
    s3, s2 = torch.ones(2, 3, **f64), torch.ones(3, **f64)
    r = reference
    return [
        (lambda: r.layer_norm_token_forward(x1, one, None, 1e-5), "weight", r"\(5,\)"),
        (lambda: r.layer_norm_token_forward(x1, w, w[:4], 1e-5), "bias", r"\(5,\)"),
        (lambda: r.layer_norm_token_backward(x1, x1, w, s2, 1.0), "mean", r"\(\) or \(1,\)"),
        (lambda: r.rms_norm_token_backward(x1, x1, w, None), "rstd", "a torch.Tensor"),
        (lambda: r.rms_norm_token_forward(x1, w[None], 1e-5), "weight", r"\(5,\)"),
        (lambda: r.layer_norm_rows_forward(x2, w, one, 1e-5), "bias", r"\(5,\)"),
        (lambda: r.layer_norm_rows_backward(x2, x2, w, s2, s2[:1]), "rstd", r"\(3,\)"),
        (lambda: r.layer_norm_forward(x3, one, None, 1e-5), "weight", r"\(5,\)"),
        (lambda: r.layer_norm_backward(x3, x3, w, s3, torch.tensor(1.0, **f64)), "rstd",
         r"\(2, 3\) or \(6,\)"),
        (lambda: r.layer_norm_backward(x3[0], x3, w, s3, s3), "dy", r"\(2, 3, 5\)"),
        (lambda: r.rms_norm_forward(x3, torch.ones(5, 1, **f64), 1e-5), "weight", r"\(5,\)"),
        (lambda: r.rms_norm_backward(x3, x3, w, s3[:, :1]), "rstd", r"\(2, 3\) or \(6,\)"),
        (lambda: batching.rms_norm_backward_loop(x2, x2, one, s2), "weight", r"\(5,\)"),
        (lambda: residual.residual_tanh_forward(x3, A[:1]), "A", r"\(5, 5\)"),
        (lambda: residual.residual_tanh_backward(x3, x3, A, x3[:, :1]), "t", r"\(2, 3, 5\)"),
        (lambda: residual.pre_norm_tanh_forward(x3, A.T[:, :4], w, w, 1e-5), "A", r"\(5, 5\)"),
        (lambda: residual.pre_norm_tanh_backward(x3, x3, A, w, w, 1e-5, x3, s3, s2), "rstd",
         r"\(2, 3\) or \(6,\)"),
    ]


@pytest.mark.parametrize("case", range(17))
def test_every_reference_function_names_an_argument_of_the_wrong_shape(case):
    call, name, shape = _bad_shape_calls()[case]
    with pytest.raises((ValueError, TypeError), match=rf"^{name}: expected (shape {shape}|{shape})"):
        call()


def _bad_value_calls():
    """(call, its error's start): a reviewer's cases, each accepted into a wrong answer or
    refused with an unnamed message before the reference functions checked them."""
    from normbook import residual
    x1, x2 = torch.randn(5, **f64), torch.randn(3, 5, **f64)
    w = torch.randn(5, **f64)
    _, m, r = reference.layer_norm_forward(x2, w, w, 1e-5)
    r_ = reference
    return [
        # a number for the statistics of one token is the token functions', not the batch's
        (lambda: r_.layer_norm_backward(x1, x1, w, 0.0, 1.0), "mean: expected a torch.Tensor"),
        (lambda: r_.rms_norm_backward(x1, x1, w, 1.0), "rstd: expected a torch.Tensor"),
        # None where a tensor goes: only weight and bias may be None
        (lambda: r_.layer_norm_backward(None, x2, w, m, r), "dy: expected a torch.Tensor"),
        (lambda: residual.residual_tanh_forward(x2, None), "A: expected a torch.Tensor"),
        # an integer x: the row loop wrote its output into an integer tensor (truncated)
        (lambda: r_.layer_norm_rows_forward(torch.tensor([[1, 2, 3, 4]]), None, None, 1e-5),
         "x: expected a real floating-point dtype, got torch.int64"),
        (lambda: r_.rms_norm_forward(x2.to(torch.complex128), None, 1e-5),
         "x: expected a real floating-point dtype"),
        # eps: a vector broadcast over the rows, NaN, None
        (lambda: r_.layer_norm_forward(x2, None, None, torch.tensor([1e-5, 1.0, 9.0], **f64)),
         "eps: expected a real number or a 0-d tensor"),
        (lambda: r_.layer_norm_jacobian(x1, torch.ones(5, **f64)),
         "eps: expected a real number or a 0-d tensor"),
        (lambda: r_.layer_norm_forward(x2, None, None, float("nan")),
         "eps: expected a real number other than NaN"),
        (lambda: r_.rms_norm_token_forward(x1, None, None), "eps: expected a real number"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_every_reference_function_names_a_bad_value(case):
    call, message = _bad_value_calls()[case]
    with pytest.raises((ValueError, TypeError), match="^" + re.escape(message)):
        call()


def test_the_shape_checks_accept_what_the_forwards_return():
    """Statistics flattened to (N,) (as the launchers keep them) or in x's
    leading shape, and plain numbers for one token, all pass."""
    x = torch.randn(2, 3, 5, **f64)
    w = torch.randn(5, **f64)
    y, mean, rstd = reference.layer_norm_forward(x, w, w, 1e-5)
    a = reference.layer_norm_backward(y, x, w, mean, rstd)
    b = reference.layer_norm_backward(y, x, w, mean.flatten(), rstd.flatten())
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert reference.layer_norm_token_backward(x[0, 0], x[0, 0], None, 0.0, 1.0)[0].shape == (5,)


def test_a_non_tensor_x_is_named():
    with pytest.raises(TypeError, match=r"^x: expected a torch.Tensor, got list$"):
        reference.layer_norm_forward([1.0, 2.0], None, None, 1e-5)


def test_rows_of_no_features_and_parameters_of_another_kind():
    """D = 0 raised "cannot reshape tensor of 0 elements into shape [-1, 0]" (torch's norms
    take it); a complex weight gave a complex y and an integer one passed."""
    x, dy = torch.randn(3, 0), torch.randn(3, 0)
    y, mean, rstd = reference.layer_norm_forward(x, None, None, 1e-5)
    assert y.shape == (3, 0) and mean.shape == rstd.shape == (3,)
    dx, dw, db = reference.layer_norm_backward(dy, x, None, mean, rstd)
    assert dx.shape == (3, 0) and dw is None and db.shape == (0,)
    y, rstd = reference.rms_norm_forward(x, None, 1e-5)
    assert y.shape == (3, 0) and reference.rms_norm_backward(dy, x, None, rstd)[0].shape == (3, 0)
    for bad in (torch.ones(4, dtype=torch.complex64), torch.ones(4, dtype=torch.int64)):
        with pytest.raises(TypeError, match=f"weight: expected a real floating-point dtype, "
                                            f"got {bad.dtype}"):
            reference.layer_norm_forward(torch.randn(2, 4), bad, None, 1e-5)
        with pytest.raises(TypeError, match=f"bias: expected a real floating-point dtype"):
            reference.layer_norm_forward(torch.randn(2, 4), None, bad, 1e-5)
