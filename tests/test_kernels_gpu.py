"""What Triton's interpreter hides: behaviour that differs between the CPU interpreter and a GPU.

- rsqrt on a GPU (rsqrt.approx.ftz) flushes a subnormal argument to zero: with eps = 0 and a
  near-constant row, var + eps is subnormal and rstd would be inf. The kernels clamp the
  argument to the smallest normal float; the output stays finite (checked everywhere).
- A GPU rounds fp32 -> bf16 stores to nearest even; the interpreter truncates. Checked on a GPU
  only (marked gpu): almost every bf16 output is the correctly rounded reference.
- Strided rows: see test_kernels_launchers.test_strided_rows_are_read_in_place (bitwise only in
  the interpreter and run to run).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import normbook.kernels as K  # noqa: E402
from normbook import reference  # noqa: E402
from helpers import DEVICE  # noqa: E402


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_subnormal_variance_stays_finite(norm):
    """Rows of size 1e-20: var ~ 1e-40 is subnormal in fp32; with eps = 0, rstd must not be inf."""
    g = torch.Generator().manual_seed(0)
    x = (1e-20 * torch.randn(4, 256, generator=g)).to(DEVICE)
    assert 0 < x.double().var(-1, unbiased=False).max() < torch.finfo(torch.float32).tiny
    y = K.layer_norm(x, 256, eps=0.0) if norm == "layer" else K.rms_norm(x, 256, eps=0.0)
    assert torch.isfinite(y).all()


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_bf16_outputs_round_to_nearest(norm):
    """On a GPU, bf16 y is the fp32 result rounded to nearest: it equals the correctly rounded
    float64 reference except where the fp32 arithmetic sits within its own error of a rounding
    boundary (well under 5% of values; truncation would miss about half)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1024, generator=g).to("cuda", torch.bfloat16)
    if norm == "layer":
        y = K.layer_norm(x, 1024)
        y64 = reference.layer_norm_forward(x.double(), None, None, 1e-5)[0]
    else:
        y = K.rms_norm(x, 1024, eps=1e-5)
        y64 = reference.rms_norm_forward(x.double(), None, 1e-5)[0]
    miss = (y != y64.to(torch.bfloat16)).float().mean().item()
    assert miss < 0.05, f"{miss:.1%} of bf16 outputs are not the correctly rounded reference"
