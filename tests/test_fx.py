"""torch.fx: a model holding normbook's modules, or calling its functions, traces with
torch.fx.symbolic_trace as one holding torch's norms does, and torch.ao's fx quantization
prepares and converts it. Each norm is one node of the graph, a call of normbook's public
function (the door cannot check a tracer's Proxy), and the traced GraphModule computes what
the model computes, on either backend, and is saved and loaded as any GraphModule."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import normbook
from normbook import functional as F

D = 8


class Block(torch.nn.Module):
    """Every entry point: both modules, both functions, both fused adds (their (y, h) unpacked)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)
        self.ln, self.rms = normbook.LayerNorm(D), normbook.RMSNorm(D, eps=1e-6)
        self.w = torch.nn.Parameter(torch.rand(D) + 0.5)
        self.b = torch.nn.Parameter(torch.randn(D))

    def forward(self, x):
        h = self.rms(self.ln(self.lin(x)))
        h = normbook.layer_norm(h, (D,), self.w, self.b) + normbook.rms_norm(h, D, self.w)
        y, r = normbook.add_layer_norm(h, x, self.w, self.b)
        y2, r2 = normbook.add_rms_norm(y, r, self.w)
        return y2 + r2


def _calls(graph_module):
    return [n.target for n in graph_module.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_symbolic_trace_records_each_norm_as_one_call(backend, request):
    if backend == "kernels":
        request.getfixturevalue("kernels")       # (a skip without Triton)
    torch.manual_seed(0)
    model = Block()
    traced = torch.fx.symbolic_trace(model)
    calls = _calls(traced)
    assert [c for c in calls if getattr(c, "__module__", "") == "normbook.functional"] == [
        F.layer_norm, F.rms_norm, F.layer_norm, F.rms_norm, F.add_layer_norm, F.add_rms_norm]
    x = torch.randn(3, D)
    with normbook.backend(backend):
        assert torch.equal(traced(x), model(x))
        buf = io.BytesIO()
        torch.save(traced, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert torch.equal(loaded(x), model(x))


def test_the_kernels_functions_trace_too(kernels):
    K = kernels

    class M(torch.nn.Module):
        def forward(self, x, r):
            y, h = K.add_rms_norm(x, r)
            return K.layer_norm(y, D) + K.rms_norm(h, D) + K.add_layer_norm(x, r)[0]

    traced = torch.fx.symbolic_trace(M())
    assert {K.add_rms_norm, K.layer_norm, K.rms_norm, K.add_layer_norm} <= set(_calls(traced))
    x, r = torch.randn(2, D), torch.randn(2, D)
    assert torch.equal(traced(x, r), M()(x, r))


def test_a_plain_call_still_checks_its_arguments():
    """The Proxy branch is taken for a Proxy only: a bad plain call keeps its named error."""
    with pytest.raises(TypeError, match="input: expected a torch.Tensor"):
        normbook.layer_norm([1.0, 2.0], 2)
    with pytest.raises(TypeError, match="residual"):
        normbook.add_rms_norm(torch.randn(2, D), None)


def test_fx_quantization_prepares_and_converts():
    """torch.ao's post-training quantization through fx, as it runs on a model with torch's
    norms: prepare (observers inserted), calibrate, convert; the quantized model computes
    close to the float one, its normbook norms in float between dequantize and quantize."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D, D), normbook.LayerNorm(D),
                                torch.nn.Linear(D, D), normbook.RMSNorm(D)).eval()
    x = torch.randn(16, D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch.ao's deprecation notices
        prepared = prepare_fx(model, get_default_qconfig_mapping(), (x,))
        prepared(x)
        quantized = convert_fx(prepared)
    assert F.layer_norm in _calls(quantized) and F.rms_norm in _calls(quantized)
    assert (quantized(x) - model(x)).abs().max() < 0.2
