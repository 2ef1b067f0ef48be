"""Helpers shared by the test files (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import math

import torch


def grads(fn, dy, *inputs):
    """Forward ``fn`` on fresh leaves of ``inputs``, backward with ``dy``: (y, grads)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return y.detach(), [leaf.grad for leaf in leaves]


# ---- the kernels' tests: the device, inputs and the three-way accuracy bound ----------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5

# Allowance, in units of the dtype's machine epsilon at the scale of the reference: both
# implementations round each output to the dtype once (up to half an ulp), and a borderline value
# may round up in one and down in the other, so a kernel that computes at least as accurately as
# torch can still trail it by about one ulp; two ulps cover that.
ULPS = 2.0


def error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.double() - ref).abs().max().item() if ref.numel() else 0.0


def assert_within_torch(got, base, ref, *, name, sum_rows=1, extra=0.0):
    """error(got) <= 2 * error(base) + allowance; ``base`` is torch in the same dtype.

    ``sum_rows``: for dweight and dbias, sums over that many rows. The kernel adds them in another
    order than torch (per-program fp32 partials, then a sum of partials), and the rounding error
    of a sum of M terms grows like sqrt(M) (a random walk), so the allowance grows with it.
    ``extra``: an error both implementations share by design, added to the allowance.
    """
    assert got.dtype == base.dtype, f"{name}: dtype {got.dtype}, torch gives {base.dtype}"
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    scale = ref.abs().max().item() if ref.numel() else 0.0
    allow = ULPS * torch.finfo(got.dtype).eps * scale * math.sqrt(max(sum_rows, 1)) + extra
    e_got, e_base = error(got, ref), error(base, ref)
    assert e_got <= 2 * e_base + allow, (
        f"{name}: kernel error {e_got:.3e} > 2 * torch error {e_base:.3e} + allowance {allow:.3e}")


def make(M, D, dtype, seed=0, mean=0.5):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, D, generator=g) * 2 + mean).to(dtype)
    w = (1 + 0.5 * torch.randn(D, generator=g)).to(dtype)
    b = (0.5 * torch.randn(D, generator=g)).to(dtype)
    dy = torch.randn(M, D, generator=g).to(dtype)
    return (t.to(DEVICE) for t in (x, w, b, dy))
