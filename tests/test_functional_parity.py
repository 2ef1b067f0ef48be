"""Drop-in means every transform, dtype default and edge a torch user relies on.

Three parts:
- torch's own OpInfo sample inputs of ``nn.functional.layer_norm`` and ``nn.functional.rms_norm``
  (``op_db``; torch lists no skips for either) through normbook's CPU path: forward in every
  CPU dtype torch supports, gradients, gradgradcheck, forward AD with batched gradients, and
  vmap; and through the kernel path (Triton's interpreter) in fp32: forward, gradients, double
  backward, jvp and vmap, each against torch's own answer.
- torch.func (vmap, grad, jacrev, jacfwd, jvp, hessian) on both paths, and the gradient
  penalty that used to be silently wrong.
- one test per row of issue 10's table: the RMSNorm eps default, fp32 accuracy at large D,
  overflowing rows, D = 0, eps as a tensor or negative, the fused adds without parameters,
  TorchScript, nested jagged tensors, float8.
"""

from __future__ import annotations

import importlib.util
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck, gradgradcheck

import normbook
from normbook import reference

pytest.importorskip("expecttest")   # torch.testing._internal imports it
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

OPS = {o.name: o for o in op_db if o.name in ("nn.functional.layer_norm", "nn.functional.rms_norm")}
OURS = {"nn.functional.layer_norm": normbook.layer_norm, "nn.functional.rms_norm": normbook.rms_norm}
TORCH = {"nn.functional.layer_norm": F.layer_norm, "nn.functional.rms_norm": F.rms_norm}


def samples(name, dtype, requires_grad=False):
    op = OPS[name]
    out = list(op.sample_inputs("cpu", dtype, requires_grad=requires_grad))
    if op.reference_inputs_func is not None:
        out += list(op.reference_inputs("cpu", dtype, requires_grad=requires_grad))
    return out


def call(fn, s, *override):
    """fn(sample.input, *sample.args, **sample.kwargs), with the tensors replaced by override."""
    args = [s.input, *s.args]
    if override:
        it = iter(override)
        args = [next(it) if isinstance(a, torch.Tensor) else a for a in args]
    return fn(*args, **s.kwargs)


def tensors(s):
    return [a for a in (s.input, *s.args) if isinstance(a, torch.Tensor)]


def test_opinfo_has_the_two_ops_and_no_skips():
    assert set(OPS) == set(OURS)
    for op in OPS.values():
        assert not op.skips, f"{op.name}: torch skips {op.skips}; mirror them here"


# ---------------------------------------------------------------- the CPU path, torch's samples

@pytest.mark.parametrize("name", sorted(OPS))
def test_opinfo_forward_every_cpu_dtype(name):
    """Every real floating dtype torch supports. torch's rms_norm also takes complex inputs;
    normbook, a book about real-valued norms, refuses them with a clear error (checked)."""
    dtypes = sorted(OPS[name].supported_dtypes("cpu"), key=str)
    assert torch.float64 in dtypes and torch.bfloat16 in dtypes
    for dtype in [d for d in dtypes if d.is_complex]:
        with pytest.raises(TypeError, match=f"input: .*got {dtype}"):
            call(OURS[name], samples(name, dtype)[0])
    for dtype in [d for d in dtypes if not d.is_complex]:
        for s in samples(name, dtype):
            torch.testing.assert_close(call(OURS[name], s), call(TORCH[name], s), equal_nan=True,
                                       msg=lambda m: f"{dtype} {s}: {m}")


@pytest.mark.parametrize("name", sorted(OPS))
def test_opinfo_grads_gradgrad_forward_ad(name):
    for s in samples(name, torch.float64, requires_grad=True):
        ins = tensors(s)
        y, y_t = call(OURS[name], s), call(TORCH[name], s)
        if not torch.isfinite(y_t).all():   # a negative eps can make var + eps < 0: NaN in both
            assert torch.equal(y.isnan(), y_t.isnan())
            continue
        dy = torch.randn_like(y)
        g = torch.autograd.grad(y, ins, dy, allow_unused=True)
        g_t = torch.autograd.grad(y_t, ins, dy, allow_unused=True)
        for a, e in zip(g, g_t):
            torch.testing.assert_close(a, e)
        fn = lambda *t: call(OURS[name], s, *t)  # noqa: E731
        assert gradcheck(fn, ins, check_forward_ad=True, check_batched_grad=True,
                         check_batched_forward_grad=True)
        assert gradgradcheck(fn, ins, check_fwd_over_rev=True, check_batched_grad=True)


@pytest.mark.parametrize("name", sorted(OPS))
def test_opinfo_vmap(name):
    for s in samples(name, torch.float64):
        x = torch.stack([s.input, 2 * s.input + 1])                  # a batch of two inputs
        ours = torch.func.vmap(lambda t: call(OURS[name], s, t, *tensors(s)[1:]))(x)
        theirs = torch.func.vmap(lambda t: call(TORCH[name], s, t, *tensors(s)[1:]))(x)
        torch.testing.assert_close(ours, theirs, equal_nan=True)


@pytest.mark.parametrize("name", sorted(OPS))
def test_opinfo_samples_through_the_kernels(name):
    """The same samples through normbook.kernels (the interpreter here, compiled on a GPU) in
    fp32: forward, gradients, and double backward (a gradient penalty) against torch's."""
    K = pytest.importorskip("normbook.kernels")
    if not (K.ops.interpreted() or torch.cuda.is_available()):
        pytest.skip("the kernels need a GPU or TRITON_INTERPRET=1")
    fn = K.layer_norm if name.endswith("layer_norm") else K.rms_norm
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tol = dict(rtol=1e-4, atol=1e-4)    # fp32, other summation orders: a few ulps
    for s in samples(name, torch.float32, requires_grad=True):
        s = s.transform(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t)
        ins = tensors(s)
        for t in ins:
            t.requires_grad_(True)
        y, y_t = call(fn, s), call(TORCH[name], s)
        torch.testing.assert_close(y, y_t, equal_nan=True, **tol)
        if not torch.isfinite(y_t).all() or y.numel() == 0:
            continue
        dy = torch.randn_like(y)
        gs = torch.autograd.grad(y, ins, dy, create_graph=True)
        gs_t = torch.autograd.grad(y_t, ins, dy, create_graph=True)
        for a, e in zip(gs, gs_t):
            torch.testing.assert_close(a, e, **tol)
        gg = torch.autograd.grad(sum(g.square().sum() for g in gs), ins, materialize_grads=True)
        gg_t = torch.autograd.grad(sum(g.square().sum() for g in gs_t), ins, materialize_grads=True)
        for a, e in zip(gg, gg_t):
            torch.testing.assert_close(a, e, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------- torch.func on both paths

def _paths():
    paths = [("cpu", normbook.layer_norm, normbook.rms_norm)]
    try:
        import normbook.kernels as K

        if K.ops.interpreted() or torch.cuda.is_available():
            paths.append(("kernels", K.layer_norm, K.rms_norm))
    except ImportError:
        pass
    return paths


@pytest.mark.parametrize("path", [p[0] for p in _paths()])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_torch_func_transforms(path, norm):
    _, ln, rms = dict((p[0], p) for p in _paths())[path]
    dev = "cuda" if path == "kernels" and torch.cuda.is_available() else "cpu"
    dt = torch.float64 if path == "cpu" else torch.float32
    tol = {} if dt == torch.float64 else dict(rtol=1e-4, atol=1e-4)   # fp32: a few ulps
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g, dtype=dt).to(dev) for s in ((3, 8), (8,), (8,)))
    if norm == "layer":
        f, ft, args = (lambda x, w, b: ln(x, (8,), w, b)), (lambda x, w, b: F.layer_norm(x, (8,), w, b)), (x, w, b)
    else:
        f, ft, args = (lambda x, w: rms(x, (8,), w, 1e-5)), (lambda x, w: F.rms_norm(x, (8,), w, 1e-5)), (x, w)

    def scalar(fn):
        return lambda *a: fn(*a).sin().sum()

    for tr in (torch.func.jacrev, torch.func.jacfwd):
        torch.testing.assert_close(tr(f, argnums=tuple(range(len(args))))(*args),
                                   tr(ft, argnums=tuple(range(len(args))))(*args), **tol)
    for tr in (torch.func.grad, torch.func.hessian):
        torch.testing.assert_close(tr(scalar(f))(*args), tr(scalar(ft))(*args), **tol)
    tangents = tuple(torch.randn_like(a) for a in args)
    torch.testing.assert_close(torch.func.jvp(f, args, tangents), torch.func.jvp(ft, args, tangents), **tol)
    xs = torch.stack([x, x.flip(0)])                              # vmap over inputs ...
    torch.testing.assert_close(torch.func.vmap(f, in_dims=(0,) + (None,) * (len(args) - 1))(xs, *args[1:]),
                               torch.func.vmap(ft, in_dims=(0,) + (None,) * (len(args) - 1))(xs, *args[1:]), **tol)
    ws = torch.stack([w, 2 * w])                                  # ... and over per-sample weights
    torch.testing.assert_close(torch.func.vmap(lambda w: f(x, w, *args[2:]))(ws),
                               torch.func.vmap(lambda w: ft(x, w, *args[2:]))(ws), **tol)


@pytest.mark.parametrize("path", [p[0] for p in _paths()])
def test_gradient_penalty_matches_torch(path):
    """Linear -> LayerNorm -> weighted sum, with a penalty on the input gradient: needs the
    backward to be differentiable (it once gave a wrong Linear gradient and no bias gradient)."""
    ln = dict((p[0], p) for p in _paths())[path][1]
    dev = "cuda" if path == "kernels" and torch.cuda.is_available() else "cpu"
    dt = torch.float64 if path == "cpu" else torch.float32
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 8).to(dev, dt)
    w, b = torch.randn(8, dtype=dt, device=dev, requires_grad=True), torch.randn(8, dtype=dt, device=dev, requires_grad=True)
    c = torch.randn(8, dtype=dt, device=dev)
    x = torch.randn(5, 6, dtype=dt, device=dev, requires_grad=True)

    def penalized(norm):
        out = (norm(lin(x), (8,), w, b) * c).sum()
        (gx,) = torch.autograd.grad(out, x, create_graph=True)
        return torch.autograd.grad(out + gx.square().sum(), [lin.weight, lin.bias, w, b, x])

    for a, e in zip(penalized(ln), penalized(F.layer_norm)):
        torch.testing.assert_close(a, e, **({} if dt == torch.float64 else dict(rtol=1e-4, atol=1e-4)))


# ---------------------------------------------------------------- the table's rows

@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16]), scale=st.floats(1e-4, 1e2),
       D=st.integers(1, 300))
def test_rms_norm_default_eps_is_fp32s_like_torch(dtype, scale, D):
    """eps=None: torch uses fp32's machine epsilon for half inputs (its op-math type), not the
    input dtype's; normbook matches it bitwise."""
    g = torch.Generator().manual_seed(D)
    x = (scale * torch.randn(4, D, generator=g)).to(dtype)
    w = torch.randn(D, generator=g).to(dtype)
    assert torch.equal(normbook.rms_norm(x, D, w), F.rms_norm(x, (D,), w))
    assert normbook.RMSNorm(D, dtype=dtype)(x).dtype == dtype


@pytest.mark.parametrize("D", [4096, 65536, 262144])
def test_fp32_accuracy_does_not_grow_with_D(D):
    """Within twice torch's error plus 2 ulp of the output, forward and dx, at any D."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, D, generator=g) * 3 + 1
    w, b, dy = torch.randn(D, generator=g), torch.randn(D, generator=g), torch.randn(2, D, generator=g)
    y64, mean, rstd = reference.layer_norm_forward(x.double(), w.double(), b.double(), 1e-5)
    dx64 = reference.layer_norm_backward(dy.double(), x.double(), w.double(), mean, rstd)[0]
    results = {}
    for name, fn in (("ours", normbook.layer_norm), ("torch", F.layer_norm)):
        xl = x.clone().requires_grad_(True)
        y = fn(xl, (D,), w, b, 1e-5)
        (dx,) = torch.autograd.grad(y, xl, dy)
        results[name] = ((y.double() - y64).abs().max().item(), (dx.double() - dx64).abs().max().item())
    ulp = torch.finfo(torch.float32).eps
    for k, ref in enumerate((y64, dx64)):
        allow = 2 * results["torch"][k] + 2 * ulp * ref.abs().max().item()
        assert results["ours"][k] <= allow, (D, k, results)


@settings(max_examples=20, deadline=None)
@given(exponent=st.integers(19, 36), D=st.integers(2, 200), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_overflowing_rows_give_the_exact_finite_answer(exponent, D, dtype):
    """|x| around 10^exponent: x^2 overflows fp32, torch returns NaN; normbook the right answer
    (never the silent zeros it once gave), and finite gradients. "Right": within twice the error
    that torch makes on the same rows scaled down by an exact power of two (where nothing
    overflows and eps, here negligible, is set to 0), plus 2 ulp, against float64."""
    g = torch.Generator().manual_seed(exponent * 1000 + D)
    x = (torch.randn(3, D, generator=g) * 10.0 ** exponent).to(dtype).clamp(-3e38, 3e38)
    down = torch.ldexp(x, torch.tensor(-100))                    # exact: a power of two
    for ours, theirs, ref in (
            (lambda t: normbook.layer_norm(t, D), lambda t: F.layer_norm(t, (D,), eps=0.0),
             lambda t: reference.layer_norm_forward(t, None, None, 0.0)[0]),
            (lambda t: normbook.rms_norm(t, D, eps=1e-5), lambda t: F.rms_norm(t, (D,), eps=0.0),
             lambda t: reference.rms_norm_forward(t, None, 0.0)[0])):
        y64 = ref(x.double())
        xl = x.clone().requires_grad_(True)
        y = ours(xl)
        err = (y.double() - y64).abs().max().item()
        err_torch = (theirs(down).double() - y64).abs().max().item()
        assert err <= 2 * err_torch + 2 * torch.finfo(dtype).eps * y64.abs().max().item(), (err, err_torch)
        (dx,) = torch.autograd.grad(y, xl, torch.ones_like(y))
        assert torch.isfinite(dx).all()


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_eps_zero_on_a_constant_row_is_torchs_nan_on_both_backends(backend, kernels, device):
    """var + eps = 0 exactly: rstd = inf and (x - mean) * rstd = 0 * inf, NaN in torch. The
    kernels once raised 0 to the smallest normal float and gave 0; one input, one answer. A
    row with a subnormal variance (not 0) keeps a finite answer (tests/test_kernels_gpu.py)."""
    rows = torch.tensor([[3.0] * 16, [0.0] * 16, list(range(16))], device=device)
    with normbook.backend(backend):
        y_ln = normbook.layer_norm(rows, 16, eps=0.0)
        y_rms = normbook.rms_norm(rows, 16, eps=0.0)
    torch.testing.assert_close(y_ln, F.layer_norm(rows, (16,), eps=0.0), equal_nan=True)
    torch.testing.assert_close(y_rms, F.rms_norm(rows, (16,), eps=0.0), equal_nan=True)
    assert y_ln[:2].isnan().all() and y_rms[1].isnan().all() and y_ln[2].isfinite().all()


def test_an_eps_tensor_that_requires_grad_is_refused_as_torch_refuses_it():
    x = torch.randn(2, 4)
    eps = torch.tensor(1e-5, requires_grad=True)
    with pytest.raises(TypeError):
        F.layer_norm(x, (4,), eps=eps)
    for call in (lambda: normbook.layer_norm(x, 4, eps=eps), lambda: normbook.rms_norm(x, 4, eps=eps),
                 lambda: normbook.add_layer_norm(x, x, eps=eps), lambda: normbook.LayerNorm(4, eps=eps)(x)):
        with pytest.raises(TypeError, match="eps: .*requires grad"):
            call()
    assert torch.equal(normbook.layer_norm(x, 4, eps=eps.detach()), F.layer_norm(x, (4,), eps=1e-5))


def test_empty_normalized_shape_gives_empty_result():
    x = torch.randn(3, 0, requires_grad=True)
    for fn, ft in ((normbook.layer_norm, F.layer_norm), (normbook.rms_norm, F.rms_norm)):
        y = fn(x, (0,))
        assert y.shape == ft(x, (0,)).shape == (3, 0)
        y.sum().backward()
        assert x.grad.shape == (3, 0)


@pytest.mark.parametrize("eps", [torch.tensor(1e-3), torch.tensor(1e-3, dtype=torch.float64), -1e-3, 0.25])
def test_eps_as_tensor_or_negative_like_torch(eps):
    x = torch.randn(4, 16, dtype=torch.float64) * 3
    torch.testing.assert_close(normbook.layer_norm(x, 16, eps=eps), F.layer_norm(x, (16,), eps=eps))
    torch.testing.assert_close(normbook.rms_norm(x, 16, eps=eps), F.rms_norm(x, (16,), eps=eps))


def test_torch_jit_script_of_the_modules():
    for m in (normbook.LayerNorm(8), normbook.RMSNorm(8)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted = torch.jit.script(m)
        x = torch.randn(2, 8)
        torch.testing.assert_close(scripted(x), m(x))


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_torch_jit_trace_of_the_modules(backend, kernels, device):
    """A trace records torch's ops, not a Triton launch: under torch.jit.trace the door takes
    the torch backend (a traced kernel call would leave the graph an empty output), so the
    traced module computes the norm on inputs it was not traced with. The door's checks of the
    arguments raise no TracerWarning (they hold for the trace, as the tracer keeps them). The
    trace holds torch's ops only, no Python Function: it saves, loads and trains like torch's."""
    for m, ref in ((normbook.LayerNorm(8), torch.nn.LayerNorm(8)),
                   (normbook.RMSNorm(8), torch.nn.RMSNorm(8))):
        m, ref = m.to(device), ref.to(device)
        with normbook.backend(backend), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("error", torch.jit.TracerWarning)
            traced = torch.jit.trace(m, torch.randn(4, 8, device=device))
        x = torch.randn(6, 8, device=device)
        torch.testing.assert_close(traced(x), ref(x))
        assert "PythonOp" not in traced.graph.str()
        saved = io.BytesIO()
        torch.jit.save(traced, saved)
        saved.seek(0)
        loaded = torch.jit.load(saved, map_location=device)
        x = torch.randn(2, 3, 8, device=device, requires_grad=True)
        (dx,) = torch.autograd.grad(loaded(x).square().sum(), x)
        (dx_ref,) = torch.autograd.grad(ref(x).square().sum(), x)
        torch.testing.assert_close(dx, dx_ref)


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_torch_jit_trace_of_the_functions(backend, kernels, device):
    """The functions trace too, the fused adds included (their door reads x's last size, which
    the tracer gives as a tensor: it refused it as normalized_shape before), and a size taken
    from the input: each trace computes torch's result on inputs of another shape, without a
    TracerWarning. Over several dims the trace keeps this call's rank, and the tracer's
    warnings say so: they are not silenced. It keeps the rank only: another batch of that rank
    runs (the trace held aten's _unsafe_view and its sizes as constants; it failed on any other
    batch, and the TorchScript ONNX exporter refused _unsafe_view)."""
    w = torch.randn(8, device=device)
    calls = {
        "add_layer_norm": (lambda x, r: normbook.add_layer_norm(x, r, w),
                           lambda x, r: (F.layer_norm(x + r, (8,), w), x + r)),
        "add_rms_norm": (lambda x, r: normbook.add_rms_norm(x, r, w),
                         lambda x, r: (F.rms_norm(x + r, (8,), w), x + r)),
        "layer_norm": (lambda x, r: normbook.layer_norm(x, (x.size(-1),), w),
                       lambda x, r: F.layer_norm(x, (8,), w)),
    }
    example = (torch.randn(3, 8, device=device), torch.randn(3, 8, device=device))
    for name, (ours, theirs) in calls.items():
        with normbook.backend(backend), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("error", torch.jit.TracerWarning)
            traced = torch.jit.trace(ours, example)
        x, r = torch.randn(2, 5, 8, device=device), torch.randn(2, 5, 8, device=device)
        torch.testing.assert_close(traced(x, r), theirs(x, r), msg=name)
    for m, ref in ((normbook.LayerNorm((2, 8)), torch.nn.LayerNorm((2, 8))),
                   (normbook.RMSNorm((2, 8)), torch.nn.RMSNorm((2, 8)))):
        m, ref = m.to(device), ref.to(device)
        with normbook.backend(backend), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            traced = torch.jit.trace(m, torch.randn(3, 2, 8, device=device))
        assert any(w.category is torch.jit.TracerWarning for w in caught)
        assert "_unsafe_view" not in traced.graph.str()
        x = torch.randn(5, 2, 8, device=device)
        torch.testing.assert_close(traced(x), ref(x))
        traced = torch.jit.trace(lambda x: normbook.layer_norm(x, (2, 8)), x)
        torch.testing.assert_close(traced(x[:2]), F.layer_norm(x[:2], (2, 8)))


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_nested_jagged_tensors(norm):
    parts = [torch.randn(3, 8), torch.randn(5, 8)]
    x = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    if norm == "layer":
        y, e = normbook.layer_norm(x, (8,), w), F.layer_norm(x, (8,), w)
    else:
        y, e = normbook.rms_norm(x, (8,), w), F.rms_norm(x, (8,), w)
    assert y.is_nested and y.shape[0] == 2
    torch.testing.assert_close(y.values(), e.values())
    y.values().square().sum().backward()
    assert x.grad is not None and w.grad.shape == (8,)



def _backends():
    """The backends these CPU tensors can take: the kernels under Triton's interpreter only."""
    if importlib.util.find_spec("triton") is None:
        return ["torch"]
    import normbook.kernels as K

    return ["torch", "kernels"] if K.ops.interpreted() else ["torch"]


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_the_fused_adds_take_nested_tensors(norm, backend):
    """Jagged and strided nested tensors through add_layer_norm / add_rms_norm: y the norm of
    x + residual as torch's, h the sum. (On the kernel backend a jagged pair reached the
    custom op, which has no nested kernel: NotImplementedError.)"""
    if backend not in _backends():
        pytest.skip("the kernels need TRITON_INTERPRET=1 here")
    add = normbook.add_layer_norm if norm == "layer" else normbook.add_rms_norm
    plain = F.layer_norm if norm == "layer" else F.rms_norm
    eps = 1e-5 if norm == "layer" else torch.finfo(torch.float32).eps
    parts, others = [torch.randn(3, 8), torch.randn(5, 8)], [torch.randn(3, 8), torch.randn(5, 8)]
    for layout in (torch.jagged, torch.strided):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)    # the strided layout's prototype
            x = torch.nested.nested_tensor(parts, layout=layout, requires_grad=True)
            r = (torch.nested.nested_tensor(others, layout=layout) if layout == torch.strided
                 else torch.nested.nested_tensor_from_jagged(torch.cat(others), x.offsets()))
        with normbook.backend(backend):
            y, h = add(x, r)
        assert y.is_nested and h.is_nested, layout
        for yi, hi, a, b in zip(y.unbind(), h.unbind(), parts, others):
            torch.testing.assert_close(hi, a + b)
            torch.testing.assert_close(yi, plain(a + b, (8,), eps=eps), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_strided_nested_tensors_as_torch_s_layer_norm(backend):
    """torch.nested's default (strided) layout, which torch.nn.LayerNorm takes: normbook's
    functional and module gave a torch internal error ("NestedTensorImpl doesn't support
    sizes")."""
    if backend not in _backends():
        pytest.skip("the kernels need TRITON_INTERPRET=1 here")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        x = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)],
                                        requires_grad=True)
    w, b = torch.randn(8), torch.randn(8)
    ours, theirs = normbook.LayerNorm(8), torch.nn.LayerNorm(8)
    with normbook.backend(backend):
        got = [normbook.layer_norm(x, (8,), w, b), ours(x), normbook.rms_norm(x, 8)]
    want = [F.layer_norm(x, (8,), w, b), theirs(x)]
    want.append([F.rms_norm(t, (8,)) for t in x.unbind()])   # (torch's raises on the layout)
    for g, e in zip(got, want):
        assert g.is_nested
        for a, c in zip(g.unbind(), e if isinstance(e, list) else e.unbind()):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    got[1].backward(torch.nested.nested_tensor([torch.ones(3, 8), torch.ones(5, 8)]))
    assert x.grad is not None


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_parameters_and_plain_subclasses_are_rows_like_tensors(backend):
    """A Parameter of three dims (a module's learned tokens) and a subclass that only wraps
    results: on the kernel backend both were taken for a DTensor and reached the kernels as
    (B, T, D), which failed to unpack as (M, D); the fused adds on the torch backend added a
    (B, T, D) x to a flattened residual."""
    if backend not in _backends():
        pytest.skip("the kernels need TRITON_INTERPRET=1 here")

    class Wrapped(torch.Tensor):
        pass

    r = torch.randn(2, 3, 8)
    p = torch.nn.Parameter(torch.randn(2, 3, 8))
    for x in (p, p.detach().as_subclass(Wrapped)):
        with normbook.backend(backend):
            y1, y2 = normbook.layer_norm(x, 8), normbook.RMSNorm(8)(x)
            y3, h = normbook.add_rms_norm(x, r)
        torch.testing.assert_close(y1.as_subclass(torch.Tensor),
                                   F.layer_norm(x, (8,)).as_subclass(torch.Tensor),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y2.as_subclass(torch.Tensor),
                                   F.rms_norm(x, (8,)).as_subclass(torch.Tensor),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h.as_subclass(torch.Tensor),
                                   (x + r).as_subclass(torch.Tensor))
        torch.testing.assert_close(y3.as_subclass(torch.Tensor),
                                   F.rms_norm(x + r, (8,)).as_subclass(torch.Tensor),
                                   rtol=1e-5, atol=1e-5)
    with normbook.backend(backend):
        normbook.layer_norm(p, 8).sum().backward()
    assert p.grad is not None and p.grad.shape == p.shape

@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_is_refused_clearly(dtype):
    x = torch.randn(2, 4).to(dtype)
    with pytest.raises(NotImplementedError, match=r"input: float8 .*float8_e"):
        normbook.layer_norm(x, 4)
    with pytest.raises(NotImplementedError, match="input: float8"):
        normbook.RMSNorm(4)(x)


def test_fused_adds_take_no_parameters():
    """kernels.add_layer_norm(x, r) and add_rms_norm(x, r): weight and bias default to None."""
    K = pytest.importorskip("normbook.kernels")
    if not (K.ops.interpreted() or torch.cuda.is_available()):
        pytest.skip("the kernels need a GPU or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, r = torch.randn(3, 16, device=dev), torch.randn(3, 16, device=dev)
    y, s = K.add_layer_norm(x, r)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, F.layer_norm(x + r, (16,)), rtol=1e-5, atol=1e-5)
    y, s = K.add_rms_norm(x, r)
    torch.testing.assert_close(y, F.rms_norm(x + r, (16,)), rtol=1e-5, atol=1e-5)


# 20000: rows in registers at 32 warps (fp32 with the add: chunked); 40000: chunked both ways
@pytest.mark.parametrize("D", [64, 20000, 40000])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_kernel_overflowing_rows_are_finite_and_right(norm, D):
    """The kernels' rescue of overflowing rows, in registers and in the chunked path, with and
    without the fused residual add; a normal row in the same launch stays right."""
    K = pytest.importorskip("normbook.kernels")
    if not (K.ops.interpreted() or torch.cuda.is_available()):
        pytest.skip("the kernels need a GPU or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(D)
    x = torch.randn(3, D, generator=g) * 1e20
    x[1] /= 1e20                                                    # a normal row beside them
    r = torch.randn(3, D, generator=g) * 1e20
    w = torch.randn(D, generator=g)
    x, r, w = x.to(dev), r.to(dev), w.to(dev)
    if norm == "layer":
        run, ref = (lambda t: K.layer_norm(t, D, w)), (lambda t: reference.layer_norm_forward(t, w.double(), None, 1e-5)[0])
        y_add, s = K.add_layer_norm(x, r, w)
    else:
        run, ref = (lambda t: K.rms_norm(t, D, w, 1e-5)), (lambda t: reference.rms_norm_forward(t, w.double(), 1e-5)[0])
        y_add, s = K.add_rms_norm(x, r, w, 1e-5)
    y = run(x)
    # fp32 statistics over D values: a few ulps of the output, growing like sqrt(D) at worst
    tol = 8 * torch.finfo(torch.float32).eps * w.abs().max().item() * D ** 0.5
    assert (y.double() - ref(x.double())).abs().max().item() < tol
    assert (y_add.double() - ref(s.double())).abs().max().item() < tol
    assert torch.isfinite(y).all() and torch.isfinite(y_add).all()


@pytest.mark.parametrize("D", [4, 40000])
@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_a_row_holding_an_infinity_is_torch_s(backend, D):
    """A row holding an infinity is not an overflowing row to rescue: RMSNorm gives torch's
    NaN where the infinities are and 0 elsewhere (rstd = 0), LayerNorm NaN throughout, on
    both backends (the kernels' rows kernel at D = 4, the loop over the row at 40000), and
    the rows beside it are torch's. The rescue once divided the row by its largest |value|,
    an infinity, and gave NaN throughout."""
    if backend == "kernels":
        K = pytest.importorskip("normbook.kernels")
        if not (K.ops.interpreted() or torch.cuda.is_available()):
            pytest.skip("the kernels need a GPU or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() and backend == "kernels" else "cpu"
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(0)).to(dev)
    x[0, 1], x[2, 0], x[2, D - 1] = float("inf"), float("-inf"), float("inf")
    with normbook.backend(backend), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # the interpreter's numpy
        for ours, theirs in ((normbook.rms_norm(x, D), F.rms_norm(x, (D,))),
                             (normbook.layer_norm(x, D), F.layer_norm(x, (D,)))):
            assert torch.equal(ours.isnan(), theirs.isnan())
            torch.testing.assert_close(ours.nan_to_num(), theirs.nan_to_num())


def test_kernel_path_edges_like_torch():
    """D = 0, eps as a 0-d tensor and a negative eps through normbook.kernels as well."""
    K = pytest.importorskip("normbook.kernels")
    if not (K.ops.interpreted() or torch.cuda.is_available()):
        pytest.skip("the kernels need a GPU or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x0 = torch.randn(3, 0, device=dev, requires_grad=True)
    y0 = K.layer_norm(x0, (0,))
    y0.sum().backward()
    assert y0.shape == x0.grad.shape == (3, 0) and K.rms_norm(x0, 0).shape == (3, 0)
    x = 3 * torch.randn(4, 16, device=dev)
    for eps in (torch.tensor(1e-3), -1e-3):
        torch.testing.assert_close(K.layer_norm(x, 16, eps=eps), F.layer_norm(x, (16,), eps=eps),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(K.rms_norm(x, 16, eps=eps), F.rms_norm(x, (16,), eps=eps),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("D", [8, 1000, 20000])     # the rows kernel, and the loop kernel
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_a_tiny_row_at_eps_zero_is_normalized_accurately_on_the_kernels(norm, D, kernels, device):
    """Rows of size 1e-21 to 1e-30 with eps = 0: var is subnormal or underflows to 0 in fp32.
    The kernels raised var + eps to the smallest normal float, which shrank y by up to 99%
    (finite and wrong); they now take the sum again on the rows scaled by 2^64, exactly, and
    agree with float64 to fp32's rounding, where torch's own norm loses digits or gives inf."""
    torch.manual_seed(0)
    x = torch.cat([s * torch.randn(2, D) for s in (1e-19, 1e-21, 1e-30, 1.0)]).to(device)
    x.requires_grad_()
    dy = torch.randn_like(x)
    fn = getattr(normbook, norm)
    with normbook.backend("kernels"):
        y = fn(x, D, eps=0.0)
        dx, = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    y64 = getattr(F, norm)(x64, (D,), eps=0.0)
    dx64, = torch.autograd.grad(y64, x64, dy.double())
    bound = 64 * torch.finfo(torch.float32).eps
    assert (y.double() - y64).abs().max() < bound * y64.abs().max()
    # dx scales as 1 / |x|: relative to each row's largest
    rel = (dx.double() - dx64).abs().amax(-1) / dx64.abs().amax(-1)
    assert rel.max() < bound


@pytest.mark.parametrize("D", [16, 4096, 20000])    # the rows kernel, and the loop kernel
def test_rows_with_a_large_mean_are_centred_to_fp32s_rounding_on_the_kernels(D, kernels, device):
    """x = 1e4 + N(0, 1): the mean, summed in fp32, was off by about an ulp of 1e4, which
    shifted every xhat of its row (up to 10x torch's error, past the accuracy rule). The rows
    kernel now takes that rounding back from the centred row (the corrected two-pass mean),
    the loop kernel keeps its merged mean as a sum and its rounding error: y is within fp32's
    rounding of float64, which torch's own norm is not."""
    rows = 4 if D < 20000 else 2
    errs = []
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        x = (1e4 + torch.randn(rows, D, generator=g)).to(device)
        with normbook.backend("kernels"):
            y = normbook.layer_norm(x, D)
        y64 = F.layer_norm(x.double(), (D,))
        errs.append(float((y.double() - y64).abs().max() / y64.abs().max()))
    assert max(errs) < 8 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("D", [1024, 20000])        # the rows kernel, and the loop kernel
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_a_negative_eps_past_the_variance_is_torchs_nan_on_the_kernels(norm, D, kernels, device):
    """var + eps < 0 (eps = -0.5, var about 0.01): torch's NaN. The tiny-row rescue once took
    every row with var + eps below 2^-100, negative ones too, and its scaled squares overflowed
    to rstd = 0: y = 0 where torch gives NaN. It takes only rows whose variance is tiny."""
    g = torch.Generator().manual_seed(0)
    x = (0.1 * torch.randn(2, D, generator=g)).to(device)
    with normbook.backend("kernels"):
        y = getattr(normbook, norm)(x, D, eps=-0.5)
    assert getattr(F, norm)(x, (D,), eps=-0.5).isnan().all() and y.isnan().all()
