"""normbook.distributed off the well-trodden paths (issue 20).

The feature-sharded norms against one process on the whole row, for any split of the features:
uneven, a rank with none, fp32 rows near 1e20, and double backward (a gradient penalty). One
launch on three gloo CPU ranks runs every case (starting Pythons is most of the time); a
two-rank subgroup of it runs the two-rank cases. Then :func:`normbook.distributed.launch`
itself: a failing rank, a hanging rank, a rank that exits without a result, and a parent
stopped from outside must each end every child and leave no file behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():   # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from normbook import distributed as nd  # noqa: E402

pytestmark = pytest.mark.slow   # gloo processes: seconds each

WORLD = 3


# --- the sharded norms: every case inside one launch -------------------------------------------


def _cut(t, sizes, rank):
    """This rank's slice of the last dim of t, for per-rank feature counts ``sizes``."""
    start = sum(sizes[:rank])
    return t[..., start:start + sizes[rank]]


def _one_process(x, w, b, eps, is_rms):
    """y of the single-process path (normbook) on whole rows, and torch's, for the oracle."""
    import torch.nn.functional as F

    import normbook

    D = x.shape[-1]
    if is_rms:
        return normbook.rms_norm(x, (D,), w, eps), F.rms_norm(x, (D,), w, eps)
    return normbook.layer_norm(x, (D,), w, b, eps), F.layer_norm(x, (D,), w, b, eps)


def _err(got, want, whole):
    """Largest |got - want| relative to the largest |whole| (the reference on whole rows)."""
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf")
    if got.numel() == 0:
        return 0.0
    return float((got - want).abs().max() / whole.detach().abs().max().clamp_min(1e-300))


def _check_case(case, rank, group, failures):
    """One split of one norm: y, dx, dweight, dbias (and, with ``double``, the gradients of a
    gradient penalty) on this rank's slice against one process on the whole row."""
    name, sizes, is_rms, dtype = case["name"], case["sizes"], case["is_rms"], case["dtype"]
    g = torch.Generator().manual_seed(case["seed"])        # the same data on every rank
    D, lead = sum(sizes), case["lead"]
    f64 = dict(generator=g, dtype=torch.float64)
    x = (case["scale"] * (3 + torch.randn(*lead, D, **f64))).to(dtype)
    if case["const"] is not None:       # rows of one value: x - mean is 0, y the bias
        x = torch.full((*lead, D), case["const"], dtype=torch.float64).to(dtype)
    w = (1 + 0.1 * torch.randn(D, **f64)).to(dtype)
    b = None if is_rms else (0.1 * torch.randn(D, **f64)).to(dtype)
    dy = torch.randn(*lead, D, **f64)
    v = torch.randn(*lead, D, **f64)                       # the penalty's direction
    eps = 1e-6 if is_rms else 1e-5
    tol = case["tol"]
    # the oracle: the same numbers in float64, whole rows; this rank: its slices, in dtype
    full = [None if t is None else t.double().requires_grad_() for t in (x, w, b)]
    mine = [None if t is None else _cut(t, sizes, rank).clone().requires_grad_()
            for t in (x, w, b)]

    def sharded(xs, ws, bs):
        if is_rms:
            return nd.rms_norm_sharded(xs, ws, eps, group=group)
        return nd.layer_norm_sharded(xs, ws, bs, eps, group=group)

    y = sharded(*mine)
    y_ref, y_torch = _one_process(*full, eps, is_rms)
    if not torch.isfinite(y).all():
        failures.append(f"{name}: y not finite: {y}")
    for tag, ref in (("normbook", y_ref), ("torch", y_torch)):
        err = _err(y, _cut(ref, sizes, rank), ref)
        if not err <= tol:
            failures.append(f"{name}: y off {tag} by {err:.1e}")

    leaves = [t for t in mine if t is not None]
    leaves_ref = [t for t in full if t is not None]
    if not case["double"]:
        grads = torch.autograd.grad(y, leaves, _cut(dy, sizes, rank).to(y.dtype))
        grads_ref = torch.autograd.grad(y_ref, leaves_ref, dy)
        labels = ("dx", "dweight", "dbias")
    else:
        # a gradient penalty: P = <dL/dx, v> + <dL/dweight, v[0]> with L = <y, dy>, on each
        # rank its own slice; the penalties' sum over ranks is P of the whole row
        def penalty(out, xx, ww, vv, cut):
            gx, gw = torch.autograd.grad((out * cut(dy).to(out.dtype)).sum(), (xx, ww),
                                         create_graph=True)
            return ((gx * cut(vv).to(gx.dtype)).sum()
                    + (gw * cut(vv[(0,) * len(lead)]).to(gw.dtype)).sum())

        # the bias does not reach the penalty: its gradient is zero (materialized)
        unused = dict(allow_unused=True, materialize_grads=True)
        p = penalty(y, mine[0], mine[1], v, lambda t: _cut(t, sizes, rank))
        grads = torch.autograd.grad(p, leaves, **unused)
        labels = ("d2x", "d2weight", "d2bias")
        # torch forms second derivatives with other formulas; where the Jacobian is tiny
        # (RMSNorm of D = 1: eps / |x|^3) the two cancel differently, hence 1e-6 against it:
        # the defect it guards against was an error as large as the value
        for tag, ref, bound in (("normbook", y_ref, tol), ("torch", y_torch, max(tol, 1e-6))):
            p_ref = penalty(ref, full[0], full[1], v, lambda t: t)
            grads_ref = torch.autograd.grad(p_ref, leaves_ref, **unused)
            for label, got, want in zip(labels, grads, grads_ref):
                err = _err(got, _cut(want, sizes, rank), want)
                if not err <= bound:
                    failures.append(f"{name}: {label} off {tag} by {err:.1e}")
        return
    for label, got, want in zip(labels, grads, grads_ref):
        err = _err(got, _cut(want, sizes, rank), want)
        if not err <= tol:
            failures.append(f"{name}: {label} off normbook by {err:.1e}")


def _sharded_checks(rank, world, cases):
    """Every case on this rank: {kind: [failures]}. A case of two ranks runs on ranks 0 and 1
    (a subgroup, so the ``group`` argument is exercised too); rank 2 sits it out."""
    pair = dist.new_group([0, 1])                 # every rank creates it, in the same order
    out = {}
    for case in cases:
        failures = out.setdefault(case["kind"], [])
        on = len(case["sizes"]) == world or rank < 2
        if not on:
            continue
        group = None if len(case["sizes"]) == world else pair
        try:
            _check_case(case, rank, group, failures)
        except Exception:
            failures.append(f"{case['name']}: raised\n{traceback.format_exc()}")
    out["default_eps"] = [f for dtype in (torch.float32, torch.float64)
                          for f in _default_eps_failures(rank, dtype)]
    out["listeners"] = _listeners_beyond_loopback()
    return out


def _default_eps_failures(rank, dtype):
    """rms_norm_sharded without eps against normbook.rms_norm without eps on the same input,
    D = 8 split 3 + 1 + 4: rows of mean square near 1e-5, where eps = 1e-6 (the sharded
    default once) instead of the machine epsilon (1.2e-7 in fp32, 2.2e-16 in fp64) moves y
    by about 4%, far beyond the sums' rounding (a relative 1e-5 in fp32, 1e-12 in fp64)."""
    import normbook

    sizes, tol = (3, 1, 4), dict([F64, F32])[dtype]
    g = torch.Generator().manual_seed(5)                   # the same data on every rank
    f64 = dict(generator=g, dtype=torch.float64)
    x = (1e-3 * (3 + torch.randn(4, sum(sizes), **f64))).to(dtype)       # (N, D)
    w = (1 + 0.1 * torch.randn(sum(sizes), **f64)).to(dtype)             # (D,)
    want = _cut(normbook.rms_norm(x, (sum(sizes),), w), sizes, rank)
    mine = _cut(x, sizes, rank), _cut(w, sizes, rank)
    failures = []
    err = _err(nd.rms_norm_sharded(*mine), want, want)
    if not err <= tol:
        failures.append(f"{dtype}: the default eps is off normbook.rms_norm's by {err:.1e}")
    # the data can tell the defaults apart: with eps = 1e-6 the same call is off by far more
    old = _err(nd.rms_norm_sharded(*mine, 1e-6), want, want)
    if not old > 100 * tol:
        failures.append(f"{dtype}: eps = 1e-6 is off by {old:.1e} only: the check is blind")
    return failures


def _listeners_beyond_loopback():
    """This process's listening sockets on an address other than loopback."""
    try:
        import psutil
    except ImportError:   # pragma: no cover
        return []
    found = psutil.Process().net_connections(kind="inet")
    return [f"{c.laddr.ip}:{c.laddr.port}" for c in found if c.status == psutil.CONN_LISTEN
            and not (c.laddr.ip.startswith("127.") or c.laddr.ip == "::1")]


# float64 cases are exact up to rounding: 1e-12 of the output's largest value. fp32 rows near
# 1e20 are compared with the float64 result of the same fp32 numbers: fp32 rounding, 1e-5.
F64, F32 = (torch.float64, 1e-12), (torch.float32, 1e-5)


def _case(kind, sizes, is_rms, seed, dtype=F64, scale=1.0, lead=(4,), double=False,
          const=None):
    norm = "rms" if is_rms else "ln"
    return dict(kind=kind, name=f"{kind} {norm} split {sizes} lead {lead} const {const}",
                sizes=tuple(sizes), is_rms=is_rms, seed=seed, dtype=dtype[0], tol=dtype[1],
                scale=scale, lead=tuple(lead), double=double, const=const)


def _random_splits(n, seed=0):
    """n random splits of D = 1..9 features over 2 or 3 ranks, zero-width slices included."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for i in range(n):
        ranks = 2 + int(torch.randint(2, (), generator=g))
        D = 1 + int(torch.randint(9, (), generator=g))
        cuts = sorted(torch.randint(D + 1, (ranks - 1,), generator=g).tolist())
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, D])]
        lead = [(), (3,), (2, 3)][i % 3]
        cases.append(_case("random", sizes, bool(i % 2), 100 + i, lead=lead, double=i % 4 < 2))
    return cases


CASES = [
    # the reproducer: D = 5 over two ranks as 3 + 2 (rms_norm_sharded was 0.16 off)
    *(_case("uneven", s, r, 1) for s in ((3, 2), (2, 3), (4, 1)) for r in (True, False)),
    # D = 2 over three ranks: one rank holds nothing (every rank went NaN), wherever it sits
    *(_case("empty", s, r, 2) for s in ((1, 1, 0), (0, 1, 1), (1, 0, 1), (0, 2, 0))
      for r in (True, False)),
    # fp32 rows near 1e20 (all zeros before), even and uneven, one rank empty
    *(_case("overflow", s, r, 3, F32, 1e20 / 3, (2, 3))
      for s in ((16, 16), (20, 12), (7, 0, 25), (11, 11, 10)) for r in (True, False)),
    # double backward against one process and torch (its error was as large as the value)
    *(_case("double", s, r, 4, double=True) for s in ((8, 8), (5, 3), (3, 0, 4))
      for r in (True, False)),
    *_random_splits(24),
    # fp32 rows of one value: each rank's rounded sum / d_k missed the value by a unit, and
    # x - mean, a small constant, normalized to +-1 (0.93 for 54321.7 over 512 + 512), or,
    # squared past fp32 on a rank, took the rescue to 0 * inf (NaN for 1e36 over 3 + 5)
    *(_case("constant", s, False, 6, F32, lead=(2,), const=c)
      for s, c in (((512, 512), 54321.7), ((512, 512), 1000.1), ((3, 2), 123456.7),
                   ((3, 5), 1e36), ((3, 5), 1e30), ((2, 0, 3), 7.3))),
]


@pytest.fixture(scope="module")
def sharded():
    """{kind: every rank's failures} of one launch over three ranks."""
    results = nd.launch(_sharded_checks, CASES, world=WORLD)
    merged = {}
    for rank, out in enumerate(results):
        for kind, failures in out.items():
            merged.setdefault(kind, []).extend(f"rank {rank}: {f}" for f in failures)
    return merged


@pytest.mark.parametrize("kind", ["uneven", "empty", "overflow", "double", "random",
                                  "constant", "default_eps"])
def test_sharded_norms_match_one_process(sharded, kind):
    """uneven: D = 5 as 3 + 2; empty: a rank without features; overflow: fp32 near 1e20;
    double: a gradient penalty; random: random splits, some with double backward; constant:
    fp32 rows of one value, up to 1e36;
    default_eps: rms_norm_sharded's default eps is normbook.rms_norm's (fp32 and fp64)."""
    assert not sharded[kind], "\n".join(sharded[kind])


def test_default_eps_of_an_integer_x_is_refused_before_any_collective():
    """eps=None has no value for an integer x: a TypeError naming eps, not a comparison with
    None (no process group is needed to get it: the check comes first)."""
    with pytest.raises(TypeError, match=r"eps: None \(the default\) .* x is torch.int64"):
        nd.rms_norm_sharded(torch.arange(4))


@pytest.mark.parametrize("x", [torch.arange(4), torch.ones(4, dtype=torch.bool),
                               torch.ones(4, dtype=torch.complex64)], ids=str)
def test_a_sharded_norm_of_a_non_float_x_is_refused(x):
    """An integer, bool or complex x is a DTypeError naming x, before any collective, as
    normbook.layer_norm and torch refuse it (it was computed: integers came back truncated,
    complex without its imaginary part)."""
    from normbook._validate import DTypeError

    for call in (lambda: nd.layer_norm_sharded(x), lambda: nd.rms_norm_sharded(x, eps=1e-6)):
        with pytest.raises(DTypeError, match=r"^x: "):
            call()


def test_ranks_listen_on_loopback_only(sharded):
    assert not sharded["listeners"], f"listening beyond loopback: {sharded['listeners']}"


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=6), big=st.booleans(),
       seed=st.integers(0, 2**16))
def test_merge_stats_any_split(sizes, big, seed):
    """Chan's merge of any chunks of a row, empty ones included (their mean and m2 are NaN
    here: they must not matter), gives the row's mean and m2; near 1e20 in fp32 it stays
    finite where it can (m2 itself may overflow: the sharded norms then rescale)."""
    D = sum(sizes)
    if D == 0:
        return
    g = torch.Generator().manual_seed(seed)
    x = 3 + torch.randn(D, generator=g, dtype=torch.float64)
    dtype = torch.float32 if big else torch.float64
    x = (1e20 * x if big else x).to(dtype)
    chunks = torch.split(x, sizes)
    nan = torch.tensor(float("nan"), dtype=dtype)
    mean = torch.stack([c.mean() if len(c) else nan for c in chunks])
    m2 = torch.stack([((c - c.mean()) ** 2).sum() if len(c) else nan for c in chunks])
    n = torch.tensor([float(s) for s in sizes], dtype=dtype)
    N, mean_all, m2_all = nd.merge_stats(n, mean, m2)
    xd = x.double()
    assert float(N) == D
    torch.testing.assert_close(mean_all.double(), xd.mean(), rtol=1e-6 if big else 1e-13, atol=0)
    if big:
        assert not torch.isnan(m2_all)
    else:
        torch.testing.assert_close(m2_all, ((xd - xd.mean()) ** 2).sum(), rtol=1e-12, atol=1e-12)


# --- launch: cannot hang, cannot leak ----------------------------------------------------------


def _note_pid(pid_dir, rank):
    """Write the rank's pid whole before the file appears under its name: the test signals the
    parent as soon as both files exist, and a rank stopped between creating a file and
    writing it left an empty one (seen once in a fresh clone's make test)."""
    part = Path(pid_dir, f"{rank}.part")
    part.write_text(str(os.getpid()))
    os.replace(part, Path(pid_dir, f"{rank}.pid"))


def _wait_for(paths, limit_s):
    end = time.monotonic() + limit_s
    while not all(Path(p).exists() for p in paths):
        if time.monotonic() > end:
            raise TimeoutError(f"waited {limit_s} s for {paths}")
        time.sleep(0.05)


def _fails_while_rank_zero_sleeps(rank, world, pid_dir):
    """Rank 1 raises once every rank is running; rank 0 sleeps outside any collective."""
    _note_pid(pid_dir, rank)
    if rank == 1:
        _wait_for([Path(pid_dir, f"{k}.pid") for k in range(world)], 60)
        Path(pid_dir, "raised_at").write_text(repr(time.time()))
        raise ArithmeticError("deliberate failure on rank 1")
    time.sleep(1000)


def _hangs_on_rank_one(rank, world, pid_dir):
    _note_pid(pid_dir, rank)
    if rank == 1:
        time.sleep(1000)          # outside any collective
    return rank


def _exits_on_rank_one(rank, world):
    if rank == 1:
        os._exit(0)               # no result, no traceback
    return rank


def _sleeps(rank, world, pid_dir):
    _note_pid(pid_dir, rank)
    time.sleep(1000)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pids(pid_dir):
    return [int(p.read_text()) for p in Path(pid_dir).glob("*.pid")]


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """launch()'s temporary folders go to a folder of this test's own, to be checked empty, and
    every rank launch() starts has its pid noted by launch()'s side as the rank starts, so that
    the check that no rank outlived launch() does not depend on how far a rank got (on 2 loaded
    cores a rank still importing torch at a 15 s deadline had noted nothing, and the test
    failed with "no rank recorded its pid")."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    pids = tmp_path / "pids"
    pids.mkdir()

    class Noted(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            (pids / f"started-{self.pid}.pid").write_text(str(self.pid))

    monkeypatch.setattr(nd.subprocess, "Popen", Noted)
    return folder, pids


def _assert_nothing_left(folder, pids):
    assert _pids(pids), "no rank recorded its pid"
    end = time.monotonic() + 5
    while any(_alive(p) for p in _pids(pids)) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [p for p in _pids(pids) if _alive(p)], "ranks outlived launch()"
    assert not list(folder.iterdir()), f"left behind: {list(folder.iterdir())}"


def test_failing_rank_raises_at_once_and_leaves_nothing(own_tmp):
    folder, pids = own_tmp
    with pytest.raises(RuntimeError, match="(?s)rank 1.*deliberate failure on rank 1"):
        nd.launch(_fails_while_rank_zero_sleeps, str(pids), world=2, timeout_s=120)
    delay = time.time() - float((pids / "raised_at").read_text())
    assert delay < 5, f"launch() raised {delay:.1f} s after rank 1 did"
    _assert_nothing_left(folder, pids)


def test_hanging_rank_hits_the_deadline(own_tmp):
    """The deadline counts from the launch, the ranks' start-up included; a rank may still be
    importing torch when it passes (2 loaded cores), and is killed all the same."""
    folder, pids = own_tmp
    timeout_s = 5
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"timeout_s={timeout_s}"):
        nd.launch(_hangs_on_rank_one, str(pids), world=2, timeout_s=timeout_s)
    assert time.monotonic() - start < timeout_s + 5
    _assert_nothing_left(folder, pids)


def test_rank_exiting_without_result_is_named(own_tmp):
    folder, _ = own_tmp
    with pytest.raises(RuntimeError, match="rank 1 exited with code 0 before returning a result"):
        nd.launch(_exits_on_rank_one, world=2, timeout_s=120)
    assert not list(folder.iterdir())


@pytest.mark.parametrize("sig, twice", [(signal.SIGINT, False), (signal.SIGTERM, False),
                                        (signal.SIGKILL, False), (signal.SIGINT, True),
                                        (signal.SIGTERM, True)],
                         ids=["SIGINT", "SIGTERM", "SIGKILL", "SIGINT twice", "SIGTERM twice"])
def test_parent_stopped_from_outside_leaves_nothing(tmp_path, sig, twice):
    """A parent stopped mid-run (Ctrl-C, kill, kill -9) leaves no rank and no file; so does a
    second Ctrl-C or kill a few milliseconds after the first, while launch() cleans up (it
    raised out of the cleanup, before the folder was removed: 7 runs in 9 left it), and a
    parent killed by SIGTERM dies of SIGTERM."""
    folder, pids = tmp_path / "tmp", tmp_path / "pids"
    folder.mkdir()
    pids.mkdir()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_distributed_sharded as t; "
            "t.nd.launch(t._sleeps, sys.argv[2], world=2, timeout_s=120)")
    # SIGINT at its default: a job started in the background by a shell (as CI may run make
    # test) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it
    parent = subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).parent), str(pids)],
                              env=dict(os.environ, TMPDIR=str(folder)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for([pids / "0.pid", pids / "1.pid"], 60)
        parent.send_signal(sig)
        if twice:
            time.sleep(0.002)
            parent.send_signal(sig)
        code = parent.wait(timeout=15)
    finally:
        parent.kill()
        parent.wait()
    _assert_nothing_left(folder, pids)
    if sig != signal.SIGINT:
        assert code == -sig, code


def _grads_where_ranks_differ(rank, world):
    """Rank 0's tokens go through modules a and b, rank 1's through b alone, and module c is
    used by neither: every rank's gradients after all_reduce_param_grads."""
    import torch.nn as nn

    torch.manual_seed(0)                                  # the same modules on every rank
    net = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4), "c": nn.Linear(4, 4)})
    x = torch.full((2, 4), float(rank + 1))
    h = net["a"](x) if rank == 0 else x
    net["b"](h).pow(2).sum().backward()
    done = nd.all_reduce_param_grads(net)
    return done, {k: None if p.grad is None else p.grad.tolist()
                  for k, p in net.named_parameters()}


def test_all_reduce_param_grads_where_ranks_used_different_parameters():
    """A parameter with a gradient on some ranks only counts as zeros on the others (DDP's
    rule), one with none anywhere stays None: each rank's gradients are the sum of what every
    rank computed, the same on every rank. (Skipping its own Nones, rank 1 summed its b.bias
    gradient with rank 0's a.weight, and rank 0's extra all-reduces then waited.)"""
    import torch.nn as nn

    (done0, got0), (done1, got1) = nd.launch(_grads_where_ranks_differ, world=2, timeout_s=120)
    assert done0 == done1 == 4 and got0 == got1
    torch.manual_seed(0)
    net = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4), "c": nn.Linear(4, 4)})
    for rank in (0, 1):                                   # both ranks' losses on one process
        x = torch.full((2, 4), float(rank + 1))
        net["b"](net["a"](x) if rank == 0 else x).pow(2).sum().backward()
    for k, p in net.named_parameters():
        if p.grad is None:
            assert got0[k] is None, k
        else:
            torch.testing.assert_close(torch.tensor(got0[k]), p.grad, msg=k)


def _rank_plus(rank, world, k):
    return rank + k


@pytest.mark.parametrize("kwargs", [dict(world=True), dict(world=0), dict(timeout_s=0),
                                    dict(timeout_s=float("inf")), dict(timeout_s="10"),
                                    dict(timeout_s=float("nan"))], ids=repr)
def test_launch_refuses_a_bad_world_or_timeout_before_starting(kwargs):
    """A ValueError naming the argument, before any process starts, as the docstring says (an
    infinite timeout failed in the children, a string with a TypeError, world=True ran one
    rank)."""
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"launch: {name} must be"):
        nd.launch(_rank_plus, 1, **kwargs)


def test_launch_takes_a_partial_of_a_module_level_function():
    """functools.partial has no __qualname__: launch read it for its messages and failed with
    an AttributeError; it pickles, so the ranks run it."""
    import functools

    assert nd.launch(functools.partial(_rank_plus, k=10), world=2, timeout_s=120) == [10, 11]


def _unequal_leading_shapes(rank, world, case):
    """layer_norm_sharded / rms_norm_sharded where the ranks' x disagree: the error's text."""
    shapes = {"rows": [(3, 4), (4, 4)], "order": [(2, 3, 4), (3, 2, 4)]}.get(case, [(2, 4)] * 2)
    dtype = {"dtype": torch.float64, "half dtypes": torch.bfloat16}.get(case, torch.float32)
    x = torch.randn(shapes[rank], dtype=dtype if rank == 1 else
                    (torch.float16 if case == "half dtypes" else torch.float32))
    out = []
    for fn in (nd.layer_norm_sharded, lambda x: nd.rms_norm_sharded(x, eps=1e-6)):
        try:
            fn(x)
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out


_DIFFER = {"rows": "leading shape (rank order: (3,), (4,))",
           "order": "leading shape (rank order: (2, 3), (3, 2))",
           "dtype": "dtype (rank order: torch.float32, torch.float64)",
           "half dtypes": "dtype (rank order: torch.float16, torch.bfloat16)"}


@pytest.mark.parametrize("case", list(_DIFFER))
def test_ranks_disagreeing_on_x_get_one_error_each(case):
    """Ranks whose x differ in rows, in the order of the leading dims (the same count: tokens
    paired wrongly, without a word) or in dtype (fp32 against fp64: a gather of unequal sizes,
    which gloo aborted with SIGABRT; float16 against bfloat16, which the check took as one
    dtype, their compute dtype, and computed) each raise the same ValueError naming x, what
    differs and each rank's value, and no rank waits for another."""
    for out in nd.launch(_unequal_leading_shapes, case, world=2, timeout_s=120):
        assert all(o.startswith("x: every rank of the group must call the same norm on x of the "
                                "same leading shape and dtype, with the same eps; the ranks "
                                "differ in " + _DIFFER[case]) for o in out), out


def _as_dtensor(x, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(x, init_device_mesh("cpu", (world,)), [Shard(0)])


def _disagreeing_calls(rank, world, case):
    """Ranks that call the sharded norms differently, or whose own checks refuse their
    arguments: each rank's error (type and text), or "no error"."""
    x, w = torch.randn(2, 4), torch.ones(4 if rank == 0 else 5)
    call = {"norm": lambda: (nd.layer_norm_sharded(x) if rank == 0 else nd.rms_norm_sharded(x)),
            "eps": lambda: nd.layer_norm_sharded(x, eps=1e-5 if rank == 0 else 1e-2),
            "a refused weight": lambda: nd.layer_norm_sharded(x, w),
            "x not a tensor": lambda: nd.rms_norm_sharded(x if rank == 0 else None),
            "a DTensor": lambda: nd.layer_norm_sharded(_as_dtensor(x, world)),
            "parameters": lambda: nd.all_reduce_param_grads(
                torch.nn.LayerNorm(4, bias=rank == 0)),
            "parameter dtypes": lambda: nd.all_reduce_param_grads(
                torch.nn.LayerNorm(4, dtype=torch.float32 if rank == 0 else torch.bfloat16))}[case]
    try:
        call()
        return "no error"
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("case, want", [
    ("norm", ["ValueError: x: every rank", "norm (rank order: layer_norm, rms_norm)"] * 2),
    ("eps", ["ValueError: x: every rank", "eps (rank order: 1e-05, 0.01)"] * 2),
    ("a refused weight", ["ValueError: x: rank 1 of the group refused its arguments", "",
                          "ValueError: weight: expected this rank's slice", "got (5,)"]),
    ("x not a tensor", ["ValueError: x: rank 1 of the group refused its arguments", "",
                        "TypeError: x: expected a tensor", "got NoneType"]),
    ("a DTensor", ["TypeError: x: a DTensor", "x.to_local()"] * 2),
    ("parameters", ["ValueError: module: every rank", "hold 2, 1 parameters"] * 2),
    ("parameter dtypes", ["ValueError: module: every rank", "their shapes or dtypes differ"] * 2),
])
def test_ranks_that_call_differently_all_raise_at_once(case, want):
    """Ranks that call different norms (an all-gather met an all-reduce: both waited out the
    process group's timeout), different eps (computed, each rank's y off the other's), or
    where one rank's arguments are refused (the others waited for it; for an x that is not a
    tensor, until the group's timeout, after the review of 2026-12-08), and
    all_reduce_param_grads over modules whose parameters differ in number (a wait for the
    timeout) or dtype (gloo aborted a rank): every rank raises at once, naming what differs.
    (The process group's timeout is launch's, 120 s here: a wait would fail the launch.)"""
    outs = nd.launch(_disagreeing_calls, case, world=2, timeout_s=120)
    for out, (start, part) in zip(outs, zip(want[::2], want[1::2])):
        assert out.startswith(start) and part in out, (case, out)


def _outside_the_group(rank, world):
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    x = torch.randn(2, 4)
    try:
        return nd.layer_norm_sharded(x, group=group).shape == x.shape
    except ValueError as e:
        return str(e)


def test_a_rank_outside_the_group_is_told_so():
    """A rank calling a sharded norm over a group it is not in raised torch's "stack expects a
    non-empty TensorList"; it now gets a ValueError naming the group, and the group's ranks
    compute."""
    assert nd.launch(_outside_the_group, world=3, timeout_s=120) == [
        True, True, "group: expected a group this rank belongs to; global rank 2 is not one of "
                    "its ranks"]


def _sharded_eps_like_layer_norm(rank, world):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    return [torch.equal(nd.layer_norm_sharded(x, eps=torch.tensor(1e-3)),
                        nd.layer_norm_sharded(x, eps=1e-3)),
            torch.equal(nd.rms_norm_sharded(x, eps=torch.tensor(1e-3)),
                        nd.rms_norm_sharded(x, eps=1e-3)),
            bool(nd.layer_norm_sharded(x, eps=-1e-9).isfinite().all())]


def test_sharded_norms_take_eps_as_normbook_layer_norm_does():
    """eps as a 0-d tensor (refused with a message that said it was allowed) and a negative
    eps (refused, where normbook.layer_norm and torch take it) are taken, as there."""
    assert nd.launch(_sharded_eps_like_layer_norm, world=2, timeout_s=120) == [[True] * 3] * 2


@pytest.mark.parametrize("call, error, message", [
    (lambda: nd.layer_norm_sharded(torch.randn(2, 4), eps=None), TypeError, r"^eps: expected a real"),
    (lambda: nd.layer_norm_sharded(torch.randn(2, 4), eps=True), TypeError, r"^eps: expected a real"),
    (lambda: nd.layer_norm_sharded(torch.randn(2, 4), torch.ones(4, dtype=torch.int64)),
     ValueError, r"^weight: expected this rank's slice, a floating tensor of shape \(4,\), got "
                 r"\(4,\) torch.int64"),
    (lambda: nd.rms_norm_sharded(torch.randn(2, 4), [1.0] * 4), ValueError, r"^weight: .* got list"),
    (lambda: nd.layer_norm_sharded([1.0, 2.0]), TypeError, r"^x: expected a tensor"),
    # a name where a group goes (an AttributeError of str followed it)
    (lambda: nd.rms_norm_sharded(torch.randn(2, 4), group="tp"), TypeError,
     r"^group: expected a torch.distributed.ProcessGroup or None \(the default group\), got str"),
    (lambda: nd.all_reduce_param_grads(torch.nn.LayerNorm(4), group=3), TypeError, r"^group: "),
])
def test_sharded_norms_name_the_bad_argument(call, error, message):
    """Before any collective (no process group here): LayerNorm's eps=None is refused as
    LayerNorm's (the message spoke of RMSNorm's default and of a floating x), a bool eps and
    an integer weight are refused as normbook.layer_norm refuses them (both were taken)."""
    with pytest.raises(error, match=message):
        call()


def test_merge_stats_weighs_integer_counts_in_means_dtype():
    """int64 counts divided into float32 weights: the float64 mean was off by 2e-8."""
    g = torch.Generator().manual_seed(0)
    chunks = torch.split(3 + torch.randn(10, generator=g, dtype=torch.float64), [3, 7])
    mean = torch.stack([c.mean() for c in chunks])
    m2 = torch.stack([((c - c.mean()) ** 2).sum() for c in chunks])
    N, mean_all, m2_all = nd.merge_stats(torch.tensor([3, 7]), mean, m2)
    want = nd.merge_stats(torch.tensor([3.0, 7.0], dtype=torch.float64), mean, m2)
    assert N.dtype == torch.int64 and int(N) == 10
    assert float((mean_all - want[1]).abs()) <= 1e-15 and float((m2_all - want[2]).abs()) <= 1e-14
    with pytest.raises(TypeError, match="merge_stats: n: expected a tensor, got list"):
        nd.merge_stats([3, 7], mean, m2)


def test_merge_stats_counts_past_float16s_range():
    """Counts cast to float16 means overflowed at 65504: the merged mean was NaN."""
    N, mean, m2 = nd.merge_stats(torch.tensor([70000, 70000]),
                                 torch.tensor([[1.0], [3.0]]).half(),
                                 torch.tensor([[2.0], [2.0]]).half())
    assert int(N) == 140000 and mean.dtype == torch.float16 and float(mean) == 2.0
