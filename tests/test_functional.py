"""The public API mirrors torch.nn.functional and torch.nn, on the CPU reference path."""

import importlib.util

import pytest
import numpy as np
import torch
import torch.nn.functional as F

import normbook
from helpers import grads

f64 = dict(dtype=torch.float64)


@pytest.mark.parametrize("shape,norm_shape", [((7, 11), (11,)), ((2, 3, 4, 5), (4, 5)), ((6,), (6,)), ((3, 1), (1,)), ((2, 3, 2, 2), (3, 2, 2))])
def test_layer_norm_matches_torch_with_multidim_normalized_shape(shape, norm_shape):
    x = torch.randn(shape, **f64) * 2 + 1
    w, b = torch.randn(norm_shape, **f64), torch.randn(norm_shape, **f64)
    dy = torch.randn(shape, **f64)
    ours = normbook.layer_norm(x, norm_shape, w, b, 1e-5)
    torch.testing.assert_close(ours, F.layer_norm(x, norm_shape, w, b, 1e-5), rtol=1e-12, atol=1e-12)
    g_ours = grads(lambda *t: normbook.layer_norm(t[0], norm_shape, t[1], t[2], 1e-5), dy, x, w, b)[1]
    g_torch = grads(lambda *t: F.layer_norm(t[0], norm_shape, t[1], t[2], 1e-5), dy, x, w, b)[1]
    for a, e in zip(g_ours, g_torch):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("eps", [None, 1e-6])
@pytest.mark.parametrize("shape,norm_shape", [((7, 11), (11,)), ((2, 3, 4, 5), (4, 5)), ((5,), 5)])
def test_rms_norm_matches_torch(shape, norm_shape, eps):
    x = torch.randn(shape, **f64)
    ns = (norm_shape,) if isinstance(norm_shape, int) else norm_shape
    w = torch.randn(ns, **f64)
    dy = torch.randn(shape, **f64)
    torch.testing.assert_close(normbook.rms_norm(x, norm_shape, w, eps), F.rms_norm(x, ns, w, eps), rtol=1e-12, atol=1e-12)
    g_ours = grads(lambda *t: normbook.rms_norm(t[0], norm_shape, t[1], eps), dy, x, w)[1]
    g_torch = grads(lambda *t: F.rms_norm(t[0], ns, t[1], eps), dy, x, w)[1]
    for a, e in zip(g_ours, g_torch):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_gradcheck_through_the_hand_derived_backward():
    x = torch.randn(3, 5, **f64, requires_grad=True)
    w = torch.randn(5, **f64, requires_grad=True)
    b = torch.randn(5, **f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: normbook.layer_norm(x, (5,), w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: normbook.rms_norm(x, (5,), w, 1e-5), (x, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_reduces_in_fp32_and_returns_input_dtype(dtype):
    x = (torch.randn(16, 256) * 3 + 100).to(dtype)        # mean 100: centring is ill-conditioned
    w = torch.randn(256).to(dtype)
    exact = F.layer_norm(x.double(), (256,), w.double())
    y = normbook.layer_norm(x, (256,), w)
    assert y.dtype == dtype
    # The design's accuracy rule: within twice torch's own error in the same dtype, plus one
    # rounding of the output (both round the same fp32 value to the output dtype).
    err = (y.double() - exact).abs().max().item()
    err_torch = (F.layer_norm(x, (256,), w).double() - exact).abs().max().item()
    assert err <= 2 * err_torch + torch.finfo(dtype).eps * exact.abs().max().item()
    # fp32 weight with a low-precision input: output keeps the input's dtype
    assert normbook.layer_norm(x, (256,), w.float()).dtype == dtype


def test_modules_are_torch_modules_with_interchangeable_state_dicts():
    ours = normbook.LayerNorm((4, 5), eps=1e-6)
    theirs = torch.nn.LayerNorm((4, 5), eps=1e-6)
    assert isinstance(ours, torch.nn.LayerNorm)
    assert torch.equal(ours.weight, torch.ones(4, 5)) and torch.equal(ours.bias, torch.zeros(4, 5))
    with torch.no_grad():
        theirs.weight.normal_(), theirs.bias.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 4, 5)
    torch.testing.assert_close(ours(x), theirs(x))
    theirs.load_state_dict(ours.state_dict())

    no_bias = normbook.LayerNorm(8, bias=False)
    assert no_bias.bias is None and list(no_bias.state_dict()) == ["weight"]
    x8 = torch.randn(2, 8)
    torch.testing.assert_close(no_bias(x8), F.layer_norm(x8, (8,), no_bias.weight))

    r_ours, r_theirs = normbook.RMSNorm(6), torch.nn.RMSNorm(6)
    with torch.no_grad():
        r_theirs.weight.normal_()
    r_ours.load_state_dict(r_theirs.state_dict())
    x = torch.randn(2, 6)
    torch.testing.assert_close(r_ours(x), r_theirs(x))
    assert repr(r_ours).startswith("RMSNorm((6,)")


@pytest.mark.parametrize("cls", [normbook.LayerNorm, normbook.RMSNorm])
def test_modules_see_parameters_moved_out_of_parameters(cls):
    """The modules read weight and bias from _parameters (faster than Module.__getattr__);
    a weight that parametrize or the old weight_norm hook moved out is read as module.weight
    gives it, as torch's modules read it."""
    import torch.nn.utils.parametrize as P

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    theirs = torch.nn.LayerNorm(6) if cls is normbook.LayerNorm else torch.nn.RMSNorm(6)
    ours = cls(6)
    x = torch.randn(3, 6)
    for m in (ours, theirs):
        P.register_parametrization(m, "weight", Double())
        assert "weight" not in m._parameters
    torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours(x), 2 * cls(6)(x))    # the parametrized weight, 2 * ones
    old = cls(6)
    torch.nn.utils.weight_norm(old, "weight", dim=0)        # a hook sets a plain tensor weight
    with torch.no_grad():
        old.weight_g.mul_(3)
    ref = theirs.__class__(6)
    with torch.no_grad():
        ref.weight.mul_(3)
    torch.testing.assert_close(old(x), ref(x))


def test_module_trains_through_the_reference_backward():
    m = normbook.LayerNorm(5, dtype=torch.float64)
    t = torch.nn.LayerNorm(5, dtype=torch.float64)
    x = torch.randn(4, 5, **f64)
    dy = torch.randn(4, 5, **f64)
    m(x).backward(dy)
    t(x).backward(dy)
    torch.testing.assert_close(m.weight.grad, t.weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.bias.grad, t.bias.grad, rtol=1e-12, atol=1e-12)


def test_edge_cases():
    w, b = torch.randn(5, **f64), torch.randn(5, **f64)
    # a constant row gives exactly the bias
    assert torch.equal(normbook.layer_norm(torch.full((3, 5), -2.5, **f64), (5,), w, b), b.expand(3, 5))
    # an all-zero row gives zero for RMSNorm
    assert torch.equal(normbook.rms_norm(torch.zeros(2, 5, **f64), (5,), w, 1e-5), torch.zeros(2, 5, **f64))
    # D = 1: xhat is 0, so LayerNorm returns the bias; gradients flow
    x1 = torch.randn(4, 1, **f64, requires_grad=True)
    y1 = normbook.layer_norm(x1, (1,), torch.ones(1, **f64), torch.full((1,), 0.5, **f64))
    assert torch.equal(y1, torch.full((4, 1), 0.5, **f64))
    y1.sum().backward()
    assert torch.equal(x1.grad, torch.zeros(4, 1, **f64))


def test_empty_batch_forward_and_backward():
    x = torch.randn(0, 3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    y = normbook.layer_norm(x, (8,), w, b)
    assert y.shape == (0, 3, 8)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros(8)) and torch.equal(b.grad, torch.zeros(8))
    assert normbook.rms_norm(torch.randn(0, 8), (8,)).shape == (0, 8)


def test_a_nan_stays_in_its_own_row():
    x = torch.randn(4, 6, **f64, requires_grad=True)
    with torch.no_grad():
        x[2, 3] = float("nan")
    w = torch.randn(6, **f64, requires_grad=True)
    for fn in (lambda x, w: normbook.layer_norm(x, (6,), w), lambda x, w: normbook.rms_norm(x, (6,), w)):
        x.grad = None
        y = fn(x, w)
        rows_nan = y.isnan().any(-1)
        assert rows_nan.tolist() == [False, False, True, False]
        dy = torch.ones_like(y)
        y.backward(dy)
        assert x.grad.isnan().any(-1).tolist() == [False, False, True, False]



@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_call_no_backward_follows_gives_the_functions_y_bitwise(norm, dtype):
    """Where nothing requires grad, the torch backend computes y without the autograd Function
    (no context, no statistics): the same y, bit for bit, as the Function's forward, on rows
    that torch's fused kernel finishes and on those that fall back to the formulas (a NaN, a
    row whose variance overflows fp32, an empty batch)."""
    x = torch.randn(5, 3, 16).to(dtype)
    x[1, 2, 4] = float("nan")
    if dtype != torch.float64:
        x[3, 0] = torch.linspace(-1, 1, 16) * 3e19
    w, b = torch.randn(16).to(dtype), torch.randn(16).to(dtype)
    def run(x, w, b):
        if norm == "layer":
            return normbook.layer_norm(x, (16,), w, b)
        return normbook.rms_norm(x, (16,), w)

    def run_add(x, w, b):       # the fused add, and (2, 3, 16) rows where x is (5, 3, 16)
        r = x.flip(0)
        if norm == "layer":
            return normbook.add_layer_norm(x, r, w, b)
        return normbook.add_rms_norm(x, r, w)
    with normbook.backend("torch"):
        for inp in (x, x[:0]):
            plain = run(inp, w, b)                         # nothing requires grad
            with torch.no_grad():
                unrecorded = run(inp, w.requires_grad_(), b.requires_grad_())
            recorded = run(inp, w, b)                      # through the Function
            w.requires_grad_(False), b.requires_grad_(False)
            assert recorded.grad_fn is not None and plain.grad_fn is None
            for y in (plain, unrecorded):
                assert y.dtype == recorded.dtype and y.shape == recorded.shape
                assert torch.equal(y.isnan(), recorded.isnan())
                assert torch.equal(y.nan_to_num(), recorded.detach().nan_to_num())
            plain = run_add(inp, w, b)
            with torch.no_grad():
                unrecorded = run_add(inp, w.requires_grad_(), b.requires_grad_())
            recorded = run_add(inp, w, b)
            w.requires_grad_(False), b.requires_grad_(False)
            for out in (plain, unrecorded):
                for y, ref in zip(out, recorded):
                    assert y.dtype == ref.dtype and y.shape == ref.shape
                    assert torch.equal(y.nan_to_num(), ref.detach().nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_weight", [True, False])
def test_one_tokens_gradients_are_tensors_of_their_own(dtype, with_weight):
    """A 1-D input is one token: the bias gradient is dy summed over no tokens, which must be a
    new tensor, as torch's is, not dy itself (zeroing it zeroed the caller's dy) nor an
    expanded view of it (clipping it in place raised)."""
    D = 8
    x, b = torch.randn(D, dtype=dtype, requires_grad=True), torch.randn(D, dtype=dtype, requires_grad=True)
    w = torch.randn(D, dtype=dtype, requires_grad=True) if with_weight else None
    with normbook.backend("torch"):
        dy = torch.randn(D, dtype=dtype)
        grads_ = torch.autograd.grad(normbook.layer_norm(x, (D,), w, b), (x, b, *([w] if w is not None else [])), dy)
        assert all(g.data_ptr() != dy.data_ptr() for g in grads_)
        expanded = torch.autograd.grad(normbook.layer_norm(x, (D,), w, b).sum(), (x, b))
        for g in expanded:
            g.mul_(0.5)                      # writable, as torch's gradients are

# Bad input: a clear error naming the argument, with expected against given.
@pytest.mark.parametrize("call,exc,pattern", [
    (lambda: normbook.layer_norm(torch.randn(2, 5), (5,), torch.ones(4)), ValueError, r"weight: expected shape \(5,\).*got \(4,\)"),
    (lambda: normbook.layer_norm(torch.randn(2, 5), (5,), None, torch.ones(5, 1)), ValueError, r"bias: expected shape \(5,\).*got \(5, 1\)"),
    (lambda: normbook.layer_norm(torch.randn(2, 5), (4,)), ValueError, r"normalized_shape: .*\(5,\).*\(4,\)"),
    (lambda: normbook.layer_norm(torch.randn(5), (2, 5)), ValueError, r"normalized_shape: .*\(2, 5\)"),
    (lambda: normbook.rms_norm(torch.randn(2, 5), (6,)), ValueError, r"normalized_shape: .*\(6,\)"),
    (lambda: normbook.layer_norm(torch.ones(2, 5, dtype=torch.int64), (5,)), TypeError, r"input: expected a floating-point dtype.*got torch.int64"),
    (lambda: normbook.rms_norm(torch.ones(2, 5, dtype=torch.bool), (5,)), TypeError, r"input: expected a floating-point dtype.*got torch.bool"),
    (lambda: normbook.layer_norm([1.0, 2.0], (2,)), TypeError, r"input: expected a torch.Tensor, got list"),
    (lambda: normbook.layer_norm(torch.randn(2, 5), (5,), torch.ones(5, device="meta")), ValueError, r"weight: expected a tensor on input's device cpu, got meta"),
    (lambda: normbook.rms_norm(torch.randn(2, 5), (5,), torch.ones(5, dtype=torch.int32)), TypeError, r"weight: expected a floating-point dtype, got torch.int32"),
    (lambda: normbook.layer_norm(torch.randn(2, 5), (5,), eps="0.1"), TypeError, r"eps: expected a real number or a 0-d tensor, got '0.1'"),
    (lambda: normbook.LayerNorm(5, True)(torch.randn(2, 5)), TypeError, r"eps: expected a real number or a 0-d tensor, got True"),
    # a bool as a 0-d tensor is a bool too (it was taken as 1.0)
    (lambda: normbook.layer_norm(torch.randn(2, 5), 5, eps=torch.tensor(True)), TypeError, r"eps: expected a real number or a 0-d tensor, got tensor\(True\)"),
    (lambda: normbook.rms_norm(torch.randn(2, 5), 5, eps=torch.tensor(False)), TypeError, r"eps: expected a real number or a 0-d tensor, got tensor\(False\)"),
    (lambda: normbook.rms_norm(torch.randn(2, 5), 5, eps=torch.ones(2)), TypeError, r"eps: expected a real number or a 0-d tensor, got tensor"),
    # one element, not 0-d: torch refuses it too
    (lambda: normbook.layer_norm(torch.randn(2, 5), 5, eps=torch.tensor([1e-3])), TypeError, r"eps: expected a real number or a 0-d tensor, got tensor\(\[0.0010\]\)"),
    (lambda: normbook.layer_norm(torch.randn(2, 5), "5"), TypeError, r"normalized_shape: expected an int or a sequence of ints, got str"),
    # NaN is refused however normalized_shape is written (an int, a 1-tuple: the fast path)
    (lambda: normbook.layer_norm(torch.randn(2, 5), (5,), eps=float("nan")), ValueError, r"eps: expected a real number other than NaN, got nan"),
    (lambda: normbook.rms_norm(torch.randn(2, 5), 5, eps=float("nan")), ValueError, r"eps: expected a real number other than NaN, got nan"),
    (lambda: normbook.layer_norm(torch.randn(2, 5), 5, eps=torch.tensor(float("nan"))), ValueError, r"eps: expected a real number other than NaN, got nan"),
    (lambda: normbook.add_rms_norm(torch.randn(2, 5), torch.randn(2, 5), eps=float("nan")), ValueError, r"eps: expected a real number other than NaN, got nan"),
    (lambda: normbook.add_layer_norm(torch.tensor(1.0), torch.tensor(1.0)), ValueError, r"x: expected a tensor of shape \(\.\.\., D\) with at least one dim, got a 0-d tensor"),
])
def test_bad_input_names_the_argument(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("normalized_shape", [(8.9,), (8.0,), 8.0, ["8"], (True,), True,
                                              torch.tensor([8.0]), torch.tensor([8]), (2, 4.0),
                                              None])
def test_normalized_shape_of_other_than_ints_is_refused(backend, normalized_shape):
    """A float, a bool, a string or a float tensor in normalized_shape is a TypeError, as in
    torch (which refuses each of these): int(8.9) would normalize over 8 values without a word,
    and (8.0,) or (True,) compare equal to a signature the fast path knows. The same D as an int
    runs first, so that the kernels' fast path has the signature ready."""
    if backend == "kernels":
        pytest.importorskip("triton")
    x = torch.randn(3, 8) if normalized_shape not in ((True,), True) else torch.randn(3, 1)
    D = x.shape[-1]
    with normbook.backend(backend):
        for fn in (normbook.layer_norm, normbook.rms_norm):
            for _ in range(2):
                fn(x, (D,))
            with pytest.raises(TypeError, match=r"normalized_shape: expected an int or a "
                                                r"sequence of ints, got "):
                fn(x, normalized_shape)
            with pytest.raises(TypeError):      # torch refuses it too
                getattr(torch.nn.functional, fn.__name__)(x, normalized_shape)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_an_inference_tensor_takes_the_weight_s_gradient(backend):
    """A tensor made under torch.inference_mode, normalized by a module whose weight wants a
    gradient: torch.nn.RMSNorm takes it (its composed ops save only what they compute from
    x), and so do normbook's norms (the Function saves a copy of x for the weight's gradient;
    autograd refused to save x itself). Three calls: the kernels' fast path too."""
    if backend == "kernels":
        pytest.importorskip("triton")
    with torch.inference_mode():
        xi = torch.randn(3, 8)
    with normbook.backend(backend):
        for _ in range(3):
            ours, theirs = normbook.RMSNorm(8), torch.nn.RMSNorm(8)
            y, want = ours(xi), theirs(xi)
            y.square().sum().backward()
            want.square().sum().backward()
            torch.testing.assert_close(y, want)
            torch.testing.assert_close(ours.weight.grad, theirs.weight.grad)
            ln = normbook.LayerNorm(8)              # (torch's LayerNorm refuses it)
            ln(xi).square().sum().backward()
            assert ln.weight.grad is not None and ln.bias.grad is not None
        with pytest.raises(RuntimeError):          # other errors are raised as they were
            normbook.rms_norm(xi, 4)


@pytest.mark.parametrize("name, call", [
    ("empty normalized_shape", lambda F: F.layer_norm(torch.randn(2, 5), ())),
    ("weight on meta", lambda F: F.layer_norm(torch.randn(2, 5), (5,), torch.ones(5, device="meta"))),
    ("weight on meta, rms", lambda F: F.rms_norm(torch.randn(2, 5), (5,), torch.ones(5, device="meta"))),
    ("int64 input", lambda F: F.layer_norm(torch.ones(2, 5, dtype=torch.int64), (5,))),
    ("bool input, rms", lambda F: F.rms_norm(torch.ones(2, 5, dtype=torch.bool), (5,))),
    ("weight of wrong shape", lambda F: F.layer_norm(torch.randn(2, 5), (5,), torch.ones(4))),
    # the fused add of 0-d tensors, against torch's composition: the norm of x + residual over
    # its last dim, of which it has none
    ("0-d x, fused add", lambda F: normbook.add_layer_norm(torch.tensor(1.0), torch.tensor(1.0))
     if F is normbook else F.layer_norm(torch.tensor(2.0), torch.tensor(2.0).shape[-1:])),
])
def test_an_error_is_of_torch_s_class_too(name, call):
    """Where torch's norm raises a RuntimeError (or NotImplementedError) normbook's error is
    one too, besides the ValueError or TypeError it is: code written against either catches
    it (measured: each torch call below raises)."""
    with pytest.raises(Exception) as theirs:
        call(torch.nn.functional)
    with pytest.raises(Exception) as ours:
        call(normbook)
    assert isinstance(ours.value, type(theirs.value)), (name, ours.value, theirs.value)
    assert isinstance(ours.value, (ValueError, TypeError))


@pytest.mark.parametrize("normalized_shape", [(np.int64(8),), (torch.tensor(8),), [8],
                                              torch.Size([8]), 8])
def test_normalized_shape_of_integers_is_taken(normalized_shape):
    """What torch takes as a dim, normbook takes: a numpy integer, an integer 0-d tensor."""
    x = torch.randn(3, 8)
    assert torch.equal(normbook.layer_norm(x, normalized_shape), normbook.layer_norm(x, 8))


def test_import_imports_neither_triton_nor_dtensor():
    """Triton only on demand; DTensor (a second of import) with normbook.kernels, which
    registers its sharding rules."""
    import subprocess
    import sys

    code = ("import sys, normbook; heavy = {'triton', 'torch.distributed.tensor'} & set(sys.modules); "
            "assert not heavy, f'normbook imported {heavy}'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- the backend

def test_backend_chooses_what_computes_and_comes_back():
    """normbook.backend("torch") keeps the torch ops, "kernels" sends the same call through the
    Triton kernels (here in the interpreter: the bits of normbook.kernels), and the choice ends
    with the block, also when the block raises."""
    pytest.importorskip("triton")
    import normbook.kernels as K
    from normbook import functional

    x = torch.randn(5, 3, 16)
    w, b = torch.randn(16), torch.randn(16)
    with normbook.backend("kernels"):
        assert torch.equal(normbook.layer_norm(x, (16,), w, b), K.layer_norm(x, (16,), w, b))
        assert torch.equal(normbook.RMSNorm(16)(x), K.rms_norm(x, (16,), torch.ones(16)))
        with normbook.backend("torch"):
            assert not functional._use_kernels(x)
        assert functional._use_kernels(x)
    with pytest.raises(RuntimeError), normbook.backend("kernels"):
        raise RuntimeError("inside")
    assert functional._backend == "auto" and not functional._use_kernels(x)
    with pytest.raises(ValueError, match=r"backend: expected one of 'auto', 'kernels', 'torch', got 'gpu'"):
        with normbook.backend("gpu"):
            pass
    # a tensor the kernels cannot reach: a DeviceError, so a RuntimeError as torch's device
    # mistakes are (it was a plain ValueError)
    with normbook.backend("kernels"), pytest.raises(RuntimeError,
                                                   match="input: expected a CUDA tensor"):
        normbook.layer_norm(torch.empty(2, 16, device="meta"), 16)


def test_backend_blocks_overlapping_in_two_threads_each_end_their_own():
    """A block in one thread, then one in another that ends after it: the first block's end
    gave back the choice from before it ("auto") while the second still ran, and the second's
    end gave back the first's ("kernels"), for good. Now the running block entered last
    decides, and "auto" comes back when both have ended."""
    import threading

    from normbook import functional

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def first():
        with normbook.backend("kernels"):
            a_in.set()
            b_in.wait(10)
        seen.append(functional._backend)      # the second block runs on
        a_out.set()

    def second():
        a_in.wait(10)
        with normbook.backend("torch"):
            b_in.set()
            a_out.wait(10)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == ["torch"] and functional._backend == "auto"
    with normbook.backend("kernels"), normbook.backend("torch"):
        with normbook.backend("kernels"):
            pass
        assert functional._backend == "torch"     # the inner "kernels" ended, not the outer
    assert functional._backend == "auto"


def test_kernel_route_validates_once(monkeypatch):
    """One door: on the kernel route, normbook.layer_norm does not run the torch path's
    argument checks before the kernels' own (it used to, about 20 us a call)."""
    pytest.importorskip("triton")
    from normbook import _validate

    seen = []
    monkeypatch.setattr(_validate, "check_norm_args", lambda *a, **k: seen.append(a))
    with normbook.backend("kernels"):
        normbook.layer_norm(torch.randn(4, 32), 32, torch.ones(32), torch.zeros(32))
    assert seen == []


# ----------------------------------------------------------------------------- the fused add, torch backend

@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_add_norm_on_the_torch_backend_is_the_norm_of_the_sum(norm):
    """normbook.add_layer_norm / add_rms_norm on a CPU tensor: (y, h) = (norm(x + r), x + r),
    first and second derivatives by gradcheck, the fork rule when only h is used, and the
    transforms (vmap, jvp, forward-mode AD) through the one Function."""
    from torch.func import jvp, vmap

    torch.manual_seed(0)
    x, r = torch.randn(3, 5, 8, **f64, requires_grad=True), torch.randn(3, 5, 8, **f64, requires_grad=True)
    w, b = torch.randn(8, **f64, requires_grad=True), torch.randn(8, **f64, requires_grad=True)
    if norm == "layer":
        ours = lambda x, r, w, b: normbook.add_layer_norm(x, r, w, b)   # noqa: E731
        theirs = lambda x, r, w, b: F.layer_norm(x + r, (8,), w, b)     # noqa: E731
    else:
        ours = lambda x, r, w, b: normbook.add_rms_norm(x, r, w)        # noqa: E731
        theirs = lambda x, r, w, b: F.rms_norm(x + r, (8,), w)          # noqa: E731
    y, h = ours(x, r, w, b)
    torch.testing.assert_close(y, theirs(x, r, w, b), rtol=1e-12, atol=1e-12)
    assert torch.equal(h, x + r)
    torch.autograd.gradcheck(ours, (x, r, w, b))
    torch.autograd.gradgradcheck(ours, (x, r, w, b))
    h.sum().backward()                      # only h used: each of x, r receives dh
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(r.grad, torch.ones_like(r))
    torch.testing.assert_close(vmap(lambda a, c: ours(a, c, w, b)[0])(x, r), theirs(x, r, w, b),
                               rtol=1e-12, atol=1e-12)
    t = torch.randn_like(x)
    got = jvp(lambda a: ours(a, r, w, b)[0], (x,), (t,))[1]
    want = jvp(lambda a: theirs(a, r, w, b), (x,), (t,))[1]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_wrong_shape_is_a_runtime_error_as_in_torch_and_a_value_error():
    """torch's norms raise RuntimeError for a mismatched shape; normbook's message names the
    argument, and its exception is both, so code written against either catches it."""
    calls = [lambda: normbook.layer_norm(torch.randn(3, 8), (4,)),
             lambda: normbook.RMSNorm(4)(torch.randn(3, 8)),
             lambda: normbook.layer_norm(torch.randn(3, 8), (8,), torch.ones(4)),
             lambda: normbook.add_rms_norm(torch.randn(3, 8), torch.randn(3, 4))]
    for call in calls:
        with pytest.raises(RuntimeError) as info:
            call()
        assert isinstance(info.value, ValueError) and "expected" in str(info.value)
    with pytest.raises(RuntimeError):
        F.layer_norm(torch.randn(3, 8), (4,))


def test_add_norm_refuses_a_mismatched_residual():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"residual: expected x's shape \(2, 8\), got \(2, 4\)"):
        normbook.add_layer_norm(x, torch.randn(2, 4))
    with pytest.raises(TypeError, match="residual: expected x's dtype torch.float32, got torch.float64"):
        normbook.add_rms_norm(x, x.double())
    with pytest.raises(TypeError, match="residual: expected a torch.Tensor, got None"):
        normbook.add_rms_norm(x, None)


@pytest.mark.parametrize("mode", ["torch", "kernels", "compiled", "forward-AD"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_add_norm_gradients_accumulate_into_leaves_like_torch(request, norm, mode):
    """Two backwards into leaves x and residual of three dims (gradient accumulation): each
    leaf's .grad is a tensor of its own and holds the sum of both backwards, as for torch's
    x + residual. (Flattened apart, x and the residual received two views of one gradient,
    which autograd made both leaves' .grad without a copy: the second backward added into it
    twice, and clipping one gradient in place clipped the other.)"""
    import contextlib

    import torch.autograd.forward_ad as fwAD

    if mode == "kernels":
        request.getfixturevalue("kernels")
    torch.manual_seed(0)
    x, r = (torch.randn(2, 3, 16, requires_grad=True) for _ in range(2))
    w = torch.randn(16, requires_grad=True)
    if norm == "layer":
        ours = lambda x, r: normbook.add_layer_norm(x, r, w)          # noqa: E731
        theirs = lambda h: F.layer_norm(h, (16,), w)                  # noqa: E731
    else:
        ours = lambda x, r: normbook.add_rms_norm(x, r, w)            # noqa: E731
        theirs = lambda h: F.rms_norm(h, (16,), w, torch.finfo(torch.float32).eps)  # noqa: E731
    if mode == "compiled":
        ours = torch.compile(ours, backend="aot_eager", fullgraph=True)
    x2, r2 = (t.detach().clone().requires_grad_() for t in (x, r))
    context = {"kernels": normbook.backend("kernels"), "forward-AD": fwAD.dual_level()}.get(
        mode, contextlib.nullcontext())
    with context:
        for step in range(2):
            c = torch.randn(2, 3, 16)
            y, h = ours(x, r)
            (y * c + h * c.flip(0)).sum().backward()
            h2 = x2 + r2
            (theirs(h2) * c + h2 * c.flip(0)).sum().backward()
    assert x.grad.data_ptr() != r.grad.data_ptr()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.grad, r2.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("fused", [False, True])
def test_forward_ad_over_rows_of_three_dims_like_torch(request, backend, fused):
    """Forward-mode AD on (B, T, D) activations: the tangent of y (and of h) as torch's
    composition gives it, on both backends. (The kernels' launchers were handed the (..., D)
    input as it was, and failed to unpack its shape.) h is torch's own x + residual there: it
    carries x's tangent, and requires grad only as x + residual would (one output of the
    Function that required grad whenever the weight did made gradgradcheck's forward-over-
    reverse fail)."""
    import torch.autograd.forward_ad as fwAD

    if backend == "kernels":
        request.getfixturevalue("kernels")
    torch.manual_seed(0)
    x, tx, r = (torch.randn(2, 3, 8) for _ in range(3))
    w, tw = torch.randn(8, requires_grad=True), torch.randn(8)
    h0 = x + r if fused else x
    _, want = torch.func.jvp(lambda h, w: F.layer_norm(h, (8,), w), (h0, w.detach()), (tx, tw))
    with normbook.backend(backend), fwAD.dual_level():
        xd, wd = fwAD.make_dual(x, tx), fwAD.make_dual(w.detach(), tw).requires_grad_()
        if fused:
            y, h = normbook.add_layer_norm(xd, r, wd)
            assert torch.equal(fwAD.unpack_dual(h).tangent, tx)
            assert not h.requires_grad and not (x + r).requires_grad
            _, h_only_w = normbook.add_layer_norm(x, r, wd)
            assert fwAD.unpack_dual(h_only_w).tangent is None    # as torch's: no tangent
        else:
            y = normbook.layer_norm(xd, (8,), wd)
        got = fwAD.unpack_dual(y).tangent
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_add_passes_gradgradcheck_forward_over_reverse():
    """torch's own checker, forward over reverse included, on add_layer_norm and add_rms_norm
    with x and the residual constants and the parameters wanting gradients (it failed: "got 2
    tensors and 1 gradients", h requiring grad where x + residual does not)."""
    torch.manual_seed(0)
    x, r = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    w, b = (torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradgradcheck(normbook.add_layer_norm, [x, r, w, b],
                                        check_fwd_over_rev=True)
    assert torch.autograd.gradgradcheck(normbook.add_rms_norm, [x, r, w],
                                        check_fwd_over_rev=True)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_add_norm_where_only_h_is_used_like_torch(request, backend):
    """h = x + residual used without y: the parameters get no gradient (None, not zeros: an
    optimizer's weight decay treats the two apart), and h changed in place before the backward
    is no error, as for torch's x + residual. h does not require grad when only the
    parameters do."""
    if backend == "kernels":
        request.getfixturevalue("kernels")
    x, r = torch.randn(2, 3, 16, requires_grad=True), torch.randn(2, 3, 16)
    w, b = torch.ones(16, requires_grad=True), torch.zeros(16, requires_grad=True)
    with normbook.backend(backend):
        y, h = normbook.add_layer_norm(x, r, w, b)
        h.add_(1)
        h.sum().backward()
        assert w.grad is None and b.grad is None and torch.equal(x.grad, torch.ones_like(x))
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            torch.autograd.grad(normbook.add_rms_norm(x, r, w)[1].sum(), [w])
        assert torch.autograd.grad(normbook.add_rms_norm(x, r, w)[1].sum(), [w],
                                   allow_unused=True) == (None,)
        y, h = normbook.add_rms_norm(x.detach(), r, w)
        assert y.requires_grad and not h.requires_grad and h.grad_fn is None


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("shape", [(2, 3, 16), (16,), (5, 16)])
def test_outputs_are_tensors_of_their_own_like_torch(request, backend, shape):
    """Outputs of every shape come from the Function itself, not as views of it (as torch's
    do): ``detach_`` works on them, and their grad_fn is the Function's."""
    if backend == "kernels":
        request.getfixturevalue("kernels")
    x, r = torch.randn(shape, requires_grad=True), torch.randn(shape, requires_grad=True)
    with normbook.backend(backend):
        outs = [normbook.layer_norm(x, (16,)), normbook.rms_norm(x, (16,)),
                normbook.LayerNorm(16)(x), normbook.RMSNorm(16)(x),
                *normbook.add_layer_norm(x, r), *normbook.add_rms_norm(x, r)]
    for out in outs:
        assert out.shape == x.shape and not out._is_view()
        assert type(out.grad_fn).__name__ == "NormFunctionBackward"
        out.detach_()


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_outputs_over_several_dims_are_tensors_of_their_own_like_torch(request, backend):
    """normalized_shape of two dims: y came back as a view of the Function's (M, D) output
    (``_is_view()``, and ``detach_`` raised "Can't detach views in-place"), where torch's is
    a tensor of its own. It is one now, its gradient torch's; the fused add's h, which backward
    saved, stays a view of it (its version is the saved h's)."""
    if backend == "kernels":
        request.getfixturevalue("kernels")
    x = torch.randn(3, 2, 4, requires_grad=True)
    with normbook.backend(backend):
        outs = [normbook.layer_norm(x, (2, 4)), normbook.rms_norm(x, (2, 4)),
                normbook.LayerNorm([2, 4])(x), normbook.RMSNorm((2, 4))(x)]
    for out, torch_norm in zip(outs, [F.layer_norm, F.rms_norm] * 2):
        want = torch_norm(x, (2, 4))
        assert out.shape == x.shape and not out._is_view()
        (got,) = torch.autograd.grad(out, x, torch.ones_like(out))
        (expected,) = torch.autograd.grad(want, x, torch.ones_like(want))
        torch.testing.assert_close(got, expected)
        out.detach_()


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_permuted_inputs_give_contiguous_outputs_like_torch(request, backend, dtype):
    """A transposed or permuted input (ConvNeXt's channels-last norm, say): the output is
    contiguous, as torch's is, so ``.view`` works on it; and it is no view itself."""
    if backend == "kernels":
        request.getfixturevalue("kernels")
    x = torch.randn(2, 3, 16, dtype=dtype).transpose(0, 1).requires_grad_()
    x4 = torch.randn(2, 16, 4, 8, dtype=dtype).permute(0, 2, 3, 1)
    r = torch.randn(3, 2, 16, dtype=dtype)
    with normbook.backend(backend):
        outs = [normbook.LayerNorm(16, dtype=dtype)(x), normbook.RMSNorm(16, dtype=dtype)(x),
                normbook.layer_norm(x4, (16,)), normbook.rms_norm(x4, (16,)),
                *normbook.add_layer_norm(x, r)]
    for out in outs:
        assert out.is_contiguous() and not out._is_view()
    torch.testing.assert_close(outs[0], F.layer_norm(x, (16,)))
    torch.testing.assert_close(outs[2], F.layer_norm(x4, (16,)))


def _kept_for_backward(fn, callers):
    """(fn(), the bytes of the storages autograd keeps for its backward that are none of the
    ``callers``' tensors): what the graph alone holds alive."""
    theirs = {t.untyped_storage().data_ptr() for t in callers}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in theirs:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(kept.values())


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("layout", ["transposed", "permuted", "sliced"])
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_strided_inputs_keep_no_dense_copy_for_backward(request, backend, layout, is_rms):
    """A strided input is saved for backward as the caller's tensor, not as a dense copy: the
    copy the rows need is made for the forward and again in backward (as torch's own kernel
    does), so the graph holds the statistics alone, 4 bytes a row per statistic, as for a
    dense input. The door's copy was kept: (M, D) values more than torch keeps, for x.t() on
    both backends and for (..., D) inputs on the torch backend. Gradients as torch's."""
    if backend == "kernels":
        request.getfixturevalue("kernels")
    M, D = 48, 32
    base = torch.randn({"transposed": (D, M), "permuted": (D, 4, 12),
                        "sliced": (4, 12, 3 * D)}[layout], requires_grad=True)
    x = {"transposed": lambda: base.t(), "permuted": lambda: base.movedim(0, -1),
         "sliced": lambda: base[..., :D]}[layout]()
    assert not x.is_contiguous()
    w = torch.randn(D, requires_grad=True)
    b = None if is_rms else torch.randn(D, requires_grad=True)
    dy = torch.randn(x.shape)
    with normbook.backend(backend):
        norm = (lambda t: normbook.rms_norm(t, D, w, 1e-6)) if is_rms else (
            lambda t: normbook.layer_norm(t, D, w, b))
        y, kept = _kept_for_backward(lambda: norm(x), [base, w] + ([] if is_rms else [b]))
        params = [w] + ([] if is_rms else [b])
        got = torch.autograd.grad(y, [base, *params], dy)
    assert y.is_contiguous()
    assert kept == (1 if is_rms else 2) * M * 4       # the statistics (k, M) in fp32
    want_y = F.rms_norm(x, (D,), w, 1e-6) if is_rms else F.layer_norm(x, (D,), w, b)
    want = torch.autograd.grad(want_y, [base, *params], dy)
    torch.testing.assert_close(y, want_y)
    for g_got, g_want in zip(got, want):
        torch.testing.assert_close(g_got, g_want)


# ----------------------------------------------------------------------------- autocast

def _under_fake_autocast(device, fn):
    """fn() under ``device``'s autocast (half dtype), on fake tensors of that device (no such
    device needed: torch's dispatcher runs its autocast rule all the same), without grad."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    half = torch.float16 if device == "mps" else torch.bfloat16
    was = torch.is_autocast_enabled(device)
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, half)
    try:
        with FakeTensorMode(), torch.no_grad():
            return fn(half)
    finally:
        torch.set_autocast_enabled(device, was)


@pytest.mark.parametrize("device", ["cuda", "xpu", "mps"])
def test_norms_under_autocast_return_what_torch_returns(request, device):
    """Where torch's autocast runs F.layer_norm / F.rms_norm in float32 (CUDA, XPU; LayerNorm
    on MPS too: normbook's table, which this checks against torch's dispatcher), normbook's
    norms return float32 for half inputs, as torch's do; the fused add's h stays x + residual's
    dtype. Elsewhere (MPS's RMSNorm) the input's dtype, as torch."""
    import warnings

    from normbook import functional as nf

    def dtypes(half):
        x, r = (torch.empty(2, 3, 16, device=device, dtype=half) for _ in range(2))
        w = torch.empty(16, device=device)
        y = [(F.layer_norm(x, (16,), w, w), normbook.layer_norm(x, (16,), w, w)),
             (F.rms_norm(x, (16,), w), normbook.rms_norm(x, (16,), w)),
             (torch.nn.LayerNorm(16, device=device)(x), normbook.LayerNorm(16, device=device)(x)),
             (torch.nn.RMSNorm(16, device=device)(x), normbook.RMSNorm(16, device=device)(x)),
             (F.layer_norm(x + r, (16,), w, w), normbook.add_layer_norm(x, r, w, w)[0]),
             (F.rms_norm(x + r, (16,), w), normbook.add_rms_norm(x, r, w)[0]),
             (x + r, normbook.add_layer_norm(x, r, w, w)[1])]
        if device == "cuda" and importlib.util.find_spec("triton"):
            import normbook.kernels as K
            y += [(F.layer_norm(x, (16,), w, w), K.layer_norm(x, (16,), w, w)),
                  (F.rms_norm(x + r, (16,), w), K.add_rms_norm(x, r, w)[0])]
        return [(a.dtype, b.dtype) for a, b in y]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # torch's mixed-dtype rms_norm note
        try:
            got = _under_fake_autocast(device, dtypes)
        except (RuntimeError, AssertionError) as e:     # a build without that device's type
            pytest.skip(f"no fake {device} tensors here: {e}")
    assert all(ours == theirs for theirs, ours in got), got
    assert (got[0][0] == torch.float32) == (device in nf._AUTOCAST_FP32[0])
    assert (got[1][0] == torch.float32) == (device in nf._AUTOCAST_FP32[1])


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_the_autocast_float32_rule_computes_the_norm_of_the_fp32_input(monkeypatch, norm):
    """The rule itself, on the CPU (whose autocast has no such rule for the norms: the table
    is extended for the test): y is the norm of the fp32-cast input, bitwise, and gradients
    flow back in the input's dtype; the fused add's h is x + residual in theirs."""
    from normbook import functional as nf

    monkeypatch.setattr(nf, "_AUTOCAST_FP32", ({"cpu"}, {"cpu"}))
    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(2, 3, 16, generator=g).bfloat16().requires_grad_() for _ in range(2))
    w = torch.randn(16, generator=g, requires_grad=True)
    fn = normbook.layer_norm if norm == "layer" else normbook.rms_norm
    add = (lambda x, r: normbook.add_layer_norm(x, r, w)) if norm == "layer" else (
        lambda x, r: normbook.add_rms_norm(x, r, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fn(x, (16,), w)
        yh, h = add(x, r)
    assert y.dtype == torch.float32 and torch.equal(y, fn(x.float(), (16,), w))
    assert h.dtype == torch.bfloat16 and torch.equal(h, x + r)
    assert torch.equal(yh, fn((x + r).float(), (16,), w))
    dy = torch.randn(2, 3, 16, generator=g)
    (gx,) = torch.autograd.grad(y, x, dy)
    x32 = x.detach().float().requires_grad_()
    (gx32,) = torch.autograd.grad(fn(x32, (16,), w), x32, dy)
    assert gx.dtype == torch.bfloat16 and torch.equal(gx, gx32.bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_half_rows_on_the_torch_backend_are_as_accurate_as_torch(norm, dtype):
    """bf16/fp16 rows on the CPU: the forward reads them as they are (torch's fused kernel for
    LayerNorm) and the backward a block of rows at a time in fp32 (several blocks here), without
    an fp32 copy of the whole rows; both within torch's own error against float64."""
    from helpers import assert_within_torch

    g = torch.Generator().manual_seed(1)
    M, D = 600, 1024                      # 600 rows of 1024: three blocks of the backward
    x = (torch.randn(M, D, generator=g) * 2 + 0.5).to(dtype)
    w = (1 + 0.5 * torch.randn(D, generator=g)).to(dtype)
    b = (0.5 * torch.randn(D, generator=g)).to(dtype)
    dy = torch.randn(M, D, generator=g).to(dtype)
    if norm == "layer":
        ours = lambda x, w, b: normbook.layer_norm(x, (D,), w, b)      # noqa: E731
        theirs = lambda x, w, b: F.layer_norm(x, (D,), w, b)           # noqa: E731
    else:
        ours = lambda x, w, b: normbook.rms_norm(x, (D,), w)           # noqa: E731
        theirs = lambda x, w, b: F.rms_norm(x, (D,), w)                # noqa: E731
    inputs = (x, w, b) if norm == "layer" else (x, w)
    with normbook.backend("torch"):
        y, got = grads(lambda *t: ours(*t, *([None] if norm == "rms" else [])), dy, *inputs)
    y_t, base = grads(lambda *t: theirs(*t, *([None] if norm == "rms" else [])), dy, *inputs)
    y_r, ref = grads(lambda *t: theirs(*t, *([None] if norm == "rms" else [])), dy.double(),
                     *(t.double() for t in inputs))
    assert_within_torch(y, y_t, y_r, name="y")
    for name, a, t, r in zip(("dx", "dweight", "dbias"), got, base, ref):
        assert_within_torch(a, t, r, name=name, sum_rows=M if name != "dx" else 1)


def test_overflowing_rows_as_the_docstrings_say():
    """The rows the docstrings of layer_norm and rms_norm quote: torch gives zeros or NaN
    (measured; this fails, and the docstrings need updating, if torch changes), normbook the
    finite answer float64 gives."""
    zeros_ln, nan_ln = torch.tensor([[3e19, 1.0, 2.0, 0.0]]), torch.tensor([[1e20, 2e20, 3e20, 4e20]])
    assert F.layer_norm(zeros_ln, (4,)).eq(0).all() and F.layer_norm(nan_ln, (4,)).isnan().all()
    assert F.rms_norm(nan_ln, (4,)).eq(0).all()
    for x in (zeros_ln, nan_ln):
        for ours, ref in ((normbook.layer_norm(x, 4), F.layer_norm(x.double(), (4,))),
                          (normbook.rms_norm(x, 4), F.rms_norm(x.double(), (4,)))):
            torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_forward_over_reverse_and_batched_gradients_like_torch(backend, device):
    """A tangent through the backward (forward-over-reverse: a dual input, then autograd.grad)
    and autograd's batched gradients (is_grads_batched) reach the gradients as torch's do on
    either backend: neither the kernels nor the in-place CPU backward can carry them, so the
    backward takes the formulas there, the statistics taken again from x."""
    import torch.autograd.forward_ad as fwAD

    if backend == "kernels" and importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(3)
    x, v, w, b = (torch.randn(*s, generator=g).to(device) for s in ((5, 16), (5, 16), (16,), (16,)))

    def fwd_over_rev(fn):
        with fwAD.dual_level():
            xd = fwAD.make_dual(x, v).requires_grad_(True)
            gx, = torch.autograd.grad(fn(xd, (16,), w, b).square().sum(), xd)
            return fwAD.unpack_dual(gx).tangent

    def batched(fn):
        xg = x.clone().requires_grad_(True)
        dys = torch.randn(3, 5, 16, generator=g).to(device)
        return torch.autograd.grad(fn(xg, (16,), w, b), xg, dys, is_grads_batched=True)[0]

    with normbook.backend(backend):
        got = fwd_over_rev(normbook.layer_norm)
        torch.testing.assert_close(got, fwd_over_rev(F.layer_norm), rtol=1e-4, atol=1e-4)
        state = g.get_state()
        got = batched(normbook.layer_norm)
        g.set_state(state)
        torch.testing.assert_close(got, batched(F.layer_norm), rtol=1e-5, atol=1e-5)


def test_zero_width_rows_train_like_torch():
    """D = 0 (an empty normalized shape) gives empty outputs and gradients, as torch does."""
    x = torch.randn(3, 0, requires_grad=True)
    w, b = torch.randn(0, requires_grad=True), torch.randn(0, requires_grad=True)
    normbook.layer_norm(x, 0, w, b).sum().backward()
    assert x.grad.shape == (3, 0) and w.grad.shape == (0,) and b.grad.shape == (0,)


def test_zero_width_rows_on_the_kernels_launch_nothing(kernels):
    """D = 0 on the kernel backend: nothing to compute, so no launch (one divided 0 by 0 for
    the statistics, which Triton's interpreter warned of: an error where warnings are); the
    custom op's statistics are torch's (mean 0, rstd NaN), and the gradients are empty."""
    import warnings

    x = torch.randn(3, 0, requires_grad=True)
    w, b = torch.randn(0, requires_grad=True), torch.randn(0, requires_grad=True)
    with warnings.catch_warnings(), normbook.backend("kernels"):
        warnings.simplefilter("error")
        normbook.layer_norm(x, 0, w, b).sum().backward()
        normbook.add_rms_norm(x, x.detach())[0].sum().backward()
        _, _, stats = torch.ops.normbook.norm_forward(x.detach(), None, None, None, 1e-5, False)
    assert x.grad.shape == (3, 0) and w.grad.shape == (0,) and b.grad.shape == (0,)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x.detach(), (0,), None, None, 1e-5)
    assert torch.equal(stats[0], mean.view(3)) and stats[1].isnan().all() and rstd.isnan().all()


def test_normalized_shape_of_a_float_does_not_depend_on_the_layout():
    """The door's short path (contiguous rows) and its checks (anything else) agree on a float
    normalized_shape equal to D: both refuse it, as torch does (they once both took it)."""
    x = torch.randn(2, 3, 8)
    for rows in (x, x.transpose(0, 1).contiguous().transpose(0, 1)):
        with pytest.raises(TypeError, match=r"whose element 0 is float 8.0"):
            normbook.layer_norm(rows, (8.0,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_module_s_parameters_take_the_paths_plain_tensors_take(norm, dtype):
    """On the torch backend a module's weight is a Parameter, in forward and (autograd hands a
    saved leaf back as itself) in backward: it takes the paths plain tensors take (torch's
    fused kernel where no graph records, the blocked backward), so a module and the function
    with the same values as plain tensors give the same bits both ways. (Parameters once took
    the written-out formulas instead: about a third of the fp32 values a unit apart, and a
    module's fp32 forward+backward at 2048 x 4096 six times the function's time.)"""
    g = torch.Generator().manual_seed(3)
    D = 512
    x = torch.randn(64, D, generator=g).to(dtype) * 2 + 1
    dy = torch.randn(64, D, generator=g).to(dtype)
    module = (normbook.LayerNorm if norm == "layer" else normbook.RMSNorm)(D, dtype=dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(D, generator=g))
    params = [p.detach().clone() for p in module.parameters()]

    def functional(x, *ps):
        if norm == "layer":
            return normbook.layer_norm(x, (D,), *ps)
        return normbook.rms_norm(x, (D,), *ps)

    with normbook.backend("torch"):
        with torch.no_grad():
            assert torch.equal(module(x), functional(x, *params))
        leaf = x.clone().requires_grad_()
        y = module(leaf)
        y.backward(dy)
        got = [leaf.grad, *(p.grad for p in module.parameters())]
        y_f, want = grads(functional, dy, x, *params)
    assert torch.equal(y, y_f)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- vmap under forward mode

def _four_norms():
    """(name, normbook's call, torch's composition) for the two norms and the two fused adds,
    each (x, r, w, b) -> y or (y, h)."""
    return [
        ("layer_norm", lambda x, r, w, b: normbook.layer_norm(x, (8,), w, b),
         lambda x, r, w, b: F.layer_norm(x, (8,), w, b)),
        ("rms_norm", lambda x, r, w, b: normbook.rms_norm(x, (8,), w, 1e-5),
         lambda x, r, w, b: F.rms_norm(x, (8,), w, 1e-5)),
        ("add_layer_norm", lambda x, r, w, b: normbook.add_layer_norm(x, r, w, b),
         lambda x, r, w, b: (F.layer_norm(x + r, (8,), w, b), x + r)),
        ("add_rms_norm", lambda x, r, w, b: normbook.add_rms_norm(x, r, w, 1e-5),
         lambda x, r, w, b: (F.rms_norm(x + r, (8,), w, 1e-5), x + r)),
    ]


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("name", [n for n, _, _ in _four_norms()])
def test_forward_mode_over_vmap_like_torch(backend, name):
    """jvp(vmap(f)) and jacfwd(vmap(f)): torch's norms take them. The Function under torch.func
    raised a pytree ValueError there ("leaves has length 5 but the spec refers to a pytree
    that holds 10 items": the generated vmap rule's jvp flattened its tuple argument, cfg, to
    six leaves against one tangent), and, past that, an internal assert of torch's forward-mode
    AD on the None tangent of its statistics."""
    if backend == "kernels":
        pytest.importorskip("triton")
    from torch.func import jacfwd, jvp, vmap

    ours, theirs = next((o, t) for n, o, t in _four_norms() if n == name)
    torch.manual_seed(0)
    x, r, t = torch.randn(4, 3, 8), torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    w, b, tw = torch.randn(8), torch.randn(8), torch.randn(8)

    def over_x(f):
        return jvp(lambda a: vmap(f, in_dims=(0, 0, None, None))(a, r, w, b), (x,), (t,))

    def over_w(f):
        return jvp(lambda v: vmap(f, in_dims=(0, 0, None, None))(x, r, v, b), (w,), (tw,))

    def jac(f):
        return jacfwd(lambda a: vmap(f, in_dims=(0, 0, None, None))(a, r[:, :1], w, b))(x[:, :1])

    tol = dict(rtol=1e-5, atol=1e-5)
    with normbook.backend(backend):
        got = [over_x(ours), over_w(ours), jac(ours)]
    torch.testing.assert_close(got, [over_x(theirs), over_w(theirs), jac(theirs)], **tol)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_an_inference_tensor_under_torch_func_and_forward_ad(backend):
    """x made under torch.inference_mode, a weight that requires grad, differentiated by
    torch.func.grad (over a module's named_parameters) or carrying a tangent under forward-mode
    AD: torch.nn.RMSNorm takes both (its composed ops save only what they compute from x); the
    Function's apply on those routes, unlike the eager one, did not copy the inference tensor
    it has to save, and raised "Inference tensors cannot be saved for backward"."""
    if backend == "kernels":
        pytest.importorskip("triton")
    import torch.autograd.forward_ad as fwAD
    from torch.func import functional_call, grad

    with torch.inference_mode():
        xi = torch.randn(3, 8)
    ours, theirs = normbook.RMSNorm(8, eps=1e-5), torch.nn.RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(8))
        theirs.weight.copy_(ours.weight)

    def by_grad(m):
        return grad(lambda p: functional_call(m, p, (xi,)).sin().sum())(dict(m.named_parameters()))

    def by_tangent(m):
        with fwAD.dual_level():
            y = functional_call(m, {"weight": fwAD.make_dual(m.weight, torch.ones(8))}, (xi,))
            tangent = fwAD.unpack_dual(y).tangent
        return tangent, torch.autograd.grad(y.sum(), m.weight)[0]

    with normbook.backend(backend):
        got = [by_grad(ours), by_tangent(ours)]
    torch.testing.assert_close(got[0]["weight"], by_grad(theirs)["weight"])
    torch.testing.assert_close(got[1], by_tangent(theirs))


@pytest.mark.parametrize("recorded", [False, True])
def test_a_row_of_equal_values_gives_exactly_the_bias_in_float64(recorded):
    """Chapter 1's edge case, as torch's fused kernel gives it: a row of equal values is
    centred to exactly zero, so y is exactly the bias. The plain float64 mean of 3.7 three
    times is not 3.7, and y was -1.4e-13 (a quarter of such rows, D 2..40); with autograd
    recording too (the formulas' path)."""
    weight = torch.randn(7, dtype=torch.float64)
    for D in range(2, 60):
        for c in (3.7, 0.1, 1 / 3, 2.2, 5.9, 123.456, -7.3):
            x = torch.full((2, D), c, dtype=torch.float64, requires_grad=recorded)
            bias = torch.randn(D, dtype=torch.float64)
            y = normbook.layer_norm(x, (D,), weight.repeat(9)[:D], bias)
            assert torch.equal(y.detach(), bias.expand(2, D)), (D, c)
            assert torch.equal(torch.nn.functional.layer_norm(x, (D,), None, bias).detach(),
                               bias.expand(2, D))
