"""normbook.kernels.minimal, the chapter's first kernels, against the float64 reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from normbook import reference  # noqa: E402
from normbook.kernels import minimal  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("M,D", [(1, 1), (7, 3), (5, 100), (3, 1000), (0, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_minimal_matches_reference(M, D, dtype):
    g = torch.Generator().manual_seed(M * 1000 + D)
    x = (3 * torch.randn(M, D, generator=g) + 1).to(dtype)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    b = (0.1 * torch.randn(D, generator=g)).to(dtype)
    dy = torch.randn(M, D, generator=g).to(dtype)
    x, w, b, dy = (t.to(DEVICE) for t in (x, w, b, dy))
    y, mean, rstd = minimal.layer_norm_forward(x, w, b, 1e-5)
    y64, mean64, rstd64 = reference.layer_norm_forward(x.double(), w.double(), b.double(), 1e-5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2 * max(1.0, float(y64.abs().max()) if M else 1.0)
    assert y.dtype == dtype and mean.dtype == rstd.dtype == torch.float32
    torch.testing.assert_close(y.double(), y64, rtol=0, atol=tol)
    torch.testing.assert_close(mean.double(), mean64, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rstd.double(), rstd64, rtol=1e-5, atol=0)
    dx, dw, db = minimal.layer_norm_backward(dy, x, w, mean, rstd)
    dx64, dw64, db64 = reference.layer_norm_backward(dy.double(), x.double(), w.double(), mean64, rstd64)
    assert dx.dtype == dtype and dw.dtype == db.dtype == torch.float32
    torch.testing.assert_close(dx.double(), dx64, rtol=0, atol=tol * max(1.0, float(rstd64.max()) if M else 1.0))
    torch.testing.assert_close(dw.double(), dw64, rtol=0, atol=1e-4 * max(M, 1))
    torch.testing.assert_close(db.double(), db64, rtol=0, atol=1e-4 * max(M, 1))


def test_minimal_errors_name_the_argument():
    x = torch.randn(4, 8, device=DEVICE)
    w, b = torch.ones(8, device=DEVICE), torch.zeros(8, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight: expected .*\(8,\), got \(7,\)"):
        minimal.layer_norm_forward(x, w[:7], b)
    with pytest.raises(ValueError, match=r"x: expected .*strided"):
        minimal.layer_norm_forward(torch.randn(8, 4, device=DEVICE).t(), w[:4] * 0 + 1, b[:4])
    with pytest.raises(ValueError, match=r"D: expected 1 <= D <= 8192.*got 8193"):
        minimal.layer_norm_forward(torch.randn(1, 8193, device=DEVICE), torch.ones(8193), torch.zeros(8193))
    y, mean, rstd = minimal.layer_norm_forward(x, w, b)
    with pytest.raises(ValueError, match=r"rstd: expected .*\(4,\), got \(3,\)"):
        minimal.layer_norm_backward(x, x, w, mean, rstd[:3])
    # what a kernel would read wrongly, or Python would fail on with no name
    with pytest.raises(TypeError, match=r"^bias: expected a tensor of shape \(8,\), got NoneType$"):
        minimal.layer_norm_forward(x, w, None)
    with pytest.raises(TypeError, match=r"^x: expected a floating-point dtype, got torch.int64$"):
        minimal.layer_norm_forward(x.long(), w, b)
    with pytest.raises(TypeError, match=r"^x: expected a tensor \(M, D\), got list$"):
        minimal.layer_norm_forward(x.tolist(), w, b)
    with pytest.raises(ValueError, match=r"^weight: expected a tensor on x's device \S+, got meta$"):
        minimal.layer_norm_forward(x, w.to("meta"), b)


COMPILE = """
import json
from normbook.kernels import minimal, report
out = {}
for kernel in (minimal.ln_fwd_kernel, minimal.ln_bwd_kernel):
    row = report.compile_one(kernel, dict(BLOCK_D=4096), dict(num_warps=8), "bf16", 90, D=4096)
    out[kernel.__name__ if hasattr(kernel, "__name__") else kernel.fn.__name__] = row
print(json.dumps(out))
"""


def test_minimal_kernels_compile_for_sm90():
    """They are real kernels: compiled for Hopper (no GPU needed), no spills, 128-bit loads."""
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 2
    for row in rows.values():
        assert row["spill_bytes"] == 0 and row["load_bits"] == 128, row


def test_a_cpu_tensor_without_the_interpreter_is_named():
    """Triton's "0 active drivers" was all a CPU user without TRITON_INTERPRET=1 got."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = ("import torch\n"
              "from normbook.kernels import minimal\n"
              "try:\n"
              "    minimal.layer_norm_forward(torch.randn(4, 8), torch.ones(8), torch.zeros(8))\n"
              "except ValueError as e:\n"
              "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("x: expected a CUDA tensor, got one on cpu while Triton's "
                               "interpreter is off")
