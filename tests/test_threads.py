"""The host side shared by threads: several Python threads (an inference server's) calling the
kernels at once. Each test forces the interleaving that a race needs, with events and
barriers, rather than hoping for it: the windows are a few bytecodes wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

pytest.importorskip("triton")

from normbook.kernels import _config, _launch  # noqa: E402


def test_two_threads_planning_new_kernels_get_distinct_launch_ids(monkeypatch):
    """A plan's launch id names its kernel and flags in every kept launch key, so two distinct
    ones must never share an id. Two threads building their first plans at once (a server's
    first requests: a LayerNorm and an RMSNorm of one shape) both read the table's size
    before either added its entry, and took the same id: the RMSNorm's launches then found
    the LayerNorm's kept kernel under their key."""
    met = threading.Barrier(2)

    class Table(dict):
        def setdefault(self, key, value):
            try:            # both threads here at once, if nothing keeps them apart
                met.wait(1)
            except threading.BrokenBarrierError:
                pass
            return super().setdefault(key, value)

    monkeypatch.setattr(_config, "_launch_ids", Table())
    ids = {}

    def plan(name):
        ids[name] = _config._launch_id(name, {"IS_RMS": name == "rms"})

    threads = [threading.Thread(target=plan, args=(name,)) for name in ("layer", "rms")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(ids) == 2 and ids["layer"] != ids["rms"], ids
    assert _config._launch_id("layer", {"IS_RMS": False}) == ids["layer"]     # and kept


def test_forgetting_the_ready_calls_while_another_thread_makes_one(monkeypatch):
    """``forget_ready`` (when the kept kernels' table is full: a server seeing many row counts)
    ran over the ready table while other threads' first calls of a signature added to it:
    'dictionary changed size during iteration', raised from the launch that filled the
    table. Every Ready it empties is marked no longer live."""
    monkeypatch.setattr(_launch, "READY", {})
    inside, added = threading.Event(), threading.Event()

    class Slow:
        """A ready call whose truth test (forget_ready's) lets another thread add one."""
        live = True

        def __bool__(self):
            inside.set()
            added.wait(2)
            return True

    def other():
        inside.wait(2)
        _launch.READY["new"] = made     # what functional._slow does, in another thread
        added.set()

    made = Slow()
    _launch.READY["old"] = Slow()
    t = threading.Thread(target=other)
    t.start()
    try:
        _launch.forget_ready()
    finally:
        added.set()
        t.join(10)
    assert not _launch.READY.get("old")


_EPOCH_ORDER_SCRIPT = r'''
import json, threading, warnings
warnings.simplefilter("ignore")
import torch
from normbook.kernels import _backward, _forward, _launch

record = []
with _launch.stub_driver(record):
    x, w = torch.randn(2, 20000).bfloat16(), torch.randn(20000).bfloat16()
    y, _, stats = _forward.norm_forward(x, None, w, None, 1e-5, True)
    dy = torch.ones_like(y)
    _backward.norm_backward(dy, None, x, w, stats, None, True)    # compiled and kept
    first_taken, second_launched = threading.Event(), threading.Event()
    shared, slots = _backward.launch_shared, _backward._slots

    def taking(*a, **k):
        out = slots(*a, **k)
        if threading.current_thread().name == "first":
            first_taken.set()
        return out

    def launching(*a, **k):
        if threading.current_thread().name == "first":
            second_launched.wait(3)     # the first thread is descheduled before its launch
        shared(*a, **k)
        if threading.current_thread().name == "second":
            second_launched.set()

    _backward._slots, _backward.launch_shared = taking, launching

    def second():
        first_taken.wait(3)
        _backward.norm_backward(dy, None, x, w, stats, None, True)

    n = len(record)
    threads = [threading.Thread(target=lambda: _backward.norm_backward(dy, None, x, w, stats,
                                                                       None, True), name="first"),
               threading.Thread(target=second, name="second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    # the sharing launches, in the order they reached the stream: (slots' address, epoch)
    print(json.dumps([[a[9 + 6].data_ptr(), a[9 + 7]] for a in record[n:]
                      if len(a) > 16 and isinstance(a[9 + 6], torch.Tensor)
                      and a[9 + 6].dtype == torch.int64]))
'''


def test_sharing_launches_on_one_stream_reach_it_in_the_order_of_their_epochs():
    """The wide backward's slots are kept per stream and not zeroed: each launch's epoch is the
    highest tag any launch before it used, so that no word it finds is tagged as one of its
    rows, and a program's own word (where its warps agree which rows they left) holds no
    later launch's mark. Two threads on one stream (each thread's default) took their epochs
    in one order and could launch in the other: the later epoch ran first, and the earlier
    one's programs then read its marks, higher than their own, as "no row left" and skipped
    the rows whose wait had run out (dx never written there). Under the stub driver: a thread
    that has its epoch and is descheduled before its launch holds the second thread's
    launch back."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _EPOCH_ORDER_SCRIPT], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    launches = json.loads(r.stdout)
    assert len(launches) == 2 and launches[0][0] == launches[1][0], launches   # one buffer
    assert launches[0][1] < launches[1][1], launches
