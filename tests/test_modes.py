"""normbook.rms_norm's offset and round_xhat, and normbook.RMSNorm's: the operations of the
Hugging Face norms they reproduce (Gemma's ``(xhat * (1.0 + weight.float())).type_as(x)``,
Llama's ``weight * xhat.to(input_dtype)``), written out here in torch ops, bit for bit on the
torch backend in float32, bfloat16 and float16, forward and backward (the gradient of the
written-out form by autograd); within a unit of rounding on the kernels (whose sums run in
another order). The Hugging Face classes themselves are compared in tests/test_swap.py."""

from __future__ import annotations

import pytest
import torch

import normbook

D = 40
EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _xhat(x):
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)


def gemma(x, w):
    return (_xhat(x) * (1.0 + w.float())).type_as(x)


def llama(x, w):
    return w * _xhat(x).to(x.dtype)


MODES = {"offset": (dict(offset=1.0), gemma), "round_xhat": (dict(round_xhat=True), llama)}


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(6, D, generator=g) + 1).to(dtype).requires_grad_()
    w = torch.randn(D, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(6, D, generator=g).to(dtype)
    return x, w, dy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_modes_compute_the_hugging_face_operations(mode, dtype, backend, request):
    if backend == "kernels":
        request.getfixturevalue("kernels")
    kwargs, formula = MODES[mode]
    x, w, dy = _inputs(dtype)
    want = formula(x, w)
    want_grads = torch.autograd.grad(want, (x, w), dy)
    module = normbook.RMSNorm(D, eps=EPS, dtype=dtype, **kwargs)
    with torch.no_grad():
        module.weight.copy_(w)
    with normbook.backend(backend):
        for got, params in ((normbook.rms_norm(x, D, w, EPS, **kwargs), (x, w)),
                            (module(x), (x, module.weight))):
            grads = torch.autograd.grad(got, params, dy)
            assert got.dtype == want.dtype == dtype
            if backend == "torch":
                assert torch.equal(got, want)
                for g, g_want in zip(grads, want_grads):
                    torch.testing.assert_close(g, g_want, rtol=0,
                                               atol=2 * torch.finfo(dtype).eps * g_want.abs().max())
            else:
                ulp = torch.finfo(dtype).eps
                assert (got.float() - want.float()).abs().max() <= 2 * ulp * want.float().abs().max()
                for g, g_want in zip(grads, want_grads):
                    assert (g.float() - g_want.float()).abs().max() <= 4 * ulp * g_want.float().abs().max()


def test_the_modes_are_named_in_repr_and_checked():
    assert "offset=1.0, round_xhat=False" in repr(normbook.RMSNorm(8, offset=1))
    assert "offset" not in repr(normbook.RMSNorm(8))
    with pytest.raises(TypeError, match="offset: expected a real number, got 'one'"):
        normbook.RMSNorm(8, offset="one")
    with pytest.raises(TypeError, match="round_xhat: expected a bool, got 1"):
        normbook.rms_norm(torch.randn(2, 8), 8, round_xhat=1)
    # a falsy mode that is not the default was taken (the check ran only when truthy), where
    # the module refused it
    for bad, name in ((dict(round_xhat=None), "round_xhat"), (dict(round_xhat=0), "round_xhat"),
                      (dict(offset=None), "offset")):
        with pytest.raises(TypeError, match=f"{name}: expected a"):
            normbook.rms_norm(torch.randn(2, 8), 8, torch.ones(8), **bad)
    assert torch.equal(normbook.rms_norm(torch.ones(2, 8), 8, offset=0), torch.ones(2, 8))
    with pytest.raises(TypeError, match="offset or round_xhat"):
        torch.jit.script(normbook.RMSNorm(8, round_xhat=True))
    # an offset is added to the weight: without one it would be dropped without a word
    with pytest.raises(ValueError, match=r"offset: expected a weight to add it to \(gamma = "
                                         r"offset \+ weight\), got offset=2.0 with weight None"):
        normbook.rms_norm(torch.randn(2, 8), 8, None, offset=2.0)
    with pytest.raises(ValueError, match=r"got offset=1 with elementwise_affine=False"):
        normbook.RMSNorm(8, elementwise_affine=False, offset=1)
    x = torch.randn(2, 8)
    assert torch.equal(normbook.rms_norm(x, 8, None, offset=0.0), normbook.rms_norm(x, 8))
    assert torch.equal(normbook.RMSNorm(8, elementwise_affine=False, round_xhat=True)(x),
                       normbook.rms_norm(x, 8))
    plain = torch.nn.RMSNorm(8)
    plain.__class__ = normbook.RMSNorm          # as swap_norms changes a torch norm's class
    x = torch.randn(2, 8)
    assert torch.equal(plain(x), torch.nn.functional.rms_norm(x, (8,), plain.weight))


def test_a_mode_traces_as_one_call():
    """torch.fx records a module with a mode as one call of rms_norm with its keywords (whether
    xhat is rounded depends on the dtype, which a Proxy does not carry)."""
    model = torch.nn.Sequential(normbook.RMSNorm(D, eps=EPS, round_xhat=True)).to(torch.bfloat16)
    traced = torch.fx.symbolic_trace(model)
    (node,) = [n for n in traced.graph.nodes if n.op == "call_function"]
    assert node.target is normbook.rms_norm and node.kwargs == dict(offset=0.0, round_xhat=True)
    x = torch.randn(3, D).to(torch.bfloat16)
    assert torch.equal(traced(x), model(x))


# LayerNorm's upcast: torch.nn.functional.layer_norm of a float32 copy, rounded once (OLMo's,
# CLIP's and Whisper's LayerNorms). Shapes where torch's kernel for half rows and its float32
# kernel on a copy disagree in some values (measured on the CPU, torch 2.13): the mode is
# needed here, which the first assertion shows.
UPCAST_SHAPES = [(231, 1000), (7, 4096), (64, 64)]


def _upcast_inputs(dtype, M, width, bias=True):
    g = torch.Generator().manual_seed(M + width)
    x = (3 * torch.randn(M, width, generator=g) + 1).to(dtype).requires_grad_()
    w = torch.randn(width, generator=g).to(dtype).requires_grad_()
    b = torch.randn(width, generator=g).to(dtype).requires_grad_() if bias else None
    dy = torch.randn(M, width, generator=g).to(dtype)
    return x, w, b, dy


def _upcast_cases(dtype):
    """(width, x, w, b, dy, the tensors to differentiate) per shape, with and without
    parameters."""
    for M, width in UPCAST_SHAPES:
        for affine in (True, False):
            x, w, b, dy = _upcast_inputs(dtype, M, width)
            if not affine:
                w = b = None
            yield width, x, w, b, dy, [t for t in (x, w, b) if t is not None]


def _upcast_formula(x, w, b):
    F = torch.nn.functional
    return F.layer_norm(x.float(), x.shape[-1:], None if w is None else w.float(),
                        None if b is None else b.float(), EPS).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_is_the_layer_norm_of_a_float32_copy(dtype):
    """Bit for bit on the torch backend forward, the gradients within a unit of rounding of
    autograd's of the written-out form, with and without parameters; and the plain call is
    not bit for bit on some of these shapes, so the mode does something."""
    differs = False
    for width, x, w, b, dy, params in _upcast_cases(dtype):
        want = _upcast_formula(x, w, b)
        got = normbook.layer_norm(x, width, w, b, EPS, upcast=True)
        assert got.dtype == dtype and torch.equal(got, want), (x.shape, w is None)
        for g, g_want in zip(torch.autograd.grad(got, params, dy),
                             torch.autograd.grad(want, params, dy)):
            # (ln-dx) in normbook's order against torch's backward kernel: a few values a
            # unit apart, as for the RMSNorm modes above
            torch.testing.assert_close(g, g_want, rtol=0,
                                       atol=2 * torch.finfo(dtype).eps * g_want.abs().max())
        differs |= not torch.equal(normbook.layer_norm(x, width, w, b, EPS), want)
    assert differs


def test_upcast_on_the_kernels_is_the_plain_call(kernels):
    """The kernels compute in float32 from half rows either way: the same call, no copy."""
    x, w, b, dy = _upcast_inputs(torch.bfloat16, 6, 40)
    with normbook.backend("kernels"):
        got = normbook.layer_norm(x, 40, w, b, EPS, upcast=True)
        assert torch.equal(got, normbook.layer_norm(x, 40, w, b, EPS))
    want = _upcast_formula(x, w, b)
    ulp = torch.finfo(torch.bfloat16).eps
    assert (got.float() - want.float()).abs().max() <= 2 * ulp * want.float().abs().max()


def test_upcast_module_repr_checks_trace_and_float32():
    m = normbook.LayerNorm(D, bias=False, upcast=True)
    # (torch 2.11's repr omits bias=, 2.13's has it)
    assert repr(m).endswith(", upcast=True)") and "upcast" not in repr(normbook.LayerNorm(D))
    with pytest.raises(TypeError, match="upcast: expected True, False or 'ops', got 1"):
        normbook.LayerNorm(D, upcast=1)
    with pytest.raises(TypeError, match="upcast: expected True, False or 'ops', got 'yes'"):
        normbook.layer_norm(torch.randn(2, D), D, upcast="yes")
    with pytest.raises(TypeError, match="upcast"):
        torch.jit.script(m)
    x = torch.randn(3, D)
    assert torch.equal(m(x), normbook.LayerNorm(D, bias=False)(x))   # float32: a no-op
    traced = torch.fx.symbolic_trace(torch.nn.Sequential(m))
    (node,) = [n for n in traced.graph.nodes if n.op == "call_function"]
    assert node.target is normbook.layer_norm and node.kwargs == dict(upcast=True)
    xb = x.bfloat16()
    assert torch.equal(traced(xb), m(xb))
    compiled = torch.compile(m.bfloat16(), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(xb), m(xb))


def _ops_formula(x, w, b):
    """Cohere's LayerNorm, as its forward writes it: float32 torch ops, rounded once."""
    h = x.float()
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    y = (h - mean) * torch.rsqrt(var + EPS)
    y = y if w is None else w.float() * y
    return (y if b is None else y + b.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_upcast_ops_is_the_equations_in_torch_ops(dtype):
    """``upcast="ops"``: forward and gradients bit for bit those of the written-out ops, also
    in float32 and without autograd recording (where the plain call takes torch's fused
    kernel); and the fused kernel differs, so the mode does something in every dtype."""
    differs = False
    for width, x, w, b, dy, params in _upcast_cases(dtype):
        want = _ops_formula(x, w, b)
        got = normbook.layer_norm(x, width, w, b, EPS, upcast="ops")
        assert got.dtype == dtype and torch.equal(got, want), (x.shape, w is None)
        for g, g_want in zip(torch.autograd.grad(got, params, dy),
                             torch.autograd.grad(want, params, dy)):
            assert torch.equal(g, g_want), (x.shape, w is None)
        with torch.no_grad():
            assert torch.equal(normbook.layer_norm(x, width, w, b, EPS, upcast="ops"), want)
            differs |= not torch.equal(normbook.layer_norm(x, width, w, b, EPS, upcast=True),
                                       want)
    assert differs


def test_upcast_ops_module_checks_trace_and_kernels(kernels):
    """The module's repr and fx node carry the mode; bad input keeps its named errors; on the
    kernels it is the plain call, as upcast=True is."""
    m = normbook.LayerNorm(D, bias=False, upcast="ops")
    assert repr(m).endswith(", upcast='ops')")
    x = torch.randn(3, D).bfloat16()
    assert torch.equal(m.bfloat16()(x), _ops_formula(x, m.weight, None))
    traced = torch.fx.symbolic_trace(torch.nn.Sequential(m))
    (node,) = [n for n in traced.graph.nodes if n.op == "call_function"]
    assert node.kwargs == dict(upcast="ops") and torch.equal(traced(x), m(x))
    with pytest.raises(ValueError, match="normalized_shape"):
        normbook.layer_norm(x, D + 1, upcast="ops")
    with pytest.raises(TypeError, match="eps"):
        normbook.layer_norm(x, D, eps="1e-5", upcast="ops")
    xk, w, b, dy = _upcast_inputs(torch.bfloat16, 6, 40)
    with normbook.backend("kernels"):
        assert torch.equal(normbook.layer_norm(xk, 40, w, b, EPS, upcast="ops"),
                           normbook.layer_norm(xk, 40, w, b, EPS))


# -- round_xhat fused on the kernels ------------------------------------------------------------

def _saved_bytes(fn):
    """Bytes of the distinct tensors autograd keeps for backward while ``fn()`` builds its graph."""
    kept = {}

    def pack(t):
        kept[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(kept.values())


def test_round_xhat_on_the_kernels_is_one_fused_pass(kernels):
    """Half rows on the kernels: the rows kernel rounds xhat before the weight (one pass), not
    the norm and a multiplication: the same bits as that composition in float16 (the
    interpreter rounds float16 as a GPU does; bf16 on a GPU: tests/test_kernels_gpu.py), and
    autograd keeps x, the weight and the statistics, not also a (M, D) xhat."""
    M, width = 64, 256
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, width, generator=g).half().requires_grad_()
    w = (1 + torch.randn(width, generator=g) / 4).half().requires_grad_()
    dy = torch.randn(M, width, generator=g).half()
    with normbook.backend("kernels"):
        fused, fused_bytes = _saved_bytes(lambda: normbook.rms_norm(x, width, w, EPS,
                                                                    round_xhat=True))
        composed, composed_bytes = _saved_bytes(lambda: w * normbook.rms_norm(x, width, None, EPS))
        assert type(fused.grad_fn).__name__ == "_RoundXhatBackward"
        assert torch.equal(fused, composed)
        assert composed_bytes - fused_bytes >= M * width * 2   # the composition's xhat
        got = torch.autograd.grad(fused, (x, w), dy)
        want = torch.autograd.grad(composed, (x, w), dy)
    ulp = torch.finfo(torch.float16).eps
    for g_got, g_want in zip(got, want):   # the composition rounds dy * w first: within ulps
        assert (g_got.float() - g_want.float()).abs().max() <= 4 * ulp * g_want.float().abs().max()


@pytest.mark.parametrize("view", ["column", "expand"])
def test_round_xhat_fused_takes_a_weight_that_is_a_view(kernels, view):
    """The fused pass read the weight as D dense values: a column of a stacked weight (stride
    2) gave y 0.5 off in relative terms, an expanded one (stride 0) inf and NaN. It now gets
    the same bits and gradients as a dense copy of the weight, forward and backward."""
    M, width = 8, 64
    g = torch.Generator().manual_seed(2)
    x = torch.randn(M, width, generator=g).half()
    dy = torch.randn(M, width, generator=g).half()
    stacked = (1 + torch.randn(width, 2, generator=g) / 4).half().requires_grad_()
    w = stacked[:, 1] if view == "column" else stacked[:1, 0].expand(width)
    dense = w.detach().clone().requires_grad_()
    with normbook.backend("kernels"):
        outs = []
        for weight in (w, dense):
            xl = x.clone().requires_grad_()
            y = normbook.rms_norm(xl, width, weight, EPS, round_xhat=True)
            assert type(y.grad_fn).__name__ == "_RoundXhatBackward"
            outs.append((y, *torch.autograd.grad(y, (xl, weight), dy)))
    (y, dx, dw), (y2, dx2, dw2) = outs
    assert torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(dw, dw2)


def test_round_xhat_fused_takes_an_inference_tensor(kernels):
    """x made under torch.inference_mode, a weight wanting a gradient: the fused pass saves x
    for the weight's gradient, which autograd refuses for an inference tensor; it now saves a
    copy, as the plain call does, and gives the composition's result."""
    with torch.inference_mode():
        x = torch.randn(4, 64).half()
    w = torch.ones(64, dtype=torch.float16, requires_grad=True)
    with normbook.backend("kernels"):
        y = normbook.rms_norm(x, 64, w, EPS, round_xhat=True)
        (dw,) = torch.autograd.grad(y.sum(), w)
        assert torch.equal(y, w * normbook.rms_norm(x.clone(), 64, None, EPS))
    assert dw.shape == (64,) and torch.isfinite(dw).all()


def test_round_xhat_fused_plans_each_batch_of_its_own(kernels):
    """One width, several batch sizes in turn: each takes its own launches (the grid, the
    partials of dweight, whether one program writes dweight itself), as a plain call's do,
    and its gradients are the composition's. (The rounding launches were once kept by their
    flags alone: a batch of 4 rows after one of 64 ran on the 64 rows' grid, whose programs
    each wrote a partial row past the end of dweight.)"""
    width = 1024                           # tiles of 4 rows, up to 8 rows and past them
    g = torch.Generator().manual_seed(2)
    w = (1 + torch.randn(width, generator=g) / 4).half().requires_grad_()
    ulp = torch.finfo(torch.float16).eps
    for M in (64, 4, 8, 64, 100):
        x = torch.randn(M, width, generator=g).half().requires_grad_()
        dy = torch.randn(M, width, generator=g).half()
        with normbook.backend("kernels"):
            got = torch.autograd.grad(normbook.rms_norm(x, width, w, EPS, round_xhat=True),
                                      (x, w), dy)
            want = torch.autograd.grad(w * normbook.rms_norm(x, width, None, EPS), (x, w), dy)
        for g_got, g_want in zip(got, want):
            bound = 4 * ulp * g_want.float().abs().max()
            assert (g_got.float() - g_want.float()).abs().max() <= bound, M


def test_round_xhat_fused_differentiates_twice_and_leaves_the_rest_composed(kernels):
    x, w, dy = _inputs(torch.bfloat16)
    with normbook.backend("kernels"):
        y = normbook.rms_norm(x, D, w, EPS, round_xhat=True)
        assert type(y.grad_fn).__name__ == "_RoundXhatBackward"
        module = normbook.RMSNorm(D, eps=EPS, round_xhat=True, dtype=torch.bfloat16)
        assert type(module(x).grad_fn).__name__ == "_RoundXhatBackward"   # a Parameter weight
        # create_graph: the composition's backward, which autograd differentiates again
        gx, gw = torch.autograd.grad(y, (x, w), dy, create_graph=True)
        y2 = w * normbook.rms_norm(x, D, None, EPS)
        hx, hw = torch.autograd.grad(y2, (x, w), dy, create_graph=True)
        assert torch.equal(gx, hx) and torch.equal(gw, hw)
        second = torch.autograd.grad((gx.float() ** 2).sum(), (x, w))
        want = torch.autograd.grad((hx.float() ** 2).sum(), (x, w))
        assert all(torch.equal(a, b) for a, b in zip(second, want))
        # only the weight wants a gradient
        (gw_only,) = torch.autograd.grad(normbook.rms_norm(x.detach(), D, w, EPS,
                                                            round_xhat=True), (w,), dy,
                                         create_graph=True)
        assert gw_only.shape == (D,)
        # not the rows kernels' case: a weight of another dtype, rows over two dims
        other = normbook.rms_norm(x, D, w.float(), EPS, round_xhat=True)
        assert type(other.grad_fn).__name__ == "MulBackward0"
        two = normbook.rms_norm(x.view(3, 2, D), (2, D), w.expand(2, D), EPS, round_xhat=True)
        assert type(two.grad_fn).__name__ == "MulBackward0"


def test_round_xhat_fused_backward_takes_batched_and_dual_gradients(kernels):
    """The fused pass's backward handed the launchers a batched dy (is_grads_batched, or vmap
    over torch.autograd.grad), which has no storage ("Cannot access data pointer"), and a dual
    one, whose tangent the launchers cannot carry. Both now take the composition through
    autograd: the torch backend's gradients and tangents, to the bit."""
    import torch.autograd.forward_ad as fwAD

    x, w, dy = _inputs(torch.bfloat16)
    v = torch.stack([dy, dy.flip(0)])
    got = {}
    for name in ("kernels", "torch"):
        with normbook.backend(name):
            y = normbook.rms_norm(x, D, w, EPS, round_xhat=True)
            grads = list(torch.autograd.grad(y, (x, w), v, is_grads_batched=True,
                                             retain_graph=True))
            grads += torch.func.vmap(lambda u: torch.autograd.grad(y, (x, w), u,
                                                                  retain_graph=True))(v)
            with fwAD.dual_level():
                dual = torch.autograd.grad(y, (x, w), fwAD.make_dual(dy, v[1]))
                grads += [part for g in dual for part in fwAD.unpack_dual(g)[:2]]
        got[name] = grads
    assert len(got["kernels"]) == 8
    assert all(torch.equal(a, b) for a, b in zip(got["kernels"], got["torch"]))


@pytest.mark.parametrize("modes", [dict(round_xhat=True), dict(offset=1.0)], ids=str)
@pytest.mark.parametrize("weight, error, message", [
    (torch.ones(1), "ShapeError", r"weight: expected shape \(8,\) \(normalized_shape\), got \(1,\)"),
    (torch.ones(2, 8), "ShapeError", r"weight: expected shape \(8,\)"),
    (torch.ones(8, dtype=torch.int64), TypeError, r"weight: expected a floating-point dtype"),
    (torch.ones(8, dtype=torch.complex64), TypeError, r"weight: expected a floating-point dtype"),
    ([1.0] * 8, TypeError, r"weight: expected a torch.Tensor or None, got list"),
    (torch.ones(8, device="meta"), "DeviceError", r"weight: expected a tensor on input's device"),
], ids=["(1,)", "(2, 8)", "int64", "complex64", "list", "meta"])
def test_a_mode_checks_the_weight_as_the_plain_call_does(modes, weight, error, message):
    """rms_norm with round_xhat or an offset formed gamma from the weight before any check: a
    weight of shape (1,) or (2, 8) was broadcast, an integer or complex one taken (complex
    without its imaginary part), a list failed inside. Now the plain call's errors, for half
    rows (where round_xhat acts) and float32 rows."""
    from normbook import _validate

    error = getattr(_validate, error) if isinstance(error, str) else error
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(2, 3, 8).to(dtype)
        w = weight.to(dtype) if isinstance(weight, torch.Tensor) and weight.is_floating_point() \
            and not weight.is_meta else weight
        with pytest.raises(error, match=message):
            normbook.rms_norm(x, (8,), w, **modes)


@pytest.mark.parametrize("offset", [float("nan"), float("inf"), -float("inf")])
def test_an_offset_must_be_finite(offset):
    """gamma = offset + weight: NaN or infinite throughout, an output of NaN, taken without a
    word by the function, the module and set_modes."""
    with pytest.raises(ValueError, match="offset: expected a finite number"):
        normbook.rms_norm(torch.randn(2, 8), 8, torch.ones(8), offset=offset)
    with pytest.raises(ValueError, match="offset: expected a finite number"):
        normbook.RMSNorm(8, offset=offset)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("shape", [8.0, (8.0,), True, "tensor"])
def test_round_xhat_refuses_a_normalized_shape_torch_refuses(backend, shape):
    """The fused round_xhat path compared normalized_shape with ``in (D, (D,), [D])``: 8.0,
    (8.0,), tensor(8) and True (D = 1) were taken on the kernels, where torch refuses them."""
    D = 1 if shape is True else 8
    shape = torch.tensor(8) if shape == "tensor" else shape
    x, w = torch.randn(3, D, dtype=torch.float16), torch.ones(D, dtype=torch.float16)
    with normbook.backend(backend), pytest.raises(TypeError, match="normalized_shape: expected"):
        normbook.rms_norm(x, shape, w, round_xhat=True)


def test_upcast_ops_takes_a_tensor_eps():
    """eps as a 0-d tensor, which every other upcast takes, was refused with "upcast='ops'":
    'eps: expected a real number or a 0-d tensor, got tensor(0.0010)'."""
    x = torch.randn(3, 8)
    want = normbook.layer_norm(x, 8, eps=1e-3, upcast="ops")
    assert torch.equal(normbook.layer_norm(x, 8, eps=torch.tensor(1e-3), upcast="ops"), want)
    assert torch.equal(normbook.LayerNorm(8, eps=torch.tensor(1e-3), upcast="ops")(x),
                       normbook.LayerNorm(8, eps=1e-3, upcast="ops")(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_round_xhat_compiles_whole_with_dynamic_shapes(dtype):
    """torch.compile(dynamic=True) makes the default offset (0.0) a symbolic float, and the
    finiteness check took math.isfinite of it, which Dynamo cannot trace: "torch.* op returned
    non-Tensor" under fullgraph, for rms_norm(..., round_xhat=True) and RMSNorm(round_xhat=True),
    where torch's own norm compiles. Two batch shapes, one graph, eager's values."""
    w = torch.randn(D).to(dtype)
    module = normbook.RMSNorm(D, eps=EPS, round_xhat=True, dtype=dtype)
    for fn in (lambda t: normbook.rms_norm(t, D, w, EPS, round_xhat=True), module,
               lambda t: normbook.rms_norm(t, D, w, EPS, offset=1.0, round_xhat=True)):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
        for rows in (3, 5):
            x = torch.randn(2, rows, D).to(dtype)
            torch.testing.assert_close(compiled(x), fn(x), rtol=0, atol=0)
