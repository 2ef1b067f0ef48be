"""normbook.rms_norm's offset and round_xhat, and normbook.RMSNorm's: the operations of the
Hugging Face norms they reproduce (Gemma's ``(xhat * (1.0 + weight.float())).type_as(x)``,
Llama's ``weight * xhat.to(input_dtype)``), written out here in torch ops, bit for bit on the
torch backend in float32, bfloat16 and float16, forward and backward (the gradient of the
written-out form by autograd); within a unit of rounding on the kernels (Triton's interpreter
truncates bf16 stores where a GPU rounds them). The Hugging Face classes themselves are
compared in tests/test_swap.py."""

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
    with pytest.raises(TypeError, match="offset or round_xhat"):
        torch.jit.script(normbook.RMSNorm(8, round_xhat=True))
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
