"""The exchange of the row-sharing kernels with its programs running at the same time, as on a
GPU, and with programs that start late or never.

Triton's interpreter runs a launch's programs one after another, so in the other tests a wait
for another program's slot never waits: the first program of a row computes every slot. Here
each program of one launch runs in a process of its own (forked, Triton's interpreter, the
launch's tensors in shared memory, so that slots, atomics and volatile loads cross processes as
they cross SMs), so the waits wait: for a program that is running, for one that starts late,
and, up to their bound, for one that never starts, whose slice the others then compute
themselves. The launch is the launcher's own (``_backward.norm_backward``; the forward shares
no row), captured instead of run.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time

import pytest
import torch

pytest.importorskip("triton")

from normbook.kernels import _backward, _config, _forward, ops  # noqa: E402

pytestmark = [pytest.mark.slow,   # a process per program
              pytest.mark.skipif(not ops.interpreted(), reason="runs programs in Triton's interpreter")]

D = 40000            # fp32: 20 slices of 2048
EPS = 1e-5


def _program(kernel, args, flags, programs, pid, delay, ends):
    """In a forked process: program ``pid`` of a launch of ``programs``, and only it; the
    time it ended goes to ``ends[pid]``."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    builder.set_grid_dim = lambda *_: setattr(builder, "grid_dim", (programs, 1, 1))
    builder.set_grid_idx = lambda *_: setattr(builder, "grid_idx", (pid, 0, 0))
    time.sleep(delay)
    kernel[(1,)](*args, **flags)
    ends[pid] = time.monotonic()


def _capture(monkeypatch, module, launch):
    """Run ``launch`` (a launcher call) with its row-sharing kernel captured, not launched:
    returns what it returned and (kernel, programs, args, flags), the tensors moved to shared
    memory (in place: the launcher's outputs are the same tensors)."""
    seen = {}
    monkeypatch.setattr(module, "launch_shared", lambda kernel, plan, args, *_: seen.update(
        kernel=kernel, programs=plan.grid[0], args=args, flags=plan.flags))
    out = launch()
    for a in seen["args"]:
        if isinstance(a, torch.Tensor):
            a.share_memory_()
    return out, seen


def _run(seen, polls, delays, never=()):
    """Every program of the captured launch but ``never``, each in its own process, started
    together (program p after ``delays.get(p, 0)`` seconds); waits of at most ``polls`` reads.
    Returns each program's end, in seconds after the start; fails if a program fails or
    all have not ended in 120 s."""
    ctx = multiprocessing.get_context("fork")
    flags = dict(seen["flags"], POLLS=polls)
    ends = ctx.Array("d", seen["programs"])
    procs = [ctx.Process(target=_program, args=(seen["kernel"], seen["args"], flags,
                                                seen["programs"], p, delays.get(p, 0.0), ends))
             for p in range(seen["programs"]) if p not in never]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=max(1.0, 120 - (time.monotonic() - start)))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{len(alive)} programs still running after 120 s: a wait that did not end"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [e - start if p not in never else None for p, e in enumerate(ends)]


def _inputs(M):
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, D, generator=g) * 2 + 1
    w, b = torch.randn(D, generator=g), torch.randn(D, generator=g)
    return x, w, b, torch.randn(M, D, generator=g)


def test_backward_programs_together_late_and_absent(monkeypatch):
    """The backward's exchange of c1, c2 (one row, 20 programs): together, with one a second
    late, and with one absent whose slice the others compute (launched afterwards, it
    completes dx and its share of dweight)."""
    x, w, b, dy = _inputs(1)
    _, _, stats = _forward.norm_forward(x, None, w, b, EPS, False)
    want = _backward.norm_backward(dy, None, x, w, stats, b.dtype, False)
    for delays, never in (({}, ()), ({5: 1.0}, ()), ({}, {7})):
        (dx, dw, db), seen = _capture(monkeypatch, _backward, lambda: _backward.norm_backward(
            dy, None, x, w, stats, b.dtype, False))
        assert seen["programs"] == 20
        ends = _run(seen, polls=1_000_000 if not never else 300, delays=delays, never=never)
        if delays:                                   # one row: everyone waited for the late one
            assert min(e for p, e in enumerate(ends) if p not in delays) > 1.0, ends
        if never:
            _run(seen, polls=300, delays={}, never=set(range(20)) - set(never))
        for got, ref in zip((dx, dw, db), want):
            assert torch.equal(got, ref), (delays, never)


def test_backward_ring_reused_by_later_rows(monkeypatch):
    """One group of programs over 4 rows: each row's slots are those of the row two before it
    (the ring of two rows per group), found by their tag. Together, then with one program
    absent whose partners run out of waiting, finish every row in order and leave the ring to
    later rows; launched afterwards, alone, it finds its rows' slots overwritten, computes them
    itself, and dx is bitwise the one-by-one one."""
    x, w, b, dy = _inputs(4)
    _, _, stats = _forward.norm_forward(x, None, w, b, EPS, False)
    want = _backward.norm_backward(dy, None, x, w, stats, b.dtype, False)
    plan = _config.backward_plan(4, D, -1, 4, False, False, True, True, 0, True)[0]
    # a slot buffer of its own: one group running all 4 rows tags more rows than the plan's
    # groups do, past the epoch the launcher gives the buffer's next launch
    monkeypatch.setattr(_backward, "_slot_buffers", {})
    S, block, SLICES = plan.slices, plan.constexprs["BLOCK_D"], plan.constexprs["SLICES"]
    (dx, _, _), seen = _capture(monkeypatch, _backward, lambda: _backward.norm_backward(
        dy, None, x, w, stats, b.dtype, False))
    dx.fill_(float("nan"))                             # what no program writes stays NaN
    slots, epoch = seen["args"][6:8]                   # the rows in flight, not M x S
    # each group's ring (2 rows of 2 words a slot), then a word per program
    assert seen["programs"] > S and plan.slot_words == (
        seen["programs"] // S * 4 * SLICES + seen["programs"]) <= slots.numel()
    one_group = dict(seen, programs=S)
    _run(one_group, polls=1_000_000, delays={})
    assert torch.equal(dx, want[0])
    # group 0's ring: (place, word, slot), slots S.. unused; rows 2 and 3, tagged
    # epoch + i + 1, each in the place of its tag modulo 2
    tags = (slots[:4 * SLICES].view(2, 2, SLICES)[:, :, :S] >> 32).tolist()
    last = sorted((epoch + 3, epoch + 4), key=lambda tag: (tag - 1) % 2)
    assert tags == [[[last[0]] * S] * 2, [[last[1]] * S] * 2], (tags, epoch)
    dx.fill_(float("nan"))
    slots.zero_()                       # the same launch again (its epoch): the slots zeroed
    missing = 4
    _run(one_group, polls=300, delays={}, never={missing})
    cols = slice(missing * block, (missing + 1) * block)
    assert torch.isnan(dx[:, cols]).all()              # nobody wrote the absent program's part
    rest = torch.ones(D, dtype=torch.bool)
    rest[cols] = False
    assert torch.equal(dx[:, rest], want[0][:, rest])
    _run(one_group, polls=300, delays={}, never=set(range(S)) - {missing})
    assert torch.equal(dx, want[0])


def test_rms_backward_publishes_one_word_and_the_rest_is_right(monkeypatch):
    """RMSNorm's slots carry one word (c2's share: it has no c1): its programs together with
    one absent, whose slice the others compute, then the absent one alone: bitwise the
    one-by-one dx and dweight."""
    x, w, _, dy = _inputs(1)
    _, _, stats = _forward.norm_forward(x, None, w, None, EPS, True)
    want = _backward.norm_backward(dy, None, x, w, stats, None, True)
    (dx, dw, _), seen = _capture(monkeypatch, _backward, lambda: _backward.norm_backward(
        dy, None, x, w, stats, None, True))
    slots, epoch = seen["args"][6:8]
    programs = seen["programs"]
    _run(seen, polls=300, delays={}, never={3})
    SLICES = seen["flags"]["SLICES"]
    place = slots[epoch % 2 * 2 * SLICES:][:2 * SLICES] >> 32    # the row's, tagged epoch + 1
    assert (place[:SLICES] != epoch + 1).all() and (place[SLICES:] == epoch + 1).any()  # no a
    _run(seen, polls=300, delays={}, never=set(range(programs)) - {3})
    assert torch.equal(dx, want[0]) and torch.equal(dw, want[1])


def test_words_of_an_earlier_launch_are_not_taken(monkeypatch):
    """Two launches into one slot buffer, not zeroed between them (the launcher keeps one per
    stream), with other data. In the second, one program is absent at first: its partners find
    its slot holding the first launch's word for the same row and place, tagged below their
    epoch, so they wait their bound, compute its slice themselves, and, with it launched
    afterwards, dx and dweight are bitwise the one-by-one ones. The same second launch given the
    first one's epoch (tags that restart with each launch, as zeroed slots had them) takes the
    stale word: the epoch is what keeps the answer right."""
    monkeypatch.setattr(_backward, "_slot_buffers", {})
    x, w, b, dy = _inputs(1)
    x2, dy2 = x * 0.5 - 1, dy.flip(1)                  # the second launch's rows
    _, _, stats = _forward.norm_forward(x, None, w, b, EPS, False)
    _, _, stats2 = _forward.norm_forward(x2, None, w, b, EPS, False)
    want = _backward.norm_backward(dy2, None, x2, w, stats2, b.dtype, False)

    def launch(x, dy, stats):
        return _capture(monkeypatch, _backward, lambda: _backward.norm_backward(
            dy, None, x, w, stats, b.dtype, False))

    (_, _, _), first = launch(x, dy, stats)
    _run(first, polls=1_000_000, delays={})
    slots, epoch = first["args"][6:8]
    for again in (False, True):
        (dx, dw, db), second = launch(x2, dy2, stats2)
        assert second["args"][6].data_ptr() == slots.data_ptr() and second["args"][7] > epoch
        if again:
            second["args"] = (*second["args"][:7], epoch, *second["args"][8:])
        missing = 5
        _run(second, polls=300, delays={}, never={missing})
        _run(second, polls=300, delays={}, never=set(range(second["programs"])) - {missing})
        right = all(torch.equal(got, ref) for got, ref in zip((dx, dw, db), want))
        assert right != again, again
        _run(first, polls=1_000_000, delays={})        # the first launch's words again


@pytest.fixture
def one_row_behind(monkeypatch):
    """Plans whose sharing backward publishes a row ahead of the one it waits for
    (``_config.EXCHANGE_LAG = 1``: a ring of four rows a group); ``in_force()``, a context in
    which the plans are those in force (LAG 0), for the answers to compare with."""
    @contextlib.contextmanager
    def in_force():
        monkeypatch.setattr(_config, "EXCHANGE_LAG", 0)
        _config.backward_plan.cache_clear()
        yield
        monkeypatch.setattr(_config, "EXCHANGE_LAG", 1)
        _config.backward_plan.cache_clear()

    monkeypatch.setattr(_config, "EXCHANGE_LAG", 1)
    _config.backward_plan.cache_clear()
    yield in_force
    _config.backward_plan.cache_clear()


def _no_wait_ran_out(seen, groups):
    """Whether no program of the captured launch left a row for after its loop: each one's own
    word, past the groups' rings, holds no mark of this launch (epoch + 1 in its high half)."""
    slots, epoch = seen["args"][6:8]
    ring_words = groups * seen["flags"]["RING"] * 2 * seen["flags"]["SLICES"]
    own = slots[ring_words:ring_words + seen["programs"]]
    return bool(((own >> 32) != epoch + 1).all())


def test_one_row_behind_reuses_a_ring_of_four_rows(monkeypatch, one_row_behind):
    """LAG 1, one group of programs over 8 rows: each publishes row i before it waits for row
    i - 1, in a ring of four rows (a partner may still read row i - 3), each place used twice.
    Together: dx bitwise the one-by-one one, no wait ran out, and the last four rows' tags in
    the places of their tags modulo 4 (dweight and dbias: the plan's groups' partials, which
    one group running every row does not fill; the late program's test checks them). With one
    program absent, its partners run out of waiting, publish no more and finish every row in
    order (the absent one's columns unwritten); launched afterwards, alone, it completes them:
    bitwise again. The answer to match is LAG 0's: the same sums in the same order, the same
    bits."""
    M = 8
    x, w, b, dy = _inputs(M)
    _, _, stats = _forward.norm_forward(x, None, w, b, EPS, False)
    with one_row_behind():                             # (LAG 0: the answer to match)
        want = _backward.norm_backward(dy, None, x, w, stats, b.dtype, False)
    plan = _config.backward_plan(M, D, -1, 4, False, False, True, True, 0, True)[0]
    assert plan.constexprs["LAG"] == 1 and plan.constexprs["RING"] >= 4
    monkeypatch.setattr(_backward, "_slot_buffers", {})
    S, block, SLICES = plan.slices, plan.constexprs["BLOCK_D"], plan.constexprs["SLICES"]
    (dx, _, _), seen = _capture(monkeypatch, _backward, lambda: _backward.norm_backward(
        dy, None, x, w, stats, b.dtype, False))
    seen["flags"] = dict(seen["flags"], RING=4)        # the GPU's ring: four rows a group
    slots, epoch = seen["args"][6:8]
    one_group = dict(seen, programs=S)
    dx.fill_(float("nan"))
    _run(one_group, polls=1_000_000, delays={})
    assert torch.equal(dx, want[0])
    assert _no_wait_ran_out(one_group, groups=1)
    tags = (slots[:8 * SLICES].view(4, 2, SLICES)[:, :, :S] >> 32).tolist()
    last = sorted(range(epoch + 5, epoch + 9), key=lambda tag: (tag - 1) % 4)
    assert tags == [[[tag] * S] * 2 for tag in last], (tags, epoch)
    dx.fill_(float("nan"))
    slots.zero_()
    missing = 3
    _run(one_group, polls=300, delays={}, never={missing})
    assert not _no_wait_ran_out(one_group, groups=1)   # (the check sees a wait run out)
    cols = slice(missing * block, (missing + 1) * block)
    assert torch.isnan(dx[:, cols]).all()
    rest = torch.ones(D, dtype=torch.bool)
    rest[cols] = False
    assert torch.equal(dx[:, rest], want[0][:, rest])
    _run(one_group, polls=300, delays={}, never=set(range(S)) - {missing})
    assert torch.equal(dx, want[0])


def test_one_row_behind_waits_for_a_late_program(monkeypatch, one_row_behind):
    """LAG 1, the programs of a row together, one a second late: the others publish the row
    and wait; nobody's wait runs out (the bound far past a second), and dx, dweight and dbias
    (one group: it writes them itself) are bitwise the one-by-one ones. Then one group over 3
    rows with its program 5 late: its partners publish row 1 ahead, wait on row 0 until it
    comes, and dx is bitwise again, no wait run out."""
    x, w, b, dy = _inputs(3)
    _, _, stats = _forward.norm_forward(x, None, w, b, EPS, False)
    with one_row_behind():                             # (LAG 0: the answers to match)
        want = _backward.norm_backward(dy, None, x, w, stats, b.dtype, False)
        first = _backward.norm_backward(dy[:1], None, x[:1], w, stats[:, :1].contiguous(),
                                        b.dtype, False)
    (dx, dw, db), seen = _capture(monkeypatch, _backward, lambda: _backward.norm_backward(
        dy[:1], None, x[:1], w, stats[:, :1].contiguous(), b.dtype, False))
    assert seen["programs"] == 20                      # one row: one group
    ends = _run(seen, polls=1_000_000, delays={5: 1.0})
    assert min(e for p, e in enumerate(ends) if p != 5) > 1.0, ends
    assert _no_wait_ran_out(seen, groups=1)
    assert all(torch.equal(got, ref) for got, ref in zip((dx, dw, db), first))
    monkeypatch.setattr(_backward, "_slot_buffers", {})
    (dx, _, _), seen = _capture(monkeypatch, _backward, lambda: _backward.norm_backward(
        dy, None, x, w, stats, b.dtype, False))
    one_group = dict(seen, programs=20, flags=dict(seen["flags"], RING=4))
    dx.fill_(float("nan"))
    ends = _run(one_group, polls=1_000_000, delays={5: 1.0})
    assert min(e for p, e in enumerate(ends) if p != 5) > 1.0, ends
    assert _no_wait_ran_out(one_group, groups=1)
    assert torch.equal(dx, want[0])
