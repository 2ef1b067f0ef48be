"""The CPU path (normbook.layer_norm / rms_norm and the modules on CPU tensors) under torch's
compilers and tracers, as a user's model meets them: torch.compile (aot_eager, fullgraph, and
the default inductor backend), torch.export, meta tensors and fake tensors. Each gives eager's
numbers, forward and backward, for both norms, modules and functions.

(The kernel path under torch.compile is tested in test_kernels_ops.py.)
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import normbook

pytestmark = pytest.mark.slow   # torch.compile, inductor's C++ included


def _cases(dtype):
    """(name, callable, its parameters) for the two modules and the two functions."""
    ln = normbook.LayerNorm(8, dtype=dtype)
    rms = normbook.RMSNorm(8, dtype=dtype)
    with torch.no_grad():                 # parameters away from 1 and 0, so their grads count
        for p in (*ln.parameters(), *rms.parameters()):
            p.copy_(torch.randn_like(p))
    w, b = ln.weight.detach().clone().requires_grad_(), ln.bias.detach().clone().requires_grad_()
    return [("LayerNorm", ln, list(ln.parameters())), ("RMSNorm", rms, list(rms.parameters())),
            ("layer_norm", lambda t: normbook.layer_norm(t, (8,), w, b, 1e-5), [w, b]),
            ("rms_norm", lambda t: normbook.rms_norm(t, 8, w), [w])]


def _run(fn, x, params, dy):
    """y and the gradients of x and the parameters, for an upstream gradient dy."""
    x = x.detach().clone().requires_grad_()
    for p in params:
        p.grad = None
    y = fn(x)
    y.backward(dy)
    return [y.detach(), x.grad, *(p.grad for p in params)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compile_aot_eager_fullgraph_matches_eager(dtype):
    """aot_eager traces the Function's forward and hand-derived backward into graphs and runs
    them op by op: the same ops as eager, so the same numbers (to the last few ulps, since the
    traced graph may fuse a cast). Dynamic shapes too: a second batch size reuses the graph."""
    torch.manual_seed(0)
    for name, fn, params in _cases(dtype):
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
        for rows in (3, 5):
            x = torch.randn(2, rows, 8, dtype=dtype) * 3 + 1
            dy = torch.randn_like(x)
            for got, want in zip(_run(compiled, x, params, dy), _run(fn, x, params, dy)):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-14,
                                           msg=lambda m: f"{name}, {rows} rows: {m}")


@pytest.mark.parametrize("name", ["LayerNorm", "rms_norm"])
def test_compile_default_backend_matches_eager(name):
    """The default backend (inductor, which generates C++ here) on a norm of each kind: eager's
    numbers within fp32 rounding of a reordered sum. Also the overflow rescue, which is traced
    as a per-row select instead of a branch on the data."""
    torch.manual_seed(1)
    fn, params = next((f, p) for n, f, p in _cases(torch.float32) if n == name)
    x = torch.randn(4, 8) * 2
    x[1] *= 1e20                                     # squares overflow fp32: the rescued row
    dy = torch.randn_like(x)
    compiled = torch.compile(fn, fullgraph=True)
    got, want = _run(compiled, x, params, dy), _run(fn, x, params, dy)
    assert torch.isfinite(got[0]).all() and got[0][1].abs().max() > 0.1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_double_backward_under_compile_is_refused_or_right():
    """A gradient penalty through a compiled norm: torch.compile does not trace double
    backward; whatever it does must not be a silently wrong number."""
    torch.manual_seed(2)
    fn = lambda t: normbook.layer_norm(t, (8,))              # noqa: E731
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(fn(x).pow(2).sum(), x, create_graph=True)
    (want,) = torch.autograd.grad(g.pow(2).sum(), x)
    x2 = x.detach().clone().requires_grad_()
    try:
        (g2,) = torch.autograd.grad(torch.compile(fn, backend="aot_eager")(x2).pow(2).sum(), x2,
                                    create_graph=True)
        (got,) = torch.autograd.grad(g2.pow(2).sum(), x2)
    except RuntimeError as e:                                # torch's refusal is an answer too
        assert "double backward" in str(e).lower() or "create_graph" in str(e).lower(), e
    else:
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("cls", [normbook.LayerNorm, normbook.RMSNorm])
def test_export_runs_and_matches_eager(cls):
    """torch.export traces the module without a guard on data (the overflow rescue is a
    select); the exported program computes eager's numbers, at another batch size too."""
    torch.manual_seed(3)
    m = cls(8)
    batch = torch.export.Dim("batch")
    ep = torch.export.export(m, (torch.randn(3, 8),), dynamic_shapes=({0: batch},))
    for rows in (3, 6):
        x = torch.randn(rows, 8) * 2
        x[0] *= 1e20
        torch.testing.assert_close(ep.module()(x), m(x), rtol=1e-6, atol=1e-6)


class _AddNorms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.rms = normbook.LayerNorm(8), normbook.RMSNorm(8)

    def forward(self, x, r):
        y, h = normbook.add_rms_norm(self.ln(x), r, self.rms.weight)
        return y, self.rms(h)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_graph_computes_nothing_it_discards(strict, dtype):
    """On the torch backend torch.export records the norms' formulas without the Function, whose
    backward no exported program keeps: the graph holds no statistics saved for it, and no
    torch.promote_types calls (an aten op, recorded as a node by non-strict export), so every
    node's result is used; and the program trains as eager does. (Strict export used to record
    the Function's forward with grad mode off: its outputs had no gradient.)"""
    torch.manual_seed(0)
    m = _AddNorms().to(dtype)
    x, r = torch.randn(3, 8, dtype=dtype), torch.randn(3, 8, dtype=dtype)
    ep = torch.export.export(m, (x, r), strict=strict)
    unused = [str(n.target) for n in ep.graph.nodes if n.op == "call_function" and not n.users
              and not str(n.target).startswith("aten._assert")]   # (export's own checks of .to())
    assert not unused, unused
    em = ep.module()
    xs = [x.clone().requires_grad_() for _ in range(2)]
    got = torch.autograd.grad(sum(t.float().pow(2).sum() for t in em(xs[0], r)),
                              [xs[0], *em.parameters()])
    want = torch.autograd.grad(sum(t.float().pow(2).sum() for t in m(xs[1], r)),
                               [xs[1], *m.parameters()])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cls", [normbook.LayerNorm, normbook.RMSNorm])
def test_meta_tensors_give_shapes_forward_and_backward(cls):
    """A model built on the meta device (how large models are initialised) runs forward and
    backward, giving meta tensors of the right shapes and dtypes."""
    m = cls((4, 8), device="meta", dtype=torch.bfloat16)
    x = torch.empty(2, 3, 4, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = m(x)
    assert y.is_meta and y.shape == x.shape and y.dtype == torch.bfloat16
    y.sum().backward()
    assert x.grad.is_meta and x.grad.shape == x.shape
    assert m.weight.grad.is_meta and m.weight.grad.shape == (4, 8)


def test_fake_tensors_give_shapes():
    """Under FakeTensorMode (what tracers and shape propagation use) both functions run."""
    with FakeTensorMode():
        x = torch.empty(5, 16, requires_grad=True)
        w = torch.empty(16, requires_grad=True)
        for y in (normbook.layer_norm(x, (16,), w, w), normbook.rms_norm(x, (16,), w)):
            assert y.shape == (5, 16)
            (dx,) = torch.autograd.grad(y.sum(), x)
            assert dx.shape == (5, 16)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_fused_add_of_a_tensor_to_itself_compiles_whole(backend, request):
    """add_*(a, a, ...): h = 2a. The door hands the Function a view of a as the residual, so
    that Dynamo is not given one tensor for two inputs (it refused: "duplicate tensor input");
    fullgraph, no graph break, and eager's composition's numbers, forward and backward."""
    if backend == "kernels":
        request.getfixturevalue("kernels")
    torch.manual_seed(0)
    a = torch.randn(4, 16, requires_grad=True)
    w, b = torch.rand(16, requires_grad=True), torch.randn(16, requires_grad=True)
    calls = {"add_rms_norm": (lambda a, w, b: normbook.add_rms_norm(a, a, w),
                              lambda h, w, b: torch.nn.functional.rms_norm(h, (16,), w)),
             "add_layer_norm": (lambda a, w, b: normbook.add_layer_norm(a, a, w, b),
                                lambda h, w, b: torch.nn.functional.layer_norm(h, (16,), w, b))}
    with normbook.backend(backend):
        for name, (fused, composed) in calls.items():
            torch._dynamo.reset()
            assert torch._dynamo.explain(fused)(a, w, b).graph_break_count == 0, name
            y, h = torch.compile(fused, backend="aot_eager", fullgraph=True)(a, w, b)
            got = torch.autograd.grad((y * y).sum() + h.sum(), (a, w, b), allow_unused=True)
            h2 = a + a
            y2 = composed(h2, w, b)
            want = torch.autograd.grad((y2 * y2).sum() + h2.sum(), (a, w, b), allow_unused=True)
            torch.testing.assert_close(y, y2, msg=name)
            for g, g2 in zip(got, want):
                torch.testing.assert_close(g, g2, msg=name)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_one_tensor_in_two_places_compiles_whole(backend, request):
    """The weight passed as the bias too, or x as the weight: the door hands the Function a
    view the second time, so that Dynamo is not given one tensor for two inputs (fullgraph
    refused: "duplicate tensor input"); eager's numbers and gradients."""
    if backend == "kernels":
        request.getfixturevalue("kernels")
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    calls = {"weight as bias": lambda x, w: normbook.layer_norm(x, (8,), w, w),
             "w as x and weight": lambda x, w: normbook.rms_norm(w, 8, w),
             "x as residual, w as weight and bias": lambda x, w: normbook.add_layer_norm(
                 x, x, w, w)[0],
             "w everywhere": lambda x, w: normbook.add_rms_norm(w, w, w)[0]}
    with normbook.backend(backend):
        for name, f in calls.items():
            w = torch.randn(8, requires_grad=True)
            torch._dynamo.reset()
            y = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w)
            (got,) = torch.autograd.grad(y.pow(2).sum(), w)
            y2 = f(x, w)
            (want,) = torch.autograd.grad(y2.pow(2).sum(), w)
            torch.testing.assert_close(y, y2, msg=name)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("cls", [normbook.LayerNorm, normbook.RMSNorm])
def test_norm_over_several_dims_compiles_whole(cls, backend, request):
    """normalized_shape of two dims under fullgraph: the door's test for a traced size read
    torch._C._is_tracing, which Dynamo cannot trace (an error under fullgraph, a graph break
    without it); torch's modules compile whole, and so do these, with eager's numbers."""
    if backend == "kernels":
        request.getfixturevalue("kernels")
    torch.manual_seed(0)
    m = cls((3, 16))
    x = torch.randn(4, 3, 16)
    with normbook.backend(backend):
        torch._dynamo.reset()
        assert torch._dynamo.explain(m)(x).graph_break_count == 0
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(m, backend="aot_eager", fullgraph=True)(x), m(x))


@pytest.mark.parametrize("cls", [normbook.LayerNorm, normbook.RMSNorm])
def test_a_module_compiles_whole_past_the_calls_it_keeps(cls):
    """A module keeps the calls it launched in eager mode (functional._module_norm: C++
    guards and compiled kernels, which Dynamo cannot trace). Compiled, its forward must not
    read them: with one planted for the input's shape (an object that fails if touched), the
    module compiles whole, with eager's numbers."""
    torch.manual_seed(0)
    m = cls(16)
    x = torch.randn(4, 16)

    class Untouchable:
        def __iter__(self):
            raise AssertionError("a kept call was read under torch.compile")

    m.__dict__["_normbook_calls"] = {x.shape: Untouchable()}
    torch._dynamo.reset()
    assert torch._dynamo.explain(m)(x).graph_break_count == 0
    torch._dynamo.reset()
    y = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
    del m.__dict__["_normbook_calls"]
    torch.testing.assert_close(y, m(x))


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_round_xhat_of_half_rows_compiles_whole(backend, request):
    """rms_norm's round_xhat on bf16 rows (Llama's order, what swap.py gives its norms)
    compiles with fullgraph, no graph break, with eager's numbers: the fused path's test
    reads nothing Dynamo cannot trace (a negative-view test placed before the tracers' once
    broke it)."""
    if backend == "kernels":
        request.getfixturevalue("kernels")
    torch.manual_seed(0)
    m = normbook.RMSNorm(64, dtype=torch.bfloat16, round_xhat=True)
    x = torch.randn(4, 64).bfloat16()
    with normbook.backend(backend):
        torch._dynamo.reset()
        assert torch._dynamo.explain(m)(x).graph_break_count == 0
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(m, backend="aot_eager", fullgraph=True)(x), m(x))


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("shape", [(0, 5, 16), (5, 0, 16), (3, 0), (2, 3, 0)], ids=str)
def test_empty_inputs_compile_and_export_as_eager_runs_them(shape, backend, request):
    """An empty batch of several leading dims, (0, 5, 16), made the kernels' custom op view
    its statistics as (-1, 0, 5), which is ambiguous, and rows of D = 0 made the torch
    backend's traced rstd take amax over an empty dim: both raised under torch.compile and
    torch.export where eager gives an empty result. Now the compiled and exported programs
    give eager's shapes, and the compiled backward runs."""
    if backend == "kernels":
        request.getfixturevalue("kernels")
    D = shape[-1]
    fns = [lambda x: normbook.layer_norm(x, D), lambda x: normbook.rms_norm(x, D),
           lambda x: normbook.add_rms_norm(x, x.detach() + 1)[0]]
    with normbook.backend(backend):
        for fn in fns:
            x = torch.randn(shape, requires_grad=True)
            want = fn(x)
            got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
            assert got.shape == want.shape
            got.sum().backward()
            assert x.grad.shape == x.shape

        class Norm(torch.nn.Module):
            def forward(self, x):
                return normbook.rms_norm(x, D)

        x = torch.randn(shape)
        program = torch.export.export(Norm(), (x,))
        assert program.module()(x).shape == x.shape
        assert program.run_decompositions().module()(x).shape == x.shape
