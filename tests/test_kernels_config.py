"""The kernel layer off the paths the accuracy tests walk: finite answers for rows near the top
of fp32's range on the shared forward, offsets that cannot wrap at 2^31, launches on the
tensor's own device, the environment switch read in any usual spelling when plans are made,
rows too wide for any plan refused clearly, and one plan for the launcher and the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

import normbook.kernels as K  # noqa: E402
from normbook import reference  # noqa: E402
from normbook.kernels import _backward, _config, _forward, _launch, _take  # noqa: E402
from helpers import DEVICE  # noqa: E402


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_wide_forward_is_finite_near_1e20(norm):
    """Rows of 1e20 + 1e19 N(0, 1), D = 32769 (fp32), on the forward that sweeps a row in
    chunks (the last one a column wide): each chunk's M2 overflows, and the rescue (two more
    sweeps, the sum taken on (x - mean) / max |x - mean|) gives the float64 reference's answer."""
    g = torch.Generator().manual_seed(0)
    D = 32769
    x = (1e20 + 1e19 * torch.randn(2, D, generator=g)).to(DEVICE)
    plan = _config.forward_plan(2, D, x.get_device(), 4, norm == "rms", False, False, False)[0]
    assert plan.kernel == "norm_fwd_loop_kernel" and D % plan.constexprs["BLOCK_D"] == 1
    if norm == "layer":
        y, y64 = K.layer_norm(x, D), reference.layer_norm_forward(x.double(), None, None, 1e-5)[0]
    else:
        y, y64 = K.rms_norm(x, D), reference.rms_norm_forward(x.double(), None, 1e-6)[0]
    assert torch.isfinite(y).all()
    # fp32 output of O(1) values: a few ulps of the largest, as the other overflow tests allow
    assert (y.double() - y64.to(y.device)).abs().max() < 64 * torch.finfo(torch.float32).eps * 4


@pytest.mark.parametrize("raw,on", [("0", False), ("false", False), ("Off", False), ("no", False),
                                    (" FALSE ", False), ("1", True), ("true", True), ("ON", True),
                                    ("yes", True), ("", True)])
def test_shared_rows_switch_accepts_the_usual_spellings(monkeypatch, raw, on):
    monkeypatch.setenv("NORMBOOK_SHARED_ROWS", raw)
    assert _take.shared_rows(65536) is on
    assert _take.shared_rows(1024) is False                # narrow rows never share


def test_shared_rows_switch_refuses_a_guess(monkeypatch):
    monkeypatch.setenv("NORMBOOK_SHARED_ROWS", "sometimes")
    with pytest.raises(ValueError, match=r"NORMBOOK_SHARED_ROWS: expected .* got 'sometimes'"):
        _take.shared_rows(65536)


def test_shared_rows_switch_takes_effect_after_plans_are_cached(monkeypatch):
    """Changed after a wide row's plan was made and cached, the switch still decides the next
    launch (the plan cache is keyed by it): off, rows wider than one program holds have no
    backward plan, the kernels do not take them and the backward's launcher refuses them (the
    forward shares no row: it takes them still)."""
    monkeypatch.delenv("NORMBOOK_SHARED_ROWS", raising=False)
    D = 20000
    x = torch.randn(3, D, device=DEVICE)

    def plan():
        return _config.backward_plan(3, D, x.get_device(), 4, False, False, True, True, 0,
                                     _take.shared_rows(D))
    K.layer_norm(x, D)
    assert plan()[0].slices > 1 and _take.kernels_take(D, 4, False, x.get_device())
    _, _, stats = _forward.norm_forward(x, None, None, None, 1e-5, False)
    monkeypatch.setenv("NORMBOOK_SHARED_ROWS", "off")
    assert plan() is None and not _take.kernels_take(D, 4, False, x.get_device())
    assert _take.kernels_take(_config.MAX_FUSED_D_BWD, 4, True, x.get_device())
    assert torch.equal(_forward.norm_forward(x, None, None, None, 1e-5, False)[2], stats)
    with pytest.raises(ValueError, match=r"D = 20000 .*wider than 8192.*NORMBOOK_SHARED_ROWS is off"):
        _backward.norm_backward(x, None, x, None, stats, None, False)


def test_narrow_rows_never_read_the_switch(monkeypatch):
    """kernels_take is called on every call: for rows one program holds it answers without
    looking at the environment (a bad value there would raise if it did)."""
    monkeypatch.setenv("NORMBOOK_SHARED_ROWS", "sometimes")
    assert _take.kernels_take(_config.MAX_FUSED_D_BWD, 2, False, -1)
    with pytest.raises(ValueError, match="NORMBOOK_SHARED_ROWS"):
        _take.kernels_take(_config.MAX_FUSED_D_BWD + 1, 2, False, -1)


@pytest.fixture
def few_cpu_slices(monkeypatch):
    """The interpreter shares rows among at most 8 slices: the rows too wide to share stay
    small enough to run."""
    monkeypatch.delenv("NORMBOOK_SHARED_ROWS", raising=False)
    monkeypatch.setattr(_config, "CPU_SLICES", 8)
    for cached in (_config.forward_plan, _config.backward_plan, _take._fits):
        cached.cache_clear()
    yield 8
    for cached in (_config.forward_plan, _config.backward_plan, _take._fits):
        cached.cache_clear()


def test_rows_too_wide_to_share_are_not_taken(few_cpu_slices):
    """fp32 slices are 2048 values backward: 8 of them hold rows of 16384, so 16385 has no
    backward plan, and the kernels do not take it; the forward holds 16384 in registers and
    sweeps wider rows in chunks, any D (it shares no row)."""
    bwd = _config.COOP_BYTES // 4
    assert _take.kernels_take(few_cpu_slices * bwd, 4, False, -1)
    assert not _take.kernels_take(few_cpu_slices * bwd + 1, 4, False, -1)
    # bf16 with the residual: 8 slices of 4096 both ways hold 32768
    assert _take.kernels_take(few_cpu_slices * 2 * bwd, 2, True, -1)
    assert not _take.kernels_take(few_cpu_slices * 2 * bwd + 1, 2, True, -1)
    for D, kernel in ((_config.MAX_FUSED_D_FWD, "norm_fwd_rows_kernel"),
                      (_config.MAX_FUSED_D_FWD + 1, "norm_fwd_loop_kernel"),
                      (1 << 24, "norm_fwd_loop_kernel")):
        for residual in (False, True):
            (plan,) = _config.forward_plan(1, D, -1, 4, False, residual, True, True)
            assert plan.kernel == kernel and plan.slices == 1


def test_launchers_refuse_rows_too_wide_by_name(few_cpu_slices):
    """The backward's launcher, called for rows that no plan takes, says which D and what the
    limit is."""
    if DEVICE != "cpu":
        pytest.skip("the interpreter's CPU_SLICES sets the limit here")
    x = torch.randn(2, 16400)                                     # 9 slices of 2048
    with pytest.raises(ValueError, match=r"norm_backward: rows of D = 16400 .*at most D = 16384"):
        _backward.norm_backward(x, None, x, None, torch.ones(2, 2), None, False)
    # the widest row both directions hold works, and agrees with the reference
    D = 16384                                                     # 8 slices backward
    x, w = torch.randn(2, D), torch.randn(D)
    y, _, stats = _forward.norm_forward(x, None, w, None, 1e-6, True)
    dy = torch.randn(2, D)
    dx, dw, _ = _backward.norm_backward(dy, None, x, w, stats, None, True)
    y64, rstd = reference.rms_norm_forward(x.double(), w.double(), 1e-6)
    dx64, dw64 = reference.rms_norm_backward(dy.double(), x.double(), w.double(), rstd)
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw.double(), dw64, rtol=1e-4, atol=1e-4)


def test_backward_of_narrow_strides_copies_rather_than_refuses(few_cpu_slices):
    """Odd row strides halve the backward's slices; a row that dense copies would fit (the
    promise of kernels_take, which plans for dense rows) is copied, not refused."""
    if DEVICE != "cpu":
        pytest.skip("the interpreter's CPU_SLICES sets the limit here")
    D = 16384                                                     # 8 slices of 2048, fp32
    x, dy = torch.randn(2, D + 3)[:, :D], torch.randn(2, D)
    assert _config.backward_plan(2, D, -1, 4, True, False, False, False, x.stride(0) & 15) is None
    _, _, stats = _forward.norm_forward(x, None, None, None, 1e-6, True)
    dx, _, _ = _backward.norm_backward(dy, None, x, None, stats, None, True)
    want, _, _ = _backward.norm_backward(dy, None, x.contiguous(), None, stats, None, True)
    assert torch.equal(dx, want)


def test_the_unshared_exchange_reads_a_row_many_times():
    """kernels_take's argument, by the model: launched without the cooperative guarantee, a
    row of twice the resident slices is read over a hundred times (an H200: 264 resident
    slices of the backward): more than twice the passes of autograd through the composed
    torch ops, forward and backward together."""
    from normbook.bench import counting, model

    cfg = _config.backward_config(1, 1 << 22)
    resident = _config.resident_per_sm(cfg) * model.H200["sms"]
    assert resident == 264
    assert model.unshared_reads(resident, resident) == 1
    reads = model.unshared_reads(2 * resident, resident)
    fwd, bwd = counting.count("naive", "layer_norm")
    assert reads > 100 and reads > 2 * (fwd[1] + bwd[1])


class _Seen:
    """Stands in for the kernels of a launcher's module: records the kernel names launched."""

    def __init__(self, name, seen):
        self.name, self.seen = name, seen

    def __getitem__(self, grid):
        def launch(*args, **flags):
            self.seen.append((self.name, grid, {k: v for k, v in flags.items()}))
        return launch


@pytest.mark.parametrize("D", [64, 3000, 9000, 40000, 70000])
def test_report_and_launchers_use_one_plan(monkeypatch, D):
    """For rows of several widths, what the compile report compiles for a device is what the
    launchers launch on it: kernel names, grids and flags (the launchers, captured, run on
    the interpreter's plans; the report plans for the interpreter's device here)."""
    from normbook.kernels import report

    seen = []
    for mod in (_forward, _backward):
        for name in dir(mod):
            if name.endswith("_kernel"):
                monkeypatch.setattr(mod, name, _Seen(name, seen))
    M = 5
    x, w, b = torch.randn(M, D), torch.randn(D), torch.randn(D)
    for is_rms in (False, True):
        seen.clear()
        _, _, stats = _forward.norm_forward(x, x, w, None if is_rms else b, 1e-5, is_rms)
        _backward.norm_backward(x, x, x, w, stats, None if is_rms else b.dtype, is_rms)
        plans = report.launches(D, is_rms, True, "fp32", M=M, sms=0)
        assert [(p.kernel, p.grid, p.flags) for p in plans] == seen
        names = {p.kernel for p in plans}
        assert names <= {"norm_fwd_rows_kernel", "norm_fwd_loop_kernel", "norm_bwd_rows_kernel",
                         "norm_bwd_coop_kernel", "norm_bwd_finish_kernel"}


def test_launches_switch_to_the_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device: a launcher for tensors on another device
    makes theirs current first (checked on a machine with two GPUs by the test below)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _launch.other_device(1) and not _launch.other_device(0)
    assert not _launch.other_device(-1)                      # the CPU: nothing to switch


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensor_on_another_device_runs_there():
    x = torch.randn(64, 4096, device="cuda:1", requires_grad=True)
    w = torch.randn(4096, device="cuda:1", requires_grad=True)
    with torch.cuda.device(0):
        y = K.layer_norm(x, 4096, w)
        y.backward(torch.ones_like(y))
    with torch.cuda.device(1):
        y1 = K.layer_norm(x.detach(), 4096, w.detach())
    torch.testing.assert_close(y, y1)
    assert x.grad.device == x.device and torch.isfinite(x.grad).all()


# int32 offsets: compiled (not interpreted) in a fresh process, as the compile report does
LINT = textwrap.dedent("""
    import json, os, sys
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from normbook.kernels import report
    sys.path.insert(0, sys.argv[1])
    from planted import planted_kernel

    def ttir(kernel, constexprs, D):
        fn = report._jit(kernel)
        sig, attrs = report.signature(fn, "bf16", constexprs, D)
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=8)).asm["ttir"]

    out = {"planted": report.int32_offsets(ttir(planted_kernel, dict(BLOCK_D=64), 64))}
    for D in (1024, 9000, 65536):    # whole rows both ways; shared backward; shared both ways
        for plan in report.launches(D, False, True):
            out[f"{plan.kernel} D={D}"] = report.int32_offsets(ttir(report.kernel_of(plan),
                                                                   plan.constexprs, D))
    print(json.dumps(out))
""")

PLANTED = textwrap.dedent("""
    import triton
    import triton.language as tl

    @triton.jit
    def planted_kernel(X, DW, D, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        c = tl.arange(0, BLOCK_D)
        tl.store(DW + pid * D + c, tl.load(X + c))      # int32: wraps once programs x D >= 2^31
""")


@pytest.mark.slow                  # compiles every kernel for sm_90
def test_no_offset_wraps_at_2_31(tmp_path):
    """Every kernel a forward and a backward launch, at D in each regime: no int32 product of
    a program id and a size (``DW + pid * D`` once wrapped for programs x D >= 2^31 and wrote
    out of bounds). The check itself is shown to catch such a product in a planted kernel."""
    (tmp_path / "planted.py").write_text(PLANTED)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", LINT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    planted = found.pop("planted")
    assert len(planted) == 1 and planted[0].endswith(": i32") and "muli" in planted[0], planted
    assert len(found) == 9 and any("coop" in k for k in found), sorted(found)
    assert all(v == [] for v in found.values()), {k: v for k, v in found.items() if v}


# ----------------------------------------------------------------------------- the exchange

def _wide(norm, D, residual):
    """y, h and the gradients of one wide-row forward and backward (bf16, 2 rows)."""
    g = torch.Generator().manual_seed(D)
    x, r = (torch.randn(2, D, generator=g).to(DEVICE, torch.bfloat16).requires_grad_()
            for _ in range(2))
    w = torch.randn(D, generator=g).to(DEVICE, torch.bfloat16).requires_grad_()
    if norm == "layer":
        y, h = K.add_layer_norm(x, r if residual else torch.zeros_like(x), w, w)
    else:
        y, h = K.add_rms_norm(x, r if residual else torch.zeros_like(x), w)
    dy, dh = (torch.randn(2, D, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    torch.autograd.backward((y, h), (dy, dh))
    return [t.detach().clone() for t in (y, h, x.grad, w.grad)]


@pytest.mark.slow                  # wide rows in the interpreter
@pytest.mark.parametrize("norm,residual", [("layer", True), ("rms", False)])
def test_bounded_wait_runs_out_and_gives_the_same_bits(monkeypatch, norm, residual):
    """The interpreter runs a launch's programs one by one, so a wait of a few reads runs out
    on the first program of each row: it computes the missing slots itself, publishes them,
    and stops waiting for later rows; the later programs find their slots taken and use the
    winner's sums. The answer is bitwise the one of waits of 0 reads (the interpreter's
    default), in the backward (D = 40000 bf16 with the add: 10 slices, half as many as fp32
    for the interpreter to compute one program after another)."""
    if DEVICE != "cpu":
        pytest.skip("the interpreter's sequential programs are what make the wait run out")
    D = 40000
    plain = _wide(norm, D, residual)
    monkeypatch.setattr(_config, "CPU_POLLS", 3)
    _config.forward_plan.cache_clear()
    _config.backward_plan.cache_clear()
    try:
        plan = _config.backward_plan(2, D, -1, 2, norm == "rms", True, True, norm == "layer",
                                     0, True)[0]
        assert plan.flags["POLLS"] == 3 and plan.slices == 10
        waited = _wide(norm, D, residual)
    finally:
        _config.forward_plan.cache_clear()
        _config.backward_plan.cache_clear()
    for a, b, name in zip(waited, plain, ("y", "h", "dx", "dweight")):
        assert torch.equal(a, b), name


class _RefusingKernel:
    """Stands in for a Triton kernel on a GPU that refuses cooperative launches."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **flags):
            self.launches.append(dict(flags))
            if flags.get("launch_cooperative_grid"):
                raise RuntimeError("Triton Error [CUDA]: too many blocks in cooperative launch")
        return launch


def _plan_of(flags):
    """What launch_shared reads of a plan: its grid, flags and key."""
    return SimpleNamespace(grid=(8,), flags=flags, key=("a kernel", *flags.items()))


def test_a_refused_cooperative_launch_runs_without_it_once_warned(monkeypatch):
    monkeypatch.setattr(_backward, "_cooperation_refused", False)
    kernel = _RefusingKernel()
    flags = dict(POLLS=_config.EXCHANGE_POLLS, launch_cooperative_grid=True)
    with pytest.warns(RuntimeWarning, match="refused a cooperative launch"):
        _backward.launch_shared(kernel, _plan_of(flags), ())
    assert [f.get("launch_cooperative_grid") for f in kernel.launches] == [True, None]
    _backward.launch_shared(kernel, _plan_of(flags), ())      # no second try, no second warning
    assert [f.get("launch_cooperative_grid") for f in kernel.launches] == [True, None, None]
    assert flags["launch_cooperative_grid"] is True          # the cached plan is left as it was


def test_other_launch_errors_are_not_swallowed(monkeypatch):
    monkeypatch.setattr(_backward, "_cooperation_refused", False)

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **flags):
                raise RuntimeError("Triton Error [CUDA]: an illegal memory access")
            return launch
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _backward.launch_shared(Broken(), _plan_of(dict(launch_cooperative_grid=True)), ())
    assert not _backward._cooperation_refused


class _OnGPU(torch.Tensor):
    """A CPU tensor that says it lives on CUDA device 0, for the launchers' GPU path."""

    def get_device(self):
        return 0


class _Compiling:
    """Stands in for a Triton kernel: ``warmup`` returns a compiled kernel with the given
    registers, shared memory and warps (n_regs filled in by ``_init_handles``, as Triton's);
    launches are recorded, not run."""

    def __init__(self, n_regs, shared=0):
        self.n_regs, self.shared = n_regs, shared
        self.warmups, self.launches = [], []

    def warmup(self, *args, grid, **flags):
        self.warmups.append((grid, dict(flags)))
        compiled = type("Compiled", (), {})()
        compiled.metadata = type("Metadata", (), dict(shared=self.shared,
                                                      num_warps=flags["num_warps"]))()
        compiled._init_handles = lambda: setattr(compiled, "n_regs", self.n_regs)
        return compiled

    def __getitem__(self, grid):
        def launch(*args, **flags):
            self.launches.append((grid, args))
        return launch


def _clear_plans():
    for cached in (_config.device, _config.forward_plan, _config.backward_plan, _take._fits):
        cached.cache_clear()


def _stream_driver(stream):
    """Stands in for Triton's driver module where the launcher reads the current stream."""
    return SimpleNamespace(active=SimpleNamespace(get_current_stream=lambda device: stream))


@pytest.fixture
def fake_h200(monkeypatch):
    """CUDA device 0 is an H200 (sm_90, 132 SMs, 64K registers, 228 KB of shared memory and
    2048 threads per SM) as far as the plans can tell; nothing measured yet."""
    props = type("Props", (), dict(multi_processor_count=132, regs_per_multiprocessor=65536,
                                   shared_memory_per_multiprocessor=228 * 1024,
                                   max_threads_per_multi_processor=2048))()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_config, "measured_per_sm", {})
    monkeypatch.setattr(_backward, "_cooperation_refused", False)
    # the sharing backward's slot buffers: device 0's stream 0, nothing captured
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_backward, "_drivers", _stream_driver(0))
    monkeypatch.setattr(_backward, "_slot_buffers", {})
    monkeypatch.delenv("NORMBOOK_SHARED_ROWS", raising=False)
    _clear_plans()
    yield
    _clear_plans()


def _wide_backward(M=64, D=65536):
    x = torch.randn(M, D).to(torch.bfloat16).as_subclass(_OnGPU)
    return _backward.norm_backward(torch.randn_like(x), None, x, None, torch.ones(2, M), None,
                                   False)


def _wide_plan():
    return _config.backward_plan(64, 65536, 0, 2, False, False, False, False, 0, True)[0]


def test_the_grid_is_sized_by_the_compiled_kernels_registers(fake_h200, monkeypatch):
    """bf16 rows of 65536 backward: S = 16 slices of 4096, assumed two programs per SM (8
    warps, at most 128 registers): 16 groups, 256 programs. The compiled kernel takes 168
    registers, one program per SM: the cooperative grid shrinks to 8 groups, 128 programs, all
    resident; measured once, for the first launch, and the plan carries it from then on."""
    kernel = _Compiling(n_regs=168)
    monkeypatch.setattr(_backward, "norm_bwd_coop_kernel", kernel)
    assumed = _wide_plan()
    assert (assumed.per_sm, assumed.grid, assumed.slices, assumed.measured) == (2, (256,), 16, False)
    _wide_backward()
    assert [grid for grid, _ in kernel.launches] == [(128,)]
    assert kernel.warmups == [((256,), assumed.flags)]
    _wide_backward()
    assert len(kernel.warmups) == 1 and [g for g, _ in kernel.launches] == [(128,), (128,)]
    plan = _wide_plan()
    assert (plan.per_sm, plan.groups, plan.grid, plan.measured) == (1, 8, (128,), True)


def test_a_measurement_equal_to_the_assumption_keeps_the_grid(fake_h200, monkeypatch):
    kernel = _Compiling(n_regs=128)          # 128 x 256 threads: two programs per SM
    monkeypatch.setattr(_backward, "norm_bwd_coop_kernel", kernel)
    _wide_backward()
    _wide_backward()
    assert len(kernel.warmups) == 1 and [g for g, _ in kernel.launches] == [(256,), (256,)]
    plan = _wide_plan()
    assert (plan.per_sm, plan.grid, plan.measured) == (2, (256,), True)


def test_the_wide_forward_has_nothing_to_measure(fake_h200, monkeypatch):
    """The forward's wide rows: one program a row up to LOOP_WIDE_FROM, LOOP_PER_SM per SM
    past it, whatever the compiled kernel's registers: no warmup, one launch."""
    kernel = _Compiling(n_regs=255)
    monkeypatch.setattr(_forward, "norm_fwd_loop_kernel", kernel)
    for D, grid in ((32768, 64), (65536, 64), (131072, 64)):
        x = torch.randn(64, D).to(torch.bfloat16).as_subclass(_OnGPU)
        _forward.norm_forward(x, None, None, None, 1e-5, False)
        assert kernel.launches[-1][0] == (grid,)
    assert _config.forward_plan(5000, 32768, 0, 2, False, False, False, False)[0].grid == (5000,)
    assert _config.forward_plan(5000, 65536, 0, 2, False, False, False, False)[0].grid == (
        _config.LOOP_PER_SM * 132,)
    assert kernel.warmups == []


def test_shared_memory_and_spare_registers_size_the_rows_grid(fake_h200, monkeypatch):
    """Whole rows of 1024 bf16 values (4 warps, assumed two programs per SM: 264 programs).
    40 registers and no shared memory: twelve programs per SM, up to the 1024 tiles; 40
    registers and 100 KB of pipelined tiles: two."""
    for shared, grid in ((0, 1024), (100 * 1024, 264)):
        monkeypatch.setattr(_config, "measured_per_sm", {})
        _clear_plans()
        kernel = _Compiling(n_regs=40, shared=shared)
        monkeypatch.setattr(_forward, "norm_fwd_rows_kernel", kernel)
        x = torch.randn(4096, 1024).to(torch.bfloat16).as_subclass(_OnGPU)
        _forward.norm_forward(x, None, None, None, 1e-5, True)
        assert [g for g, _ in kernel.launches] == [(grid,)] and len(kernel.warmups) == 1


def test_the_backward_measures_before_it_sizes_its_partials(fake_h200, monkeypatch):
    """bf16 rows of 16384 backward: S = 4 slices of 4096, 64 rows, one group each assumed
    (264 programs hold 66 groups); measured one program per SM, 33 groups of 4, and the
    finish sums 33 partial rows."""
    kernel, finish = _Compiling(n_regs=168), _Compiling(n_regs=32)
    monkeypatch.setattr(_backward, "norm_bwd_coop_kernel", kernel)
    monkeypatch.setattr(_backward, "norm_bwd_finish_kernel", finish)
    M, D = 64, 16384
    x = torch.randn(M, D).to(torch.bfloat16).as_subclass(_OnGPU)
    dy, w = torch.randn_like(x), torch.ones(D, dtype=torch.bfloat16)
    _backward.norm_backward(dy, None, x, w, torch.ones(2, M), torch.bfloat16, False)
    assert [g for g, _ in kernel.launches] == [(132,)] and len(kernel.warmups) == 1
    assert kernel.warmups[0][0] == (256,)
    (_, args), = finish.launches
    assert args[4] == 33 and args[0].shape == (33, D)     # groups, and the partials' rows
    assert not finish.warmups


def test_the_interpreter_never_measures(monkeypatch):
    """Device -1 (the interpreter): plans are final, CPU_PROGRAMS programs, no warmup."""
    kernel = _Compiling(n_regs=255)
    monkeypatch.setattr(_forward, "norm_fwd_rows_kernel", kernel)
    plan = _config.forward_plan(64, 256, -1, 4, False, False, False, False, 0)[0]
    assert plan.measured and plan.grid == (_config.CPU_PROGRAMS,)
    _forward.norm_forward(torch.randn(64, 256), None, None, None, 1e-5, False)
    assert kernel.warmups == [] and [g for g, _ in kernel.launches] == [plan.grid]


def test_a_measurement_that_fails_keeps_the_assumed_grid(monkeypatch):
    """A warmup that raises (a Triton whose API differs) must not stop the launch it sizes:
    the plan keeps its assumed programs per SM, marked measured, with one warning."""
    cfg = _config.Config(1024, 1, 4, 128)
    plan = _config._plan("norm_fwd_rows_kernel", 264, {}, cfg, per_sm=2, measured=False,
                         reads=1, writes=1, stats=2, params=2, partials=0, ahead=1, elem_bytes=2)

    class Broken:
        def warmup(self, *args, **kwargs):
            raise TypeError("warmup() got an unexpected keyword argument 'grid'")

    monkeypatch.setattr(_config, "measured_per_sm", {})
    with pytest.warns(RuntimeWarning, match="could not read the compiled occupancy"):
        changed = _launch.measure(Broken(), plan, (), 0)
    assert changed is False
    assert _config.measured_per_sm[_config.measure_key(plan.kernel, plan.flags, 0)] == 2


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_row_of_a_tile_of_its_own_is_a_program_on_a_gpu(norm):
    """On a GPU a row of 4096..16384 values is one program (grid M, loads not pipelined,
    _config.ROW_ELEMS a thread), shorter rows share tiles of a persistent grid; the kernel
    launched with that plan (run here by the interpreter) gives the reference's values."""
    h200 = _config.Device(90, 132)
    is_rms = norm == "rms"
    for D, warps in ((4096, 8), (8192, 16), (16384, 16)):
        plan, = _config.forward_plan(5000, D, h200, 2, is_rms, False, True, not is_rms)
        assert (plan.grid, plan.flags["num_warps"], plan.constexprs["NUM_STAGES"],
                plan.constexprs["ROWS"]) == ((5000,), warps, 1, 1)
        assert plan.constexprs["BLOCK_D"] // (32 * warps) == (16 if D < 16384 else 32)
    narrow, = _config.forward_plan(5000, 2048, h200, 2, is_rms, False, True, not is_rms)
    assert narrow.grid[0] < 5000 and narrow.constexprs["ROWS"] > 1
    M, D = 6, 4100
    plan, = _config.forward_plan(M, D, h200, 4, is_rms, False, True, not is_rms)
    x, w, b = torch.randn(M, D), torch.randn(D), torch.randn(D)
    y, stats = torch.empty_like(x), torch.empty(1 if is_rms else 2, M)
    _forward.norm_fwd_rows_kernel[plan.grid](x, x, x, y, w, b, stats, D, D, M, D, 1e-5,
                                             **plan.flags)
    want = (reference.rms_norm_forward(x, w, 1e-5) if is_rms
            else reference.layer_norm_forward(x, w, b, 1e-5))[0]
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def _sharing_plan(groups, slices=4, ring=2, words_per_slice=4):
    """What the slot buffer reads of a sharing backward's plan."""
    return SimpleNamespace(grid=(groups * slices,), slices=slices, groups=groups,
                           constexprs=dict(RING=ring, SLICES=words_per_slice),
                           slot_words=groups * (ring * 2 * words_per_slice + slices))


def test_slot_epochs_never_repeat_on_a_stream(monkeypatch):
    """The sharing backward's slots are kept per (device, stream), not zeroed per launch: each
    launch's epoch is past every tag the buffer's earlier launches used (their rows per
    group), whatever their plans; a plan needing more words gets a new zeroed buffer; another
    stream or device has its own; tags about to pass TAG_LIMIT zero the buffer, once; a launch
    being captured into a CUDA graph, or the custom op's, gets new zeroed slots and epoch 0,
    leaving the kept ones as they are."""
    monkeypatch.setattr(_backward, "_slot_buffers", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_backward, "_drivers", _stream_driver(7))
    x = torch.empty(0)
    small, big = _sharing_plan(groups=3), _sharing_plan(groups=5)
    slots, epoch = _backward._slots(small, 10, x, 0)               # 4 rows per group
    assert epoch == 0 and slots.numel() == small.slot_words and not slots.any()
    slots.fill_(3 << 32)                                           # words of tag 3 left
    again, epoch = _backward._slots(small, 10, x, 0)
    assert again is slots and epoch == 4
    _, epoch = _backward._slots(small, 2, x, 0)                     # 1 row per group
    assert epoch == 8
    bigger, epoch = _backward._slots(big, 10, x, 0)
    assert bigger is not slots and epoch == 0 and not bigger.any()
    assert _backward._slots(small, 10, x, 0) == (bigger, 2)        # fits in the bigger one
    other, epoch = _backward._slots(small, 10, x, 1)                # another device
    assert other is not bigger and epoch == 0
    monkeypatch.setattr(_backward, "_drivers", _stream_driver(8))  # another stream
    assert _backward._slots(small, 10, x, 0)[1] == 0
    monkeypatch.setattr(_backward, "_drivers", _stream_driver(7))
    # past the last tag: zeroed, and the epochs start again
    bigger.fill_(1 << 32)
    _backward._slot_buffers[0, 7][1] = _backward.TAG_LIMIT - 3
    assert _backward._slots(small, 9, x, 0) == (bigger, _backward.TAG_LIMIT - 3)   # 3 rows
    assert _backward._slots(small, 1, x, 0) == (bigger, 0) and not bigger.any()
    # the custom op's (kept False) and a CUDA graph's capture: slots of their own, zeroed
    fresh, epoch = _backward._slots(small, 10, x, 0, kept=False)
    assert fresh is not bigger and epoch == 0 and not fresh.any()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    captured, epoch = _backward._slots(small, 10, x, 0)
    assert captured is not bigger and epoch == 0 and not captured.any()
    assert _backward._slot_buffers[0, 7][1] == 1


@pytest.mark.slow                  # wide rows in the interpreter
def test_the_wide_backward_zeroes_no_slots_per_call(monkeypatch):
    """A wide-row backward after the first runs no zeroing op (its slots are kept with an
    epoch, not zeroed: no memset launch per call on a GPU) and gives the first call's bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if DEVICE != "cpu":
        pytest.skip("the interpreter's launches (a GPU's are seen by the GPU tests)")
    monkeypatch.setattr(_backward, "_slot_buffers", {})
    seen = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    D = 20000
    first = _wide("rms", D, True)
    assert _backward._slot_buffers, "no slots kept: the test's rows are not shared"
    with Ops():
        again = _wide("rms", D, True)
    assert not seen & {"aten.zero_", "aten.zeros", "aten.fill_", "aten.new_zeros",
                       "aten.zeros_like"}, sorted(seen)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.slow                  # wide rows in the interpreter
def test_the_custom_op_keeps_no_slots(monkeypatch):
    """torch.ops.normbook.norm_backward (what compiled graphs call) takes new zeroed slots for
    shared rows, never the kept ones: torch.compile's CUDA graph trees warm up in a memory
    pool of their own that they may reclaim. Its gradients are the eager launcher's."""
    if DEVICE != "cpu":
        pytest.skip("the interpreter's launches")
    from normbook import _ops

    monkeypatch.setattr(_backward, "_slot_buffers", {})
    D = 20000
    g = torch.Generator().manual_seed(5)
    x, dy = (torch.randn(2, D, generator=g) for _ in range(2))
    w = torch.randn(D, generator=g)
    _, _, stats = _forward.norm_forward(x, None, w, None, 1e-5, True)
    dx, dw, _ = _ops.norm_backward(dy, None, x, w, stats, None, True)
    assert not _backward._slot_buffers
    want = _backward.norm_backward(dy, None, x, w, stats, None, True)
    assert _backward._slot_buffers
    assert torch.equal(dx, want[0]) and torch.equal(dw, want[1])


def test_a_rounding_launch_is_measured_once(fake_h200, monkeypatch):
    """``round_xhat`` (Llama's order in half precision) launches the rows kernels with
    ROUND_XHAT, a plan of its own: its first launch on a GPU measures the compiled kernel and
    later ones reuse the measurement, forward and backward, as a plain launch's do."""
    fwd, bwd, finish = _Compiling(n_regs=40), _Compiling(n_regs=64), _Compiling(n_regs=32)
    monkeypatch.setattr(_forward, "norm_fwd_rows_kernel", fwd)
    monkeypatch.setattr(_backward, "norm_bwd_rows_kernel", bwd)
    monkeypatch.setattr(_backward, "norm_bwd_finish_kernel", finish)
    M, D = 4096, 1024
    x = torch.randn(M, D).to(torch.bfloat16).as_subclass(_OnGPU)
    w = torch.ones(D, dtype=torch.bfloat16)
    for _ in range(3):
        _, _, stats = _forward.norm_forward(x, None, w, None, 1e-6, True, True)
        _backward.norm_backward(torch.randn_like(x), None, x, w, stats, None, True, True)
    assert len(fwd.warmups) == 1 and len(fwd.launches) == 3
    assert len(bwd.warmups) == 1 and len(bwd.launches) == 3
    assert all(f["ROUND_XHAT"] for _, f in fwd.warmups + bwd.warmups)


def test_a_measurement_the_plans_cannot_see_does_not_loop(fake_h200, monkeypatch):
    """Should a measurement be recorded where the plan builders do not look it up (a key that
    differs), the launchers launch once more on the assumed grid rather than measure and
    re-plan forever: one warmup and one launch per call, forward and backward."""
    monkeypatch.setattr(_config, "measure_key", lambda kernel, flags, device: object())
    fwd, bwd, finish = _Compiling(n_regs=40), _Compiling(n_regs=64), _Compiling(n_regs=32)
    monkeypatch.setattr(_forward, "norm_fwd_rows_kernel", fwd)
    monkeypatch.setattr(_backward, "norm_bwd_rows_kernel", bwd)
    monkeypatch.setattr(_backward, "norm_bwd_finish_kernel", finish)
    x = torch.randn(4096, 1024).to(torch.bfloat16).as_subclass(_OnGPU)
    w = torch.ones(1024, dtype=torch.bfloat16)
    for calls in (1, 2):
        _, _, stats = _forward.norm_forward(x, None, w, None, 1e-6, True)
        _backward.norm_backward(torch.randn_like(x), None, x, w, stats, None, True)
        assert len(fwd.warmups) == len(fwd.launches) == calls
        assert len(bwd.warmups) == len(bwd.launches) == calls
