"""Calls of many signatures, one after another, on the kernel backend.

The launchers keep things between calls: plans cached by their arguments, kept kernels, the
sharing backward's slot buffers and epochs, the front door's ready signatures. A key that
leaves out something the launch depends on lets one call's choice serve the next: the
``round_xhat`` plans were once kept by their flags alone, and a batch of 4 rows after one of
64 wrote past the end of dweight. Fixed cases test the calls one by one; here hypothesis draws
sequences of calls that differ in what a key might forget (the op and its modes, dtypes, the
number and shape of the rows, D, which parameters there are, the layout and alignment of
the input, gradients or none, which outputs the backward starts from) and checks each call,
forward and gradients, against the same call in float64 on the torch backend, within the
three-way bound of the kernels' tests (:func:`helpers.assert_within_torch`: the torch backend
in the call's own dtype gives the base error). Each call runs twice on the kernels, and the two
must agree bit for bit: on a GPU the second call of a signature takes the front door's fast
path (its kept kernels, :mod:`normbook.kernels._ready`), the first the launchers.

The sequences are derandomized (the same on every run); a failure prints the shortest
sequence hypothesis finds.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import pytest
import torch
from helpers import DEVICE, assert_within_torch

hypothesis = pytest.importorskip("hypothesis")   # (the GPU machine has it from make gpu-wheels)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import normbook  # noqa: E402

pytestmark = pytest.mark.usefixtures("kernels")

OPS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "rms_round_xhat",
       "rms_offset", "LayerNorm", "RMSNorm")
HALF = (torch.bfloat16, torch.float16)
# widths: one value, odd, a tile of several rows, a row a program, the widest row the
# backward takes whole (8192), and one past it (shared among programs that exchange sums)
WIDTHS = (1, 7, 64, 200, 1024, 8192, 8200)


class Call(NamedTuple):
    op: str
    dtype: torch.dtype
    param_dtype: Optional[torch.dtype]   # None: no weight (nor bias)
    bias: bool
    lead: tuple                          # the leading dims: (M,) or (2, M)
    D: int
    layout: str                          # dense, strided rows, or one element off alignment
    grad: bool
    outputs: str                         # the add ops: the backward starts from y, h or both
    eps: Optional[float]                 # None: the default (rms ops only)
    seed: int


@st.composite
def calls(draw) -> Call:
    op = draw(st.sampled_from(OPS))
    dtype = draw(st.sampled_from(HALF if op == "rms_round_xhat" else
                                 (torch.float32, *HALF)))
    modules = op in ("LayerNorm", "RMSNorm")
    # (a module, and the offset, which is added to a weight, always have one)
    param_dtype = draw(st.sampled_from((dtype, torch.float32) if modules or op == "rms_offset"
                                       else (dtype, torch.float32, None)))
    D = draw(st.sampled_from(WIDTHS))
    # the interpreter runs every program: keep a call to a few tens of thousands of values
    M = draw(st.integers(1, 3 if D > 1024 else 40))
    lead = draw(st.sampled_from(((M,), (2, M))))
    rms = "rms" in op or op == "RMSNorm"
    return Call(op=op, dtype=dtype, param_dtype=param_dtype,
                bias=not rms and param_dtype is not None and draw(st.booleans()),
                lead=lead, D=D, layout=draw(st.sampled_from(("dense", "strided", "misaligned"))),
                grad=draw(st.booleans()),
                outputs=draw(st.sampled_from(("y", "h", "both"))) if op.startswith("add") else "y",
                eps=draw(st.sampled_from((None, 1e-5) if rms else (1e-5, 1e-3))),
                seed=draw(st.integers(0, 2**16)))


def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """t's values in the given layout: dense; rows 8 values apart (a slice of wider rows);
    or dense but one element past a 16-byte boundary."""
    if layout == "strided":
        wide = t.new_zeros(*t.shape[:-1], t.shape[-1] + 8)
        wide[..., : t.shape[-1]] = t
        return wide[..., : t.shape[-1]]
    if layout == "misaligned":
        flat = t.new_zeros(t.numel() + 1)
        flat[1:] = t.reshape(-1)
        return flat[1:].view(t.shape)
    return t


def _inputs(c: Call):
    """The call's tensors, float64 masters: x, residual, weight, bias, dy, dh (None where the
    call has none)."""
    g = torch.Generator().manual_seed(c.seed)
    shape = (*c.lead, c.D)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5
    r = torch.randn(shape, generator=g, dtype=torch.float64) if c.op.startswith("add") else None
    w = None if c.param_dtype is None else 1 + 0.5 * torch.randn(c.D, generator=g,
                                                                  dtype=torch.float64)
    b = 0.5 * torch.randn(c.D, generator=g, dtype=torch.float64) if c.bias else None
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    dh = torch.randn(shape, generator=g, dtype=torch.float64)
    return x, r, w, b, dy, dh


def _run(c: Call, backend: str, dtype: torch.dtype, param_dtype):
    """(outputs, gradients) of the call on ``backend`` with its tensors in ``dtype`` (the
    parameters in ``param_dtype``); the gradients of x, the residual, weight and bias (None
    where absent), or an empty list without gradients."""
    x, r, w, b, dy, dh = (None if t is None else t.to(DEVICE) for t in _inputs(c))
    eps = c.eps if c.eps is not None or dtype is not torch.float64 else \
        torch.finfo(torch.float32).eps      # the default of the call's own dtype
    x = _laid_out(x.to(dtype), c.layout).requires_grad_(c.grad)
    r = None if r is None else r.to(dtype).requires_grad_(c.grad)
    w = None if w is None else w.to(param_dtype).requires_grad_(c.grad)
    b = None if b is None else b.to(param_dtype).requires_grad_(c.grad)
    with normbook.backend(backend), torch.set_grad_enabled(c.grad):
        if c.op == "layer_norm":
            outs = (normbook.layer_norm(x, c.D, w, b, eps),)
        elif c.op in ("rms_norm", "rms_round_xhat", "rms_offset"):
            outs = (normbook.rms_norm(x, c.D, w, eps, offset=1.0 if c.op == "rms_offset" else 0.0,
                                      round_xhat=c.op == "rms_round_xhat"),)
        elif c.op == "add_layer_norm":
            outs = normbook.add_layer_norm(x, r, w, b, eps)
        elif c.op == "add_rms_norm":
            outs = normbook.add_rms_norm(x, r, w, eps)
        else:
            cls = normbook.LayerNorm if c.op == "LayerNorm" else normbook.RMSNorm
            kwargs = dict(bias=c.bias) if c.op == "LayerNorm" else {}
            module = cls(c.D, eps=eps, dtype=param_dtype, device=DEVICE, **kwargs)
            with torch.no_grad():
                module.weight.copy_(w)
                if c.bias:
                    module.bias.copy_(b)
            w, b = module.weight, module.bias if c.bias else None
            outs = (module(x),)
        if not c.grad:
            return outs, []
        used = {"y": outs[:1], "h": outs[1:], "both": outs}[c.outputs]
        seeds = {"y": (dy,), "h": (dh,), "both": (dy, dh)}[c.outputs]
        wrt = [t for t in (x, r, w, b) if t is not None]
        got = torch.autograd.grad(used, wrt, [s.to(dtype) for s in seeds], allow_unused=True)
        it = iter(got)
        return outs, [None if t is None else next(it) for t in (x, r, w, b)]


def _check(c: Call) -> None:
    param_dtype = c.param_dtype
    got_y, got_g = _run(c, "kernels", c.dtype, param_dtype)
    again_y, again_g = _run(c, "kernels", c.dtype, param_dtype)
    for name, first, second in zip(("y", "h", "dx", "dresidual", "dweight", "dbias"),
                                   (*got_y, *[None] * (2 - len(got_y)), *got_g),
                                   (*again_y, *[None] * (2 - len(again_y)), *again_g)):
        assert (first is None and second is None) or torch.equal(first, second), \
            f"{name} of {c}: a second call gave other bits"
    base_y, base_g = _run(c, "torch", c.dtype, param_dtype)
    ref_y, ref_g = _run(c, "torch", torch.float64, torch.float64)
    M = ref_y[0].numel() // c.D
    for name, got, base, ref in zip(("y", "h"), got_y, base_y, ref_y):
        assert_within_torch(got, base, ref.detach(), name=f"{name} of {c}")
    for name, got, base, ref in zip(("dx", "dresidual", "dweight", "dbias"), got_g, base_g, ref_g):
        if ref is None:
            assert got is None, f"{name} of {c}: {got} where the reference has none"
            continue
        rows = M if name in ("dweight", "dbias") else 1
        assert_within_torch(got, base, ref, name=f"{name} of {c}", sum_rows=rows)


_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=40, **_SETTINGS)
@given(sequence=st.lists(calls(), min_size=3, max_size=6))
def test_calls_in_turn_each_match_the_float64_reference(sequence):
    for c in sequence:
        _check(c)


@pytest.mark.gpu
@settings(max_examples=30, **_SETTINGS)
@given(sequence=st.lists(calls(), min_size=3, max_size=8))
def test_calls_in_turn_on_a_gpu(sequence):
    """The same on a GPU, longer: compiled kernels, their kept launches, and the fast path."""
    for c in sequence:
        _check(c)
