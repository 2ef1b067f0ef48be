"""normbook.kernels as an API: custom ops under torch.compile, argument errors, the interpreter
switch, and (marked gpu, skipped without CUDA) larger shapes and dispatch on a device."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import normbook  # noqa: E402
import normbook.kernels as K  # noqa: E402
from helpers import DEVICE, EPS, make  # noqa: E402


def _python(code: str, **env) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (triton's interpreter switch is read at import)."""
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)


# ----------------------------------------------------------------------------- torch.compile

class Block(torch.nn.Module):
    """A pre-norm residual block in miniature, using all four public functions."""

    def __init__(self, D):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(D))
        self.b = torch.nn.Parameter(0.1 * torch.randn(D))

    def forward(self, x, residual):
        y, s = K.add_layer_norm(x, residual, self.w, self.b, EPS)
        h = K.layer_norm(self.proj(y), (y.shape[-1],), self.w, None, EPS)
        z, s2 = K.add_rms_norm(h, s, self.w, EPS)
        return K.rms_norm(z, (z.shape[-1],), None) + s2


def test_torch_compile_fullgraph_matches_eager():
    """The two routes agree: eager runs the launchers, torch.compile the custom ops (fullgraph=True
    raises on any graph break, so passing means the custom ops traced whole)."""
    torch.manual_seed(0)
    block = Block(48).to(DEVICE)
    x = torch.randn(2, 5, 48, device=DEVICE, requires_grad=True)
    r = torch.randn(2, 5, 48, device=DEVICE, requires_grad=True)
    # fp32; the compiled Linear may sum in another order: a few ulps
    for a, e in zip(*_compiled_and_eager(block, x, r)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def _compiled_and_eager(block, x, r, steps=1, **options):
    """The block's output and the gradients of x, r and its weight, compiled with ``options``
    and fullgraph (the last of ``steps`` steps), then eager."""
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, **options)
    results = []
    for fn in (compiled, block):
        for _ in range(steps if fn is compiled else 1):
            x.grad = r.grad = block.w.grad = None
            out = fn(x, r)
            out.square().sum().backward()
        results.append([out.detach(), x.grad, r.grad, block.w.grad])
    return results


def _entry_points(D):
    """(name, fn(x, r) -> a tensor to differentiate, parameters) for every public entry point:
    the two modules, the two functions and the two fused adds."""
    ln, rms = normbook.LayerNorm(D), normbook.RMSNorm(D)
    w, b = torch.randn(D, requires_grad=True), torch.randn(D, requires_grad=True)
    return [("LayerNorm", lambda x, r: ln(x), list(ln.parameters())),
            ("RMSNorm", lambda x, r: rms(x), list(rms.parameters())),
            ("layer_norm", lambda x, r: normbook.layer_norm(x, (D,), w, b), [w, b]),
            ("rms_norm", lambda x, r: normbook.rms_norm(x, (D,), w), [w]),
            ("add_layer_norm", lambda x, r: torch.cat(normbook.add_layer_norm(x, r, w, b)), [w, b]),
            ("add_rms_norm", lambda x, r: torch.cat(normbook.add_rms_norm(x, r, w)), [w])]


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast-fp32-rule"])
def test_every_entry_point_compiles_whole_on_the_cuda_route(monkeypatch, autocast):
    """What a CUDA tensor meets, on the CPU: the kernel backend (forced, as CUDA tensors get it)
    and, with ``autocast``, the float32 rule that torch applies to the norms only on CUDA, XPU
    and MPS (the table extended to the CPU). Every entry point, forward and backward, compiles
    with fullgraph=True, with no graph break (torch._dynamo.explain), and gives eager's
    numbers. (The rule's branch indexed a tuple by a bool, which torch 2.11's Dynamo refuses:
    the H200's fullgraph failure.)"""
    from normbook import functional as nf

    if autocast:
        monkeypatch.setattr(nf, "_AUTOCAST_FP32", ({"cpu", "cuda", "xpu", "mps"}, {"cpu", "cuda", "xpu"}))
    dtype = torch.bfloat16 if autocast else torch.float32
    g = torch.Generator().manual_seed(5)
    x0, r0 = (torch.randn(3, 16, generator=g).to(dtype) for _ in range(2))
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else normbook.backend
    for name, fn, params in _entry_points(16):
        results = []
        for compiled in (False, True):
            x, r = (t.clone().requires_grad_() for t in (x0, r0))
            for p in params:
                p.grad = None
            torch._dynamo.reset()
            with normbook.backend("kernels"), (ctx() if autocast else ctx("kernels")):
                f = torch.compile(fn, backend="aot_eager", fullgraph=True) if compiled else fn
                if compiled:
                    explained = torch._dynamo.explain(fn)(x, r)
                    assert explained.graph_break_count == 0, (name, explained.break_reasons)
                out = f(x, r)
                assert out.dtype == (torch.float32 if autocast else dtype), (name, compiled)
                out.float().square().sum().backward()
            results.append([out.detach().float(), x.grad, r.grad, *(p.grad for p in params)])
        for got, want in zip(*results[::-1]):
            if want is None:
                assert got is None, name
            else:
                torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_the_first_compiled_kernel_call_is_compiled_once():
    """A process whose first kernel call is compiled: that trace loaded the kernel layer and
    guarded on having found it unloaded (functional._K is None, and the interpreter's flag
    unknown), so the next call, identical, compiled a second graph; a model compiled with
    mode="reduce-overhead" would record its CUDA graph twice. Now one graph serves them all."""
    r = _python(
        "import torch, normbook\n"
        "from torch._dynamo.utils import counters\n"
        "f = torch.compile(lambda x: normbook.rms_norm(x, 16), backend='aot_eager',"
        " fullgraph=True)\n"
        "x = torch.randn(4, 16, requires_grad=True)\n"
        "with normbook.backend('kernels'):\n"
        "    f(x).sum().backward(); f(x).sum().backward(); f(x)\n"
        "print(counters['stats']['unique_graphs'])\n", TRITON_INTERPRET="1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["1"]


@pytest.mark.slow
def test_wide_rows_compile_without_tracing_the_plan_builders():
    """Rows wider than the door decides at a glance (D > 8192) ask the plans whether the kernels
    take them. Under torch.compile that answer is a constant (torch.compiler.
    assume_constant_result): Dynamo does not trace the plan builders, whose lru caches it warns
    about and whose device queries it could not trace on CUDA. fullgraph, forward and
    backward, eager's numbers."""
    import warnings

    D = 16384
    g = torch.Generator().manual_seed(6)
    x0 = torch.randn(3, D, generator=g)
    w = torch.randn(D, generator=g, requires_grad=True)
    results = []
    for compiled in (False, True):
        x = x0.clone().requires_grad_()
        w.grad = None
        torch._dynamo.reset()
        fn = lambda t: normbook.rms_norm(t, (D,), w)      # noqa: E731
        with normbook.backend("kernels"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = (torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn)(x)
            y.square().sum().backward()
        assert not [w for w in caught if "lru_cache" in str(w.message)], compiled
        results.append((y.detach(), x.grad, w.grad))
    for got, want in zip(*results[::-1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_wide_rows_answer_is_marked_as_the_decorator_marks():
    """functional._wide_rows_fit carries by hand what torch.compiler.assume_constant_result
    sets (the decorator imports torch._dynamo, which import normbook must not): the same
    attributes, the same values."""
    from normbook import functional as nf

    def f():
        pass

    before = set(vars(f))
    marked = torch.compiler.assume_constant_result(f)
    added = {k: v for k, v in vars(marked).items() if k not in before}
    assert added and all(getattr(nf._wide_rows_fit, k, None) == v for k, v in added.items())


@pytest.mark.slow
def test_reduce_overhead_mode_compiles_the_kernel_route():
    """torch.compile(mode="reduce-overhead"), the CUDA-graph mode, over a module on the kernel
    route: inductor compiles around the custom ops, forward and backward, two steps (the second
    is the one a CUDA graph would replay), with eager's numbers. (Here, on the CPU, inductor
    skips the graphs themselves; gpu_check.sh runs the capture on a GPU.)"""
    torch.manual_seed(7)
    block = Block(32)
    x = torch.randn(2, 3, 32, requires_grad=True)
    r = torch.randn(2, 3, 32, requires_grad=True)
    # fp32; inductor's Linear and fused elementwise code may round in another order
    for a, e in zip(*_compiled_and_eager(block, x, r, steps=2, mode="reduce-overhead")):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_eager_route_is_the_function_and_compile_the_op():
    x, w, b, _ = make(3, 16, torch.float32)
    x.requires_grad_(True)
    # eager: the C++ apply of the one Function; under forward-mode AD, its form with a jvp
    assert K.layer_norm(x, 16, w, b).grad_fn.name() == "NormFunctionBackward"
    with torch.autograd.forward_ad.dual_level():
        assert K.layer_norm(x, 16, w, b).grad_fn.name() == "_NormFunctionADBackward"
    seen = []

    def backend(gm, example_inputs):
        # the Function's forward and backward are subgraphs of autograd_function_apply
        seen.extend(str(n.target) for m in gm.modules() if hasattr(m, "graph")
                    for n in m.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    torch.compile(lambda x: K.rms_norm(x, 16, w), backend=backend, fullgraph=True)(x)
    assert any("normbook.norm_forward" in t for t in seen), seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_mode_ad_traced_by_torch_compile_carries_the_tangents(dtype):
    """func.jvp, a dual_level and jacfwd inside a compiled function, on the kernel backend: the
    custom op has no forward formula, and the compiled Function's route through it gave zero
    tangents (and fwAD's tangent None), silently, where torch's norms and the torch backend
    give the derivative. Under forward-mode AD the compiled call takes the torch backend."""
    g = torch.Generator().manual_seed(0)
    x, t = (torch.randn(3, 16, generator=g).to(DEVICE, dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(16, generator=g)).to(DEVICE, dtype)
    b = (0.1 * torch.randn(16, generator=g)).to(DEVICE, dtype)
    fwAD = torch.autograd.forward_ad
    cases = [(lambda a: normbook.layer_norm(a, 16, w, b), lambda a: F.layer_norm(a, (16,), w, b)),
             (lambda a: normbook.rms_norm(a, 16, w), lambda a: F.rms_norm(a, (16,), w)),
             (lambda a: normbook.add_rms_norm(a, x, w)[0], lambda a: F.rms_norm(a + x, (16,), w)),
             (lambda a: normbook.rms_norm(a, 16, w, offset=1.0),
              lambda a: (F.rms_norm(a.float(), (16,), eps=torch.finfo(torch.float32).eps)
                         * (1 + w.float())).to(dtype))]

    def dual(f, a, ta):
        with fwAD.dual_level():
            return fwAD.unpack_dual(f(fwAD.make_dual(a, ta))).tangent

    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    with normbook.backend("kernels"):
        for f, ref in cases:
            want = torch.func.jvp(ref, (x,), (t,))[1]
            for how in (lambda a, ta: torch.func.jvp(f, (a,), (ta,))[1],
                        lambda a, ta: dual(f, a, ta)):
                torch._dynamo.reset()
                got = torch.compile(how, backend="aot_eager", fullgraph=True)(x, t)
                assert got is not None
                torch.testing.assert_close(got, want, **tol)
            torch._dynamo.reset()
            jac = torch.compile(torch.func.jacfwd(f), backend="aot_eager", fullgraph=True)(x)
            torch.testing.assert_close(jac, torch.func.jacfwd(ref)(x), **tol)


def test_host_benchmark_writes_every_key(tmp_path):
    """python -m normbook.bench host: every key the issue names, and the ratios."""
    path = tmp_path / "host.json"
    out = _python(f"import sys; from normbook.bench.cli import main; sys.exit(main(['host', '--number', '20', "
                  f"'--repeat', '1', '--json', {str(path)!r}]))")
    assert out.returncode == 0, out.stderr
    data = __import__("json").loads(path.read_text())
    for key in ("normbook_layer_norm_fwd_us", "normbook_layer_norm_fwd_bwd_us", "normbook_rms_norm_fwd_us",
                "normbook_rms_norm_fwd_bwd_us", "torch_layer_norm_fwd_us", "torch_layer_norm_fwd_bwd_us",
                "floor_layer_norm_fwd_bwd_us", "floor_rms_norm_fwd_us"):
        assert 0 < data[key] < 1e5, (key, data[key])
    assert set(data["floor_ratios"]) == set(data["ratios"])
    assert "the floor" in out.stdout
    assert "x torch's" in out.stdout and "PASS" not in out.stdout    # judged only with --goal
    assert set(data["ratios"]) == {
        "layer_norm_fwd", "layer_norm_fwd_bwd", "rms_norm_fwd", "rms_norm_fwd_bwd"}


def test_custom_ops_are_registered():
    assert hasattr(torch.ops.normbook, "norm_forward") and hasattr(torch.ops.normbook, "norm_backward")
    x, w, b, _ = make(3, 16, torch.float32)
    torch.library.opcheck(torch.ops.normbook.norm_forward.default, (x, None, w, b, EPS, False),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
def test_an_exported_kernel_program_trains_and_loads_after_import_normbook(tmp_path, strict):
    """torch.export of a model on the kernel backend holds the custom op itself (no Function
    around it), strict or not: its gradient is norm_forward's own formula, equal to the torch
    backend's to rounding. (Strict export used to record the Function's forward under grad
    mode off, and the exported outputs had no gradient.) Saved, the program loads in a fresh
    process after ``import normbook`` alone (which defines the ops without importing triton)
    and runs there, backward included: checked once, for the non-strict program."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = normbook.LayerNorm(16)

        def forward(self, x, r):
            y, h = normbook.add_rms_norm(x, r)
            return self.norm(y) * 2 + h

    torch.manual_seed(5)
    m, args = Block().to(DEVICE), (torch.randn(4, 16, device=DEVICE), torch.randn(4, 16, device=DEVICE))
    with normbook.backend("kernels"):
        ep = torch.export.export(m, args, dynamic_shapes=({0: torch.export.Dim("b")}, {0: torch.export.Dim("b")}),
                                 strict=strict)
    assert "normbook.norm_forward" in str(ep.graph)
    for rows in (4, 7):
        xs = [torch.randn(rows, 16, device=DEVICE, requires_grad=True) for _ in range(2)]
        got = ep.module()(*xs)
        grads = torch.autograd.grad(got.sum(), [*xs, *m.parameters()])
        with normbook.backend("torch"):
            want = m(*xs)
        wants = torch.autograd.grad(want.sum(), [*xs, *m.parameters()])
        torch.testing.assert_close(got, want)
        for g, w in zip(grads, wants):
            torch.testing.assert_close(g, w)
    if strict:
        return
    path = tmp_path / "block.pt2"
    torch.export.save(ep, str(path))
    code = ("import sys, torch, normbook\n"
            "assert 'triton' not in sys.modules\n"
            f"ep = torch.export.load({str(path)!r})\n"
            f"x, r = (torch.randn(3, 16, device={DEVICE!r}, requires_grad=True) for _ in range(2))\n"
            "ep.module()(x, r).sum().backward()\n"
            "print('ran', tuple(x.grad.shape))\n")
    out = _python(code, **({} if DEVICE == "cuda" else {"TRITON_INTERPRET": "1"}))
    assert "ran (3, 16)" in out.stdout, out.stdout + out.stderr
    # on CPU tensors without the interpreter (a program exported on a GPU machine, run on a
    # CPU) the ops compute the torch backend's formulas, as the front door would: Triton's
    # "0 active drivers" before; the values and gradients those of the same block on torch
    if DEVICE != "cpu":
        return
    path_m = tmp_path / "block_module.pt"
    torch.save(m.state_dict(), path_m)
    code = ("import torch, normbook\n"
            f"ep = torch.export.load({str(path)!r})\n"
            "torch.manual_seed(1)\n"
            "x, r = (torch.randn(3, 16, requires_grad=True) for _ in range(2))\n"
            "got = ep.module()(x, r)\n"
            "grads = torch.autograd.grad(got.square().sum(), (x, r))\n"
            "state = torch.load(" + repr(str(path_m)) + ")\n"
            "w, b = state['norm.weight'], state['norm.bias']\n"
            "def block(x, r):\n"
            "    y, h = normbook.add_rms_norm(x, r)\n"
            "    return torch.nn.functional.layer_norm(y, (16,), w, b) * 2 + h\n"
            "want = block(x, r)\n"
            "wants = torch.autograd.grad(want.square().sum(), (x, r))\n"
            "torch.testing.assert_close(got, want)\n"
            "for g, v in zip(grads, wants):\n"
            "    torch.testing.assert_close(g, v)\n"
            "print('cpu ran')\n")
    out = _python(code, TRITON_INTERPRET="0")
    assert "cpu ran" in out.stdout, out.stdout + out.stderr


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("call,error,words", [
    (lambda x, w: K.layer_norm(x, (32,), w), ValueError, ["normalized_shape", "(32,)", "(64,)"]),
    (lambda x, w: K.layer_norm(x, 64, w[:10]), ValueError, ["weight", "(64,)", "(10,)"]),
    (lambda x, w: K.layer_norm(x.long(), 64), TypeError, ["input", "int64"]),
    (lambda x, w: K.layer_norm(x.double(), 64), TypeError, ["input", "float64", "float32"]),
    (lambda x, w: K.rms_norm(x, 64, w.double()), TypeError, ["weight", "float64"]),
    (lambda x, w: K.rms_norm(x, 64, w.to("meta")), ValueError, ["weight", "device", "meta"]),
    (lambda x, w: K.layer_norm(x, 64, w, eps=[1e-5]), TypeError, ["eps", "[1e-05]"]),
    (lambda x, w: K.add_layer_norm(x, x[:, :32], w, None), ValueError, ["residual", "(4, 64)", "(4, 32)"]),
    (lambda x, w: K.add_rms_norm(x, x.half(), w), TypeError, ["residual", "float32", "float16"]),
    (lambda x, w: K.add_rms_norm(x, x.to("meta"), w), ValueError, ["residual", "device", "meta"]),
    (lambda x, w: K.layer_norm([1.0, 2.0], 2), TypeError, ["input", "Tensor", "list"]),
])
def test_bad_input_names_the_argument(call, error, words):
    x, w, _, _ = make(4, 64, torch.float32)
    with pytest.raises(error) as info:
        call(x, w)
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_empty_batch_and_d1():
    """M = 0 launches nothing and returns empty tensors (and zero parameter grads); D = 1 works."""
    x = torch.empty(0, 7, device=DEVICE, requires_grad=True)
    w = torch.ones(7, device=DEVICE, requires_grad=True)
    y = K.rms_norm(x, (7,), w)
    y.sum().backward()
    assert y.shape == (0, 7) and torch.equal(w.grad, torch.zeros(7, device=DEVICE))
    x1 = torch.randn(5, 1, device=DEVICE)
    torch.testing.assert_close(K.layer_norm(x1, (1,)), F.layer_norm(x1, (1,)))  # both exactly 0


def test_cpu_without_interpreter_is_a_clear_error():
    code = ("import torch, normbook.kernels as K\n"
            "try:\n    K.layer_norm(torch.randn(2, 8), (8,))\n"
            "except ValueError as e:\n    print('ValueError:', e)\n")
    out = _python(code, TRITON_INTERPRET="0")
    assert "ValueError:" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr


# ----------------------------------------------------------------------------- on a GPU

@pytest.mark.parametrize("M,D", [(32768, 1024), (4096, 8192), (1024, 16384), (64, 131072), (3, 70001)])
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.gpu
def test_gpu_three_ways_large(norm, M, D, dtype):
    """Larger shapes, compiled kernels, bf16/fp16/fp32 on the device, same bound as on the CPU."""
    from test_kernels_launchers import test_layer_norm_three_ways, test_rms_norm_three_ways
    (test_layer_norm_three_ways if norm == "layer" else test_rms_norm_three_ways)(M, D, dtype)


def _reaches_the_launchers(monkeypatch, device):
    """bf16 rows of ``device`` through normbook's functions and modules: each call's forward
    and backward run the kernels' launchers (normbook.kernels._forward.norm_forward and
    _backward.norm_backward), with the norm's is_rms, and agree with float64. The door calls
    them through ``functional._K``, the named tuple it caches on its first kernel call, so the
    spies go into that tuple (patching the modules' attributes would not be seen). Each call is
    its signature's first, which the fast path leaves to the launchers."""
    from normbook import functional

    kernels = functional._kernels()
    forward, backward = kernels.norm_forward, kernels.norm_backward
    calls = []

    def spy(direction, launcher):
        def call(*args):            # x or dy first, is_rms last, in both launchers
            calls.append((direction, args[0].device.type, args[0].dtype, args[-1]))
            return launcher(*args)
        return call

    monkeypatch.setattr(functional, "_K", kernels._replace(norm_forward=spy("fwd", forward),
                                                            norm_backward=spy("bwd", backward)))
    D, eps = 256, torch.finfo(torch.float32).eps     # rms_norm's eps for bf16 when None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, D, generator=g).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(8, D, generator=g).to(device, torch.bfloat16)
    ln = normbook.LayerNorm(D, device=device, dtype=torch.bfloat16)
    rms = normbook.RMSNorm(D, device=device, dtype=torch.bfloat16)
    for name, norm, is_rms, params, ref in (
            ("layer_norm", lambda t: normbook.layer_norm(t, D), False, (),
             lambda t: F.layer_norm(t, (D,))),
            ("rms_norm", lambda t: normbook.rms_norm(t, D), True, (),
             lambda t: F.rms_norm(t, (D,), eps=eps)),
            ("LayerNorm", ln, False, (ln.weight, ln.bias),
             lambda t, w, b: F.layer_norm(t, (D,), w, b, ln.eps)),
            ("RMSNorm", rms, True, (rms.weight,),
             lambda t, w: F.rms_norm(t, (D,), w, eps=eps))):
        calls.clear()
        x.grad = None
        for p in params:
            p.grad = None
        y = norm(x)
        y.backward(dy)
        assert calls == [("fwd", device, torch.bfloat16, is_rms),
                         ("bwd", device, torch.bfloat16, is_rms)], name
        # float64 from the same bf16 values: y within assert_close's bf16 tolerance (1.6e-2
        # relative; a bf16 ulp is at most 2^-7), the gradients within their bf16 rounding (a
        # unit where a rounding boundary falls between the two) and fp32 sums over D = 256
        # (about 1e-6 of the row's scale, hence an absolute part for gradients near 0)
        leaves = [t.detach().double().requires_grad_() for t in (x, *params)]
        y64 = ref(*leaves)
        y64.backward(dy.double())
        torch.testing.assert_close(y, y64.to(torch.bfloat16), msg=name)
        for t, t64 in zip((x, *params), leaves):
            torch.testing.assert_close(t.grad.double(), t64.grad, atol=1e-2, rtol=1.6e-2,
                                       msg=name)


@pytest.mark.gpu
def test_gpu_public_api_dispatches_to_kernels(monkeypatch):
    """On a GPU, by default (no normbook.backend block), a CUDA bf16 tensor through
    normbook.layer_norm, rms_norm and the modules reaches the Triton launchers, both ways."""
    _reaches_the_launchers(monkeypatch, "cuda")


def test_the_public_api_reaches_the_launchers_in_the_interpreter(monkeypatch):
    """The GPU test above, its spies and its route, checked where the CPU runs the kernels: in
    Triton's interpreter, with the kernels backend chosen (CPU tensors take the torch ops by
    default)."""
    if DEVICE != "cpu":
        pytest.skip("on a GPU the test above runs the same checks")
    with normbook.backend("kernels"):
        _reaches_the_launchers(monkeypatch, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("M,D", [(16384, 4096), (16384, 32768), (512, 131072)])
def test_gpu_gradients_bitwise_deterministic(M, D):
    """Persistent grid, fixed partial layout, a fixed order of sums: equal bits run to run, also
    where programs share rows (D > 8192) and sum their shares of c1, c2 (and, forward, of the
    mean and M2) in slice order: y and dx too."""
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(D, device="cuda", requires_grad=True)
    b = torch.randn(D, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    runs = []
    for _ in range(3):
        x.grad = w.grad = b.grad = None
        y = K.layer_norm(x, (D,), w, b)
        y.backward(dy)
        runs.append((y.detach().clone(), x.grad.clone(), w.grad.clone(), b.grad.clone()))
    for run in runs[1:]:
        assert all(torch.equal(a, c) for a, c in zip(run, runs[0]))


def test_two_dim_input_normalized_over_both_dims_keeps_its_shape():
    """x of shape (4, 8) normalized over (4, 8): one row of 32 in the kernels, (4, 8) out (it
    came back as (1, 32))."""
    x, w = torch.randn(4, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    for y, ref in ((K.layer_norm(x, (4, 8), w), torch.nn.functional.layer_norm(x, (4, 8), w)),
                   (K.rms_norm(x, (4, 8), w), torch.nn.functional.rms_norm(x, (4, 8), w))):
        assert y.shape == (4, 8)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_negative_view_compiled_or_exported_is_read_as_its_values():
    """Eager calls make a negative view's values real before the kernels read memory (the
    door's _values); compiled and exported programs, which never run that check (Dynamo cannot
    trace is_neg), hand their custom op real tensors: the norm of -x, not of x."""
    x, w, _, _ = make(8, 64, torch.float32)
    want = K.rms_norm(-x, 64, w)
    torch._dynamo.reset()
    f = torch.compile(lambda t: K.rms_norm(t, 64, w), backend="aot_eager", fullgraph=True)
    assert torch.equal(f(torch._neg_view(x)), want)
    m = normbook.RMSNorm(64, device=DEVICE)
    with normbook.backend("kernels"):
        ep = torch.export.export(m, (x,))
        assert torch.equal(ep.module()(torch._neg_view(x)), m(-x))
