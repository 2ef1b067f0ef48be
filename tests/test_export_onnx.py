"""ONNX export of models with normbook's norms, run by onnxruntime.

``torch.onnx.export(..., dynamo=True)`` (torch's default exporter) records torch's own norms,
which ONNX has as single operators: the kernels' custom op has no ONNX translation, and the
torch backend's formulas became some 30 operators a norm. The TorchScript exporter
(``dynamo=False``) records what ``torch.jit.trace`` does.
"""

from __future__ import annotations

import collections
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F

import normbook

pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

D = 32


class _Block(torch.nn.Module):
    """Both norms and both fused adds, as a pre-norm block uses them."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = normbook.LayerNorm(D)
        self.rms = normbook.RMSNorm(D)
        self.proj = torch.nn.Linear(D, D)
        for p in (self.ln.weight, self.ln.bias, self.rms.weight):
            torch.nn.init.normal_(p)

    def forward(self, x):
        y, h = normbook.add_layer_norm(x, self.proj(self.ln(x)), self.ln.weight, self.ln.bias)
        y, h = normbook.add_rms_norm(h, self.proj(y), self.rms.weight)
        return self.rms(h + y)


def _run(path, x):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])


def _ops(path):
    import onnx
    return collections.Counter(node.op_type for node in onnx.load(str(path)).graph.node)


@pytest.fixture(autouse=True)
def _quiet():
    # the exporter's progress lines and its notes on torchvision's absent ops
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_dynamo_export_records_the_onnx_norms_and_runs(backend, request, tmp_path):
    """On either backend (the kernels are every CUDA tensor's default) the exported model holds
    one LayerNormalization or RMSNormalization a norm, nothing of normbook's, runs in
    onnxruntime at a batch it was not exported with, and gives eager's result."""
    if backend == "kernels":
        request.getfixturevalue("kernels")
    model = _Block().eval()
    x = torch.randn(2, 5, D)
    path = tmp_path / "block.onnx"
    batch = torch.export.Dim("batch")
    with normbook.backend(backend):
        torch.onnx.export(model, (x,), path, dynamo=True, opset_version=23, verbose=False,
                          dynamic_shapes=({0: batch},))
    ops = _ops(path)
    assert ops["LayerNormalization"] == 2 and ops["RMSNormalization"] == 2, ops
    assert not {"ReduceMax", "IsInf", "Where"} & set(ops), ops   # not the formulas
    x = torch.randn(3, 5, D)
    with torch.no_grad():
        torch.testing.assert_close(_run(path, x), model(x), atol=1e-5, rtol=1e-5)


def test_dynamo_export_of_parameters_in_another_dtype_runs_the_formulas(tmp_path):
    """ONNX's norms take x's dtype for the weight: fp16 rows with fp32 parameters (torch
    refuses them on the CPU; normbook computes in fp32 and rounds once) keep the formulas, and
    the exported model gives eager's result."""
    w, b = torch.randn(D), torch.randn(D)
    x = (torch.randn(4, D) * 3).half()
    path = tmp_path / "mixed.onnx"
    torch.onnx.export(_Fn(lambda x: normbook.layer_norm(x, (D,), w, b)), (x,), path,
                      dynamo=True, verbose=False)
    assert "LayerNormalization" not in _ops(path)
    torch.testing.assert_close(_run(path, x), normbook.layer_norm(x, (D,), w, b))


def test_torchscript_export_of_a_norm_over_several_dims(tmp_path):
    """The TorchScript exporter traces: a norm over (4, 8) exported at one batch runs at
    another (the trace held aten's _unsafe_view, which this exporter refused)."""
    model = torch.nn.Sequential(normbook.LayerNorm((4, 8)), normbook.RMSNorm((4, 8))).eval()
    path = tmp_path / "several.onnx"
    torch.onnx.export(model, (torch.randn(2, 4, 8),), path, dynamo=False,
                      input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    x = torch.randn(5, 4, 8)
    with torch.no_grad():
        expected = F.rms_norm(F.layer_norm(x, (4, 8)), (4, 8))
    torch.testing.assert_close(_run(path, x), expected, atol=1e-5, rtol=1e-5)


class _Fn(torch.nn.Module):
    """A function as a module, for the exporter."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)
