"""What Triton's interpreter hides: behaviour that differs between the CPU interpreter and a GPU.

- rsqrt on a GPU (rsqrt.approx.ftz) flushes a subnormal argument to zero: with eps = 0 and a
  near-constant row, var + eps is subnormal and rstd would be inf. The kernels take the sum of
  squares of such a row again scaled by 2^64 (exact), so rsqrt sees a normal argument; the
  output is finite and right (checked everywhere, and against float64 in
  test_functional_parity). (0 stays 0: a constant row at eps = 0 gives torch's NaN.)
- A GPU rounds fp32 -> bf16 to nearest even; Triton's interpreter as shipped truncates, and
  normbook makes it round as a GPU does (normbook.kernels._interpret.install_rounding). Checked
  on both: almost every bf16 output is the correctly rounded reference, and the fused round_xhat
  is the composition bit for bit.
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
    x64 = x.double()
    y64 = (torch.nn.functional.layer_norm(x64, (256,), eps=0.0) if norm == "layer"
           else torch.nn.functional.rms_norm(x64, (256,), eps=0.0))
    assert (y.double() - y64).abs().max() < 1e-5 * y64.abs().max()     # and right


@pytest.mark.gpu_too
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_bf16_outputs_round_to_nearest(norm):
    """bf16 y is the fp32 result rounded to nearest: it equals the correctly rounded float64
    reference except where the fp32 arithmetic sits within its own error of a rounding boundary
    (well under 5% of values; truncation would miss about half)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1024, generator=g).to(DEVICE, torch.bfloat16)
    if norm == "layer":
        y = K.layer_norm(x, 1024)
        y64 = reference.layer_norm_forward(x.double(), None, None, 1e-5)[0]
    else:
        y = K.rms_norm(x, 1024, eps=1e-5)
        y64 = reference.rms_norm_forward(x.double(), None, 1e-5)[0]
    miss = (y != y64.to(torch.bfloat16)).float().mean().item()
    assert miss < 0.05, f"{miss:.1%} of bf16 outputs are not the correctly rounded reference"


@pytest.mark.gpu_too
@pytest.mark.parametrize("D", [2048, 8192])
def test_bf16_round_xhat_fused_is_the_composition_bit_for_bit(D):
    """bf16 rounds to nearest (a GPU, and the interpreter as normbook sets it), so the fused
    round_xhat (xhat rounded in the kernel, then the weight) gives the bits of the norm without
    a weight followed by torch's multiplication: the same statistics, the same two roundings."""
    import normbook

    g = torch.Generator().manual_seed(D)
    M = 512 if DEVICE == "cuda" else 16        # (the interpreter runs every program)
    x = torch.randn(M, D, generator=g).to(DEVICE, torch.bfloat16)
    w = (1 + torch.randn(D, generator=g) / 4).to(DEVICE, torch.bfloat16)
    with normbook.backend("kernels"):           # (CPU tensors: the interpreter's kernels)
        y = normbook.rms_norm(x, D, w, 1e-6, round_xhat=True)
        assert torch.equal(y, w * normbook.rms_norm(x, D, None, 1e-6))


@pytest.mark.gpu_too
def test_bf16_round_xhat_batches_of_every_size_in_turn():
    """round_xhat's launches, batch after batch of one width (on a GPU the first launch of
    each plan measures its kernel and sizes its grid; a batch of at most 8 rows is one
    program): y the composition's bits, every gradient within the composition's rounding (it
    rounds dy * w first)."""
    import normbook

    D = 1024
    big = 4096 if DEVICE == "cuda" else 64       # (the interpreter runs every program)
    g = torch.Generator().manual_seed(3)
    w = (1 + torch.randn(D, generator=g) / 4).to(DEVICE, torch.bfloat16).requires_grad_()
    for M in (big, 4, 8, big, 100):
        x = torch.randn(M, D, generator=g).to(DEVICE, torch.bfloat16).requires_grad_()
        dy = torch.randn(M, D, generator=g).to(DEVICE, torch.bfloat16)
        with normbook.backend("kernels"):
            y = normbook.rms_norm(x, D, w, 1e-6, round_xhat=True)
            composed = w * normbook.rms_norm(x, D, None, 1e-6)
            assert type(y.grad_fn).__name__ == "_RoundXhatBackward", y.grad_fn   # fused
            assert torch.equal(y, composed), M
            got = torch.autograd.grad(y, (x, w), dy)
            want = torch.autograd.grad(composed, (x, w), dy)
        for a, b in zip(got, want):
            bound = 8 * torch.finfo(torch.bfloat16).eps * b.float().abs().max()
            assert (a.float() - b.float()).abs().max() <= bound, M


# ----------------------------------------------------------------------------- launches and graphs

def _train_step(norms, x, dy):
    """y and every gradient of one forward+backward through each norm of ``norms`` on x."""
    out = []
    for norm in norms:
        xi = x.detach().requires_grad_()
        y = norm(xi)
        grads = torch.autograd.grad(y, (xi, *norm.parameters()), dy)
        out += [y, *grads]
    return out


def _norms(D):
    import normbook

    return [normbook.LayerNorm(D, device="cuda", dtype=torch.bfloat16),
            normbook.RMSNorm(D, device="cuda", dtype=torch.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 4096, 16384])
def test_gpu_direct_launch_is_bitwise_triton_s(D):
    """The kept compiled kernels launched directly (normbook.kernels._launch) give the bits of
    Triton's own launch path, forward and backward, the finish kernel and (D = 16384) the rows
    shared among programs included."""
    from normbook.kernels import _launch

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, D, device="cuda", generator=g).bfloat16()
    dy = torch.randn(512, D, device="cuda", generator=g).bfloat16()
    norms = _norms(D)
    direct = [_train_step(norms, x, dy) for _ in range(2)][-1]      # the second is direct
    assert _launch.compiled_variants() > 0
    saved = _launch._DIRECT
    _launch._DIRECT = False
    try:
        jit = _train_step(norms, x, dy)
    finally:
        _launch._DIRECT = saved
    for a, b in zip(direct, jit):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [4096, 16384])
def test_gpu_eager_route_replays_in_a_cuda_graph(D):
    """A CUDA graph captures the eager kernel route, forward and backward of both modules, after
    one warm-up (the first call of a shape compiles and plans), and its replays on new data give
    eager's bits. At D = 16384 the backward shares rows: its captured slots are its own, zeroed
    in the graph, while the eager calls between replays use the stream's kept slots."""
    norms = _norms(D)
    g = torch.Generator(device="cuda").manual_seed(1)
    static_x = torch.randn(4, D, device="cuda", generator=g).bfloat16()
    static_dy = torch.randn(4, D, device="cuda", generator=g).bfloat16()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _train_step(norms, static_x, static_dy)          # warm-up, outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _train_step(norms, static_x, static_dy)
    for _ in range(2):
        static_x.copy_(torch.randn(4, D, device="cuda", generator=g))
        static_dy.copy_(torch.randn(4, D, device="cuda", generator=g))
        graph.replay()
        for a, b in zip(static_out, _train_step(norms, static_x, static_dy)):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [4096, 16384])
def test_gpu_reduce_overhead_mode_matches_eager(D):
    """torch.compile(mode="reduce-overhead") (CUDA graphs over the compiled graph, the custom ops
    inside) of a module: forward and backward as eager, over several steps (D = 16384: the
    backward's shared rows, with slots kept per stream when eager and its own when captured)."""
    import normbook

    norm = normbook.RMSNorm(D, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(norm, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(2)
    for _ in range(3):
        x = torch.randn(8, D, device="cuda", generator=g).bfloat16().requires_grad_()
        y = compiled(x)
        (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        x2 = x.detach().requires_grad_()
        y2 = norm(x2)
        (gx2,) = torch.autograd.grad(y2, x2, torch.ones_like(y2))
        torch.testing.assert_close(y, y2)
        torch.testing.assert_close(gx, gx2)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 4096])
def test_gpu_a_ready_call_is_bitwise_the_launchers(D):
    """The door's fast path (normbook.kernels._ready): a signature's first call runs the
    launchers and makes it ready, the next ones launch the kept kernels directly. Both give the
    same bits: modules (whose later calls launch the ready call each keeps, past its guard),
    the fused residual add with and without a gradient at h, and no_grad."""
    import normbook
    from normbook.kernels import _launch

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(300, D, device="cuda", generator=g).bfloat16()
    r = torch.randn(300, D, device="cuda", generator=g).bfloat16()
    dy = torch.randn(300, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(D, device="cuda", generator=g).bfloat16()
    norms = _norms(D)

    def fused(dh: bool):
        xi, ri, wi = (t.detach().requires_grad_() for t in (x, r, w))
        y, h = normbook.add_rms_norm(xi, ri, wi)
        loss = (y * dy).sum() + ((h * dy).sum() if dh else 0)
        return [y, h, *torch.autograd.grad(loss, (xi, ri, wi))]

    def no_grad():
        with torch.no_grad():
            return [normbook.layer_norm(x, D, w)]

    steps = [lambda: _train_step(norms, x, dy), lambda: fused(True), lambda: fused(False),
             no_grad]
    _launch.forget_ready()          # the first calls: through the launchers
    first = [step() for step in steps]
    assert len(_launch.READY) >= 3
    for _ in range(2):
        for a, b in zip(first, [step() for step in steps]):
            for s, t in zip(a, b):
                assert torch.equal(s, t)
