"""The direct launch (normbook.kernels._launch) against Triton's own, and its stub seam.

Both need compiled kernels, so they run in a fresh process with Triton's interpreter off,
under the stub driver: the kernels compile for sm_90 here, and the launcher each launch
reaches records its arguments instead of calling the GPU. A direct launch must hand the
launcher what Triton's ``JITFunction.run`` hands it (the same compiled variant, the same
arguments), except the launch metadata and hooks, which only hooks read (None there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_SCRIPT = r'''
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
from normbook.kernels import _backward, _forward, _launch

out = {}

def calls(record, fn):
    """The launcher calls fn makes: (function handle, grid, stream, then the arguments past
    the metadata and hooks, a tensor as its dtype, shape and 16-byte alignment: outputs are
    new allocations each call) and whether those three are None."""
    n = len(record)
    fn()
    got = []
    for a in record[n:]:
        rest = [(str(t.dtype), list(t.shape), t.data_ptr() % 16 == 0) if isinstance(t, torch.Tensor)
                else t for t in a[9:]]
        got.append(([a[4], a[0], a[1], a[2], a[3], a[5], *rest], [a[6] is None, a[7] is None, a[8] is None]))
    return got

def cases():
    g = torch.Generator().manual_seed(0)
    for M, D, is_rms, residual in ((4, 4096, False, False), (1, 4096, False, False),
                                   (3, 760, True, True), (300, 64, False, True)):
        x = torch.randn(M, D, generator=g).bfloat16()
        r = torch.randn(M, D, generator=g).bfloat16() if residual else None
        w = torch.randn(D, generator=g)
        b = None if is_rms else torch.randn(D, generator=g).bfloat16()
        yield f"{M}x{D} rms={is_rms} residual={residual}", x, r, w, b, is_rms, False
    # round_xhat: a constexpr the plan sets and the other plans leave to its default
    x = torch.randn(3, 760, generator=g).bfloat16()
    yield "3x760 rms round_xhat", x, None, torch.randn(760, generator=g).bfloat16(), None, True, True
    base = torch.randn(2 * 64 + 1).bfloat16()
    yield "misaligned", base[1:].view(2, 64), None, None, None, False, False

record = []
with _launch.stub_driver(record):
    for name, x, r, w, b, is_rms, rx in cases():
        def both():
            y, h, stats = _forward.norm_forward(x, r, w, b, 1e-5, is_rms, rx)
            _backward.norm_backward(torch.ones_like(y), None if r is None else y, x if h is None else h,
                                    w, stats, None if b is None else b.dtype, is_rms, rx)
        _launch._DIRECT = False
        jit = [calls(record, both) for _ in range(2)]
        _launch._DIRECT = True
        kept = _launch.compiled_variants()
        first = calls(record, both)
        added = _launch.compiled_variants() - kept
        direct = [calls(record, both) for _ in range(2)]
        _launch._DIRECT = False         # the switch off again, with the kernels kept
        again = calls(record, both)
        _launch._DIRECT = True
        out[name] = dict(jit=jit, first=first, direct=direct, added=added, again=again)

# a launch hook (a profiler's) set: every launch takes Triton's path, which calls it
from triton import knobs
hook = lambda metadata: None
with _launch.stub_driver(record):
    x = torch.randn(4, 256).bfloat16()
    _forward.norm_forward(x, None, None, None, 1e-5, False)          # kept
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        got = calls(record, lambda: _forward.norm_forward(x, None, None, None, 1e-5, False))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    out["hooked"] = dict(metadata=[m for _, m in got])

# every aten op the eager kernel route runs, forward and backward, through the public API
import normbook
from normbook.bench.host import stubbed
from torch.utils._python_dispatch import TorchDispatchMode

class Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

seen = set()
g = torch.Generator().manual_seed(1)
x, r = (torch.randn(6, 256, generator=g).bfloat16().requires_grad_() for _ in range(2))
ln, rms = normbook.LayerNorm(256, dtype=torch.bfloat16), normbook.RMSNorm(256, dtype=torch.bfloat16)
with stubbed(), normbook.backend("kernels"):
    for step in range(2):       # the first compiles and plans; the second is the steady state
        seen.clear()
        with Ops():
            for y in (ln(x), rms(x), *normbook.add_layer_norm(x, r, ln.weight, ln.bias),
                      *normbook.add_rms_norm(x, r, rms.weight)):
                y.backward(torch.ones_like(y))
out["aten ops"] = sorted(seen)
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def launches():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_a_direct_launch_hands_the_launcher_what_triton_would(launches):
    """Every case, forward and backward (the finish kernel too, where the backward has one):
    the same compiled kernel (its handle), grid, stream and arguments as Triton's path, launch
    after launch; metadata and hooks None, as Triton's launcher reads them with no hook set."""
    for name, got in launches.items():
        if name in ("aten ops", "hooked"):
            continue
        jit_args = [args for args, _ in got["jit"][0]]
        assert jit_args and got["jit"][0] == got["jit"][1], name
        for launches_ in got["direct"]:
            assert [args for args, _ in launches_] == jit_args, name
            if name != "misaligned":
                assert all(hooks == [True, True, True] for _, hooks in launches_), name
        # with _launch._DIRECT off, kept kernels are not used: Triton's path, which passes the
        # launch metadata and hooks (what the GPU test's comparison relies on)
        assert got["again"] == got["jit"][0], name
        assert all(hooks == [False, False, False] for _, hooks in got["again"]), name


def test_each_new_specialization_is_kept_once_and_a_misaligned_tensor_is_not(launches):
    """The first launch of a plan takes Triton's path and keeps its kernel (one per kernel of
    the case: forward, backward and finish when there is one); the next launches find it. A
    tensor off 16-byte alignment takes Triton's path every time, keeping nothing."""
    for name, got in launches.items():
        if name in ("aten ops", "hooked"):
            continue
        launched = len(got["first"])
        assert got["added"] == (0 if name == "misaligned" else launched), (name, got["added"])
        assert launched >= 2, name


def test_a_launch_hook_sees_every_launch(launches):
    """With a hook in Triton's launch_enter_hook chain (as profilers add one), a kept kernel is
    launched by Triton's path, which hands the launcher the launch metadata and the hooks (the
    launcher calls them: the stub's does not, so the hook itself stays uncalled here)."""
    assert launches["hooked"]["metadata"] == [[False, False, False]]


def test_the_eager_kernel_route_is_capturable_by_a_cuda_graph(launches):
    """What CUDA graph capture forbids, the eager kernel route never does, forward or backward,
    modules and fused adds: no op that reads a tensor's value back to the host (a device sync:
    ``.item()``, a data-dependent shape, a copy to the CPU), and no allocation but new
    tensors (empty_like / new_empty: under capture they come from the graph's own pool); the
    launches themselves take the current stream. The aten ops seen are the allocations, the
    fused add's x + residual leaves (the gradient accumulation of leaves) and the like."""
    seen = set(launches["aten ops"])
    syncs = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.is_nonzero",
             "aten.equal", "aten.allclose", "aten.masked_select", "aten.unique", "aten._to_copy",
             "aten.to", "aten.cpu", "aten.tolist"}
    assert not seen & syncs, sorted(seen & syncs)
    assert {"aten.empty_like", "aten.new_empty"} <= seen, sorted(seen)


_READY_SCRIPT = r'''
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
import normbook
from normbook import functional
from normbook.kernels import _launch

out = {}
record = []

def abstract(a):
    """A launcher call as the kernel sees it: function handle, grid, stream, then the
    arguments past metadata and hooks, a tensor as its dtype, size and alignment (the
    launchers see x as (M, D) rows, the ready path in its own shape: the kernels see a
    pointer)."""
    return [a[4], a[0], a[1], a[2], a[3]] + [
        (str(t.dtype), t.numel(), t.data_ptr() % 16 == 0) if isinstance(t, torch.Tensor)
        else t for t in a[9:]]

launched = []       # the launchers the door called: ("fwd" | "bwd")

def run(fn):
    """(launcher calls, launchers the door called) of fn."""
    n, m = len(record), len(launched)
    fn()
    return [abstract(a) for a in record[n:]], launched[m:]

g = torch.Generator().manual_seed(0)
def t(*shape, dtype=torch.bfloat16, grad=True):
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)

functional._INTERPRETED = True     # CPU tensors on the kernel backend (as bench.host.stubbed)
with _launch.stub_driver(record), normbook.backend("kernels"):
    functional._kernels()
    k = functional._K
    def spy(name, launcher):
        def call(*args):
            launched.append(name)
            return launcher(*args)
        return call
    functional._K = k._replace(norm_forward=spy("fwd", k.norm_forward),
                               norm_backward=spy("bwd", k.norm_backward))
    ln = normbook.LayerNorm(256, dtype=torch.bfloat16)
    rms = normbook.RMSNorm(64)
    x3 = t(2, 3, 256)
    x, r = t(300, 64), t(300, 64)
    w32 = t(64, dtype=torch.float32)
    def backward(out):
        for y in (out if isinstance(out, tuple) else (out,)):
            y.backward(torch.ones_like(y))
    cases = {
        "LayerNorm (2, 3, 256)": lambda: backward(ln(x3)),
        "RMSNorm fp32 (300, 64)": lambda: backward(rms(x.float())),
        "layer_norm no weight": lambda: backward(normbook.layer_norm(x, 64)),
        "add_layer_norm fp32 weight": lambda: backward(normbook.add_layer_norm(x, r, w32)),
        "add_rms_norm": lambda: backward(normbook.add_rms_norm(x, r, w32.bfloat16())),
        "layer_norm no weight, 8 rows": lambda: backward(normbook.layer_norm(x8, 64)),
        # Llama's order, fused (functional._round): its own signature, kept the same way
        "rms_norm round_xhat": lambda: backward(normbook.rms_norm(x, 64, w16, round_xhat=True)),
    }
    x8 = x.detach()[:8].requires_grad_()
    w16 = t(64)
    for name, fn in cases.items():
        calls = [run(fn) for _ in range(3)]
        out[name] = dict(calls=calls, ready=len(_launch.READY))
    # every signature again, in the other order: each call's own launches, whatever ran before
    out["interleaved"] = {name: run(fn) for name, fn in reversed(list(cases.items()))}

    # calls the fast path must leave to the launchers, after their signature is ready
    base = t(2 * 64 + 8, grad=False)
    w = t(64, grad=False).float()
    bb = t(64, grad=False).float()
    for _ in range(2):    # ready: (300, 64) with w, with w and bb, and (2, 64) aligned
        normbook.layer_norm(x, 64, w), normbook.layer_norm(x, 64, w, bb)
        normbook.layer_norm(base[:128].view(2, 64).requires_grad_(), 64, w)
        normbook.rms_norm(base[:128].view(2, 64).requires_grad_(), 64, w16, round_xhat=True)
    declined = {
        "round_xhat misaligned input": lambda: normbook.rms_norm(
            base[1:129].view(2, 64).requires_grad_(), 64, w16, round_xhat=True),
        "round_xhat rows not dense": lambda: normbook.rms_norm(
            t(300, 128)[:, :64], 64, w16, round_xhat=True),
        "misaligned input": lambda: normbook.layer_norm(base[1:129].view(2, 64).requires_grad_(), 64, w),
        "weight not dense": lambda: normbook.layer_norm(x, 64, t(128, grad=False).float()[::2]),
        "a negative view": lambda: normbook.layer_norm(torch._neg_view(x), 64, w),
        "a negative weight": lambda: normbook.layer_norm(x, 64, torch._neg_view(w)),
        "a negative bias": lambda: normbook.layer_norm(x, 64, w, torch._neg_view(bb)),
        "a negative residual": lambda: normbook.add_layer_norm(x, torch._neg_view(r), w32),
        "dy not dense": lambda: normbook.layer_norm(x, 64, w).backward(torch.ones(64).bfloat16().expand(300, 64)),
    }
    for name, fn in declined.items():
        out[name] = run(fn)[1]
    # a negative dy to a ready backward: its values reach the launcher, not the memory
    n = len(record)
    neg_dy = lambda: normbook.layer_norm(x, 64, w).backward(torch._neg_view(torch.ones(300, 64).bfloat16()))
    out["a negative dy"] = dict(launched=run(neg_dy)[1], negative=any(
        isinstance(a, torch.Tensor) and a.is_neg() for call in record[n:] for a in call))
    from triton import knobs
    hook = lambda metadata: None
    y_hooked = normbook.rms_norm(x, 64, w16, round_xhat=True)   # (ready: its backward kept)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        out["a launch hook"] = run(lambda: backward(normbook.layer_norm(x, 64, w)))[1]
        out["round_xhat, a launch hook"] = run(
            lambda: backward(normbook.rms_norm(x, 64, w16, round_xhat=True)))[1]
        out["round_xhat, a launch hook at backward"] = run(lambda: backward(y_hooked))[1]
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    # the same Parameter with other data: another signature, the launchers again
    rms.weight.data = rms.weight.data.bfloat16()
    out["weight.data in another dtype"] = run(lambda: backward(rms(x)))[1]
    out["and then"] = run(lambda: backward(rms(x)))[1]
    # normalized over two dims: (2, 64) rows of 128, which the kept (300, 64) kernels are not
    x2 = x.detach().view(150, 2, 64)
    calls = [run(lambda: ys2.append(normbook.layer_norm(x2, (2, 64)))) for ys2 in [[]] * 2]
    out["two normalized dims"] = [c[1] for c in calls]
    # no gradient wanted: no Function at all
    ys = []
    with torch.no_grad():
        calls, by_launchers = run(lambda: ys.append(normbook.layer_norm(x, 64, w)))
    out["no grad"] = dict(grad_fn=ys[0].grad_fn is None, launched=by_launchers,
                          launches=len(calls))

    # the modules' own kept calls (functional._module_norm): _norm, the front door, counted
    door, round_door = functional._norm, functional._round
    doors = []
    def counting(fn):
        def counted(*args, **kwargs):
            doors.append(1)
            return fn(*args, **kwargs)
        return counted
    functional._norm, functional._round = counting(door), counting(round_door)
    def module_run(fn):
        """(launcher calls, launchers called, front-door calls) of fn."""
        n = len(doors)
        calls, by_launchers = run(fn)
        return calls, by_launchers, len(doors) - n
    m = normbook.LayerNorm(64, dtype=torch.bfloat16)
    mr = normbook.RMSNorm(64, dtype=torch.bfloat16)
    xm = t(200, 64)     # (a shape no case above made ready)
    def fwd_bwd(mod=m, x=xm):
        return lambda: backward(mod(x))
    mrx = normbook.RMSNorm(64, dtype=torch.bfloat16, round_xhat=True)
    module = out["module"] = {"LayerNorm": [module_run(fwd_bwd()) for _ in range(3)],
                              "RMSNorm": [module_run(fwd_bwd(mr)) for _ in range(3)],
                              "RMSNorm round_xhat": [module_run(fwd_bwd(mrx)) for _ in range(3)]}
    with torch.no_grad():
        module["round_xhat, no grad"] = [module_run(lambda: mrx(xm)) for _ in range(2)]
    # a plain module's kept call is not taken once its modes are set, nor the other way
    mp = normbook.RMSNorm(64, dtype=torch.bfloat16)
    module["modes set"] = [module_run(fwd_bwd(mp)) for _ in range(2)]
    mp.set_modes(round_xhat=True)
    module["modes set"] += [module_run(fwd_bwd(mp)) for _ in range(2)]
    mp.set_modes()
    module["modes set"] += [module_run(fwd_bwd(mp))]
    # and what its guard and checks must send to the front door, each once, then kept again
    def each(name, change, fn=fwd_bwd()):
        change()
        module[name] = [module_run(fn) for _ in range(2)]
    each("eps", lambda: setattr(m, "eps", 1e-3))
    each("weight frozen", lambda: m.weight.requires_grad_(False))
    each("bias.data in float32", lambda: setattr(m.bias, "data", torch.zeros(64)))
    m.bias.data = torch.zeros(32).bfloat16()      # same dtype, another length: refused
    try:
        m(xm)
        module["bias.data of another length"] = "accepted"
    except (ValueError, RuntimeError) as e:
        module["bias.data of another length"] = str(e).splitlines()[0]
    m.bias.data = torch.zeros(64).bfloat16()
    each("input not requiring grad", lambda: None, lambda: m(xm.detach()))
    each("normalized_shape replaced", lambda: setattr(m, "normalized_shape", (64,)))
    aligned, misaligned = base[:128].view(2, 64), base[1:129].view(2, 64)
    module["aligned, kept"] = [module_run(lambda: m(aligned))[2] for _ in range(2)]
    each("misaligned input", lambda: None, lambda: m(misaligned))
    module_run(fwd_bwd())   # (xm's call kept again)
    m.normalized_shape = (32,)      # another width: the door's error, not the kept (64,) call
    try:
        m(xm)
        module["normalized_shape of another width"] = "accepted"
    except (ValueError, RuntimeError) as e:
        module["normalized_shape of another width"] = type(e).__name__
    m.normalized_shape = (64,)
    def to_torch():
        with normbook.backend("torch"):
            return m(xm)
    each("torch backend", lambda: None, to_torch)
    each("weight moved to float32", lambda: m.float(), lambda: m(xm.float()))
    with torch.no_grad():
        ys = []
        module["no grad"] = [module_run(lambda: ys.append(mr(xm))) for _ in range(2)]
        module["no grad, grad_fn"] = ys[-1].grad_fn is None
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        module["a launch hook"] = module_run(fwd_bwd(mr))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    with torch.inference_mode():
        xi = xm.detach().clone()
    module["an inference tensor"] = [module_run(lambda: mr(xi))[2] for _ in range(2)]
    # rows that are not dense: kept, the guard would hold their strides for the dense kernels
    tokens = t(200, 3, 64)
    module["rows not dense"] = [module_run(lambda: mr(tokens[:, 0])) for _ in range(2)]
    module["rows expanded"] = [module_run(lambda: mr(xm[:1].expand(200, 64))) for _ in range(2)]
    module["a negative view"] = [module_run(lambda: mr(torch._neg_view(xm)))[2] for _ in range(2)]
    import copy, pickle
    kept = bool(vars(mr).get("_normbook_calls"))
    from torch.nn.utils import parametrize
    pm = normbook.RMSNorm(64, dtype=torch.bfloat16)
    parametrize.register_parametrization(pm, "weight", torch.nn.Identity())
    backward(pm(xm)), backward(pm(xm))
    pm_kept = bool(vars(pm).get("_normbook_calls"))
    module["copies keep no calls"] = [kept, pm_kept] + [
        not vars(c).get("_normbook_calls")
        for c in (copy.deepcopy(mr), pickle.loads(pickle.dumps(mr)), copy.deepcopy(pm),
                  mr._replicate_for_data_parallel())]
    # a bounded store: a module called on many shapes keeps at most MAX_MODULE_CALLS
    many = normbook.RMSNorm(64, dtype=torch.bfloat16)
    with torch.no_grad():
        for M in range(1, functional.MAX_MODULE_CALLS + 7):
            many(t(M, 64, grad=False))
        last = t(M, 64, grad=False)
        module["many shapes"] = [len(vars(many)["_normbook_calls"]), module_run(lambda: many(last))[2]]
    # the stub's kernels forgotten: a module's kept call must not launch them
    ready_before = next(iter(vars(mr)["_normbook_calls"].values()))[4][-1]
    y_before = mr(xm)                 # a graph whose backward is still to run
    y_round = mrx(xm)
    _launch.forget_ready()
    module["backward after forgetting"] = run(lambda: backward(y_before))[1]
    module["round_xhat backward after forgetting"] = run(lambda: backward(y_round))[1]
    module["forgotten"] = [ready_before.live, module_run(fwd_bwd(mr))]
    functional._norm, functional._round = door, round_door
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def ready_calls():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _READY_SCRIPT], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


_LAUNCHES = {"LayerNorm (2, 3, 256)": 2, "RMSNorm fp32 (300, 64)": 3, "layer_norm no weight": 2,
             "add_layer_norm fp32 weight": 3, "add_rms_norm": 3,
             "layer_norm no weight, 8 rows": 2, "rms_norm round_xhat": 3}
_CASES = tuple(_LAUNCHES)


@pytest.mark.parametrize("case", _CASES)
def test_a_ready_call_hands_the_launcher_what_the_launchers_would(ready_calls, case):
    """normbook.functional._norm's fast path: the first call of a signature runs the launchers
    (forward, then backward) and makes it ready; the next ones call neither, and hand the
    compiled kernels' launcher the same kernels, grids, streams and arguments, forward and
    backward (with the finish kernel where several programs kept partial sums: M = 300 in the
    interpreter's grid of 4)."""
    (first, by_launchers), (second, by_second), (third, by_third) = ready_calls[case]["calls"]
    assert by_launchers == ["fwd", "bwd"], case
    assert by_second == [] and by_third == [], case
    assert second == first and third == first, case
    # forward, backward, and the finish where 300 rows with a weight left partial sums
    assert len(first) == _LAUNCHES[case], case


def test_every_ready_signature_is_kept_once(ready_calls):
    assert [ready_calls[c]["ready"] for c in _CASES] == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("case", _CASES)
def test_ready_signatures_called_in_turn_each_launch_their_own(ready_calls, case):
    """Every ready signature called again after the others (in reverse order): each hands the
    launcher exactly its own first call's launches, none of another's (the same D with 8 rows
    and with 300, whose backward plans differ), and no launcher runs."""
    calls, by_launchers = ready_calls["interleaved"][case]
    assert by_launchers == [] and calls == ready_calls[case]["calls"][0][0], case


@pytest.mark.parametrize("case", ["misaligned input", "weight not dense", "a launch hook",
                                  "weight.data in another dtype", "a negative view",
                                  "a negative weight", "a negative bias",
                                  "a negative residual", "round_xhat misaligned input",
                                  "round_xhat rows not dense", "round_xhat, a launch hook"])
def test_what_a_signature_does_not_fix_is_checked_on_every_call(ready_calls, case):
    """A ready signature's later calls go to the launchers when this call's pointers are off
    16-byte alignment or its parameters not dense (the kernels were specialized and the
    launches planned for what the first call had), when a launch hook is set (Triton's path
    calls it), when a parameter's data changed dtype in place (another signature), and for a
    negative view (its sign a bit the kernels' pointer does not carry: the launchers get its
    values)."""
    assert ready_calls[case][:1] == ["fwd"], (case, ready_calls[case])


def test_a_launch_hook_set_before_the_backward_takes_the_launcher(ready_calls):
    """A round_xhat forward from kept kernels, then a launch hook: its backward goes to the
    launcher (which lets Triton call the hook), not to the kept backward."""
    assert ready_calls["round_xhat, a launch hook at backward"] == ["bwd"]


def test_a_negative_gradient_reaches_the_ready_backward_as_its_values(ready_calls):
    """A negative view as dy: the ready backward launches (no launcher runs) with its values
    (the launcher is handed no tensor whose sign is a bit)."""
    assert ready_calls["a negative dy"] == {"launched": [], "negative": False}


def test_a_gradient_not_dense_goes_to_the_launcher(ready_calls):
    """dy expanded from one row: the ready backward declines, norm_backward copies it."""
    assert ready_calls["dy not dense"] == ["bwd"]


def test_a_shape_normalized_over_several_dims_is_never_ready(ready_calls):
    """normalized_shape (2, 64): rows of 128 to the launchers, which a ready signature,
    planned for rows of the input's last dim, must not take (the kept (300, 64) kernels
    match its sizes)."""
    assert ready_calls["two normalized dims"] == [["fwd"], ["fwd"]]


def test_a_new_signature_is_ready_after_its_first_call(ready_calls):
    assert ready_calls["and then"] == []


def test_no_gradient_no_function(ready_calls):
    """Under no_grad a ready call launches without the autograd Function (no grad_fn) and
    without the launchers."""
    assert ready_calls["no grad"] == {"grad_fn": True, "launched": [], "launches": 1}


_EPOCH_SCRIPT = r'''
import json, warnings
warnings.simplefilter("ignore")
import torch
from normbook.kernels import _backward, _forward, _launch

record, out = [], {}
with _launch.stub_driver(record):
    x, w = torch.randn(2, 20000).bfloat16(), torch.randn(20000).bfloat16()
    y, _, stats = _forward.norm_forward(x, None, w, None, 1e-5, True)
    slots = _backward._slots
    for direct in (False, True):
        _launch._DIRECT = direct
        out[str(direct)] = []
        for epoch in (0, 1, 16, 17, 2**31 - 8):
            _backward._slots = lambda *a, e=epoch: (slots(*a)[0], e)
            n = len(record)
            _backward.norm_backward(torch.ones_like(y), None, x, w, stats, None, True)
            # (function handle, whether the argument after the slots is this epoch)
            out[str(direct)].append([[a[4], len(a) > 16 and type(a[16]) is int and a[16] == epoch]
                                     for a in record[n:]])
print(json.dumps(out))
'''


def test_the_epoch_is_not_specialized_on():
    """The wide backward's ``epoch`` changes every launch, so no compiled kernel may be
    specialized on its value (Triton makes an int of 1 a constant and one divisible by 16
    an aligned one, which a kept kernel would then apply to every later epoch): epochs 0, 1,
    16, 17 and near 2^31 launch the same compiled kernels (their stub handles), by Triton's
    path and directly, with the epoch passed as an argument."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _EPOCH_SCRIPT], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    first = got["False"][0]
    assert len(first) == 2 and first[0][1], first   # the sharing kernel (epoch passed), finish
    for launches in got["False"] + got["True"]:
        assert [handle for handle, _ in launches] == [handle for handle, _ in first], got
        assert launches[0][1], got


_FUSION_SCRIPT = '''
import warnings
warnings.simplefilter("error")          # Triton 3.9's FP-fusion default warning, an error
import torch
import normbook
from normbook.bench.host import stubbed
with stubbed(), normbook.backend("kernels"):
    x = torch.randn(4, 64, requires_grad=True)
    for m in (normbook.LayerNorm(64), normbook.RMSNorm(64)):
        m(x).sum().backward()
    wide = torch.randn(2, 40000, requires_grad=True)
    normbook.layer_norm(wide, 40000).sum().backward()
'''


def test_the_kernels_compile_with_fp_fusion_asked_for(tmp_path):
    """Every compile names enable_fp_fusion=True, as the kernels were compiled, measured and
    reported: Triton 3.9 warned at each compile that its default changes in 3.10 (a user's
    first LayerNorm on a GPU printed it), and under 3.10 the kernels would have compiled
    without fusion. A fresh process (the warning is given once), compiled for sm_90 through
    the stubbed driver."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    env["TRITON_CACHE_DIR"] = str(tmp_path)             # compile, not a cached kernel
    r = subprocess.run([sys.executable, "-c", _FUSION_SCRIPT], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm", "RMSNorm round_xhat"])
def test_a_module_launches_its_kept_call_without_the_front_door(ready_calls, kind):
    """normbook.LayerNorm / RMSNorm keep the ready call of each input shape
    (functional._module_norm): after the first call, which goes through the front door and
    the launchers, the next ones take neither and hand the launcher the same kernels, grids
    and arguments, forward and backward."""
    (first, launchers, door), *later = ready_calls["module"][kind]
    assert launchers == ["fwd", "bwd"] and door == 1
    assert all(calls == first and by == [] and d == 0 for calls, by, d in later), later


@pytest.mark.parametrize("case", ["eps", "weight frozen", "bias.data in float32",
                                  "input not requiring grad", "normalized_shape replaced",
                                  "weight moved to float32"])
def test_what_a_module_guard_does_not_pass_goes_through_the_front_door(ready_calls, case):
    """A change to the module (its eps, its normalized_shape), to a parameter (frozen, its
    .data replaced in another dtype, the module moved to float32) or to the input (another
    requires_grad) sends the next call through the front door, which launches what this call
    needs; the call after it is kept again and launches exactly that."""
    (first, _, door), (second, launchers, again) = ready_calls["module"][case]
    assert door == 1 and again == 0 and launchers == [], (case, door, again, launchers)
    assert second == first


def test_a_round_xhat_module_without_gradient_launches_the_forward_alone(ready_calls):
    """Under no_grad, the call kept with gradients launches its forward, no Function."""
    assert all((len(calls), launchers, door) == (1, [], 0)
               for calls, launchers, door in ready_calls["module"]["round_xhat, no grad"])


def test_modes_set_after_a_kept_call_are_not_given_the_kept_kernels(ready_calls):
    """A plain RMSNorm's kept call, then round_xhat set (set_modes): the next call takes the
    round_xhat door, which launches the kernels of its signature (ready since another module
    ran it: the round_xhat module's, not the plain ones), and the call after it is kept;
    modes unset again, the plain door once more."""
    (plain, _, _), (_, _, kept), (rounding, _, door), (again, by_again, kept_again), \
        (back, _, door_back) = ready_calls["module"]["modes set"]
    (round_module, _, _), *_ = ready_calls["module"]["RMSNorm round_xhat"]
    assert kept == 0 and door == 1 and rounding == round_module and rounding != plain
    assert (by_again, kept_again) == ([], 0) and again == rounding
    assert door_back == 1 and back == plain


def test_a_kept_call_launches_the_new_eps(ready_calls):
    (first, _, _), _ = ready_calls["module"]["eps"]
    (before, _, _), *_ = ready_calls["module"]["LayerNorm"]
    assert 0.001 in first[0] and 0.001 not in before[0]


@pytest.mark.parametrize("case", ["misaligned input", "torch backend"])
def test_what_a_module_may_never_keep_takes_the_front_door_every_time(ready_calls, case):
    """A misaligned input of a shape whose aligned call is kept (the kept kernels were
    specialized on 16-byte pointers), and the torch backend."""
    assert ready_calls["module"]["aligned, kept"] == [1, 0]
    assert [door for _, _, door in ready_calls["module"][case]] == [1, 1]


def test_a_kept_call_is_not_taken_for_another_normalized_shape(ready_calls):
    """normalized_shape set to another width after a call was kept: the door's error, as on a
    first call (the kept call normalizes rows of 64)."""
    assert ready_calls["module"]["normalized_shape of another width"] == "ShapeError"


def test_a_module_keeps_at_most_max_module_calls(ready_calls):
    """Called on MAX_MODULE_CALLS + 6 shapes, a module keeps at most MAX_MODULE_CALLS of
    them (the store starts again when full), and the last shape's next call is kept."""
    from normbook.functional import MAX_MODULE_CALLS

    kept, door = ready_calls["module"]["many shapes"]
    assert 0 < kept <= MAX_MODULE_CALLS and door == 0


def test_a_parameter_of_another_length_is_refused_after_a_kept_call(ready_calls):
    """The guard sees .data replaced by a tensor of the same dtype and another length: the
    front door's check refuses it, as on a first call, rather than launching the kept (D,)
    kernels."""
    assert "bias" in ready_calls["module"]["bias.data of another length"]


def test_a_module_call_without_gradient_launches_the_forward_alone(ready_calls):
    (calls, launchers, door), _ = ready_calls["module"]["no grad"]
    assert (len(calls), launchers, door) == (1, [], 0)
    assert ready_calls["module"]["no grad, grad_fn"] is True


def test_a_launch_hook_takes_the_front_door(ready_calls):
    assert ready_calls["module"]["a launch hook"][2] == 1


@pytest.mark.parametrize("case", ["an inference tensor", "a negative view"])
def test_what_the_door_copies_is_never_kept(ready_calls, case):
    """An inference tensor (the Function cannot save it: the door copies it) and a negative
    view (the door gives the launchers its values) take the front door every time."""
    assert ready_calls["module"][case] == [1, 1]


@pytest.mark.parametrize("case", ["rows not dense", "rows expanded"])
def test_rows_not_dense_are_never_kept(ready_calls, case):
    """A module called on rows that are not dense (a column of tokens, x[:, 0]; one row
    expanded) after its dense call of the same shape made the signature ready: the door each
    time, which hands the launchers the real strides (kept, the dense kernels would read the
    wrong rows, or past the end of an expanded row)."""
    (first, _, door), (second, _, again) = ready_calls["module"][case]
    assert (door, again) == (1, 1) and second == first


def test_copies_of_a_module_keep_no_calls(ready_calls):
    """A deep copy, a pickle, a DataParallel replica, and the deep copy of a parametrized
    module (torch.nn.utils.parametrize copies the module's dict itself) carry none of the
    calls the module keeps."""
    assert ready_calls["module"]["copies keep no calls"] == [True] * 6


def test_forgotten_kernels_are_not_launched_by_a_module(ready_calls):
    """When the kept kernels are forgotten (the stub driver leaving, the table full), a
    module's kept call is no longer live and its next call takes the front door."""
    live, (_, _, door) = ready_calls["module"]["forgotten"]
    assert live is False and door == 1
    # nor by a backward recorded before: it takes the launcher
    assert ready_calls["module"]["backward after forgetting"] == ["bwd"]
    assert ready_calls["module"]["round_xhat backward after forgetting"] == ["bwd"]
