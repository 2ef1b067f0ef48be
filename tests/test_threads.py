"""The host side shared by threads: several Python threads (an inference server's) calling the
kernels at once. Each test forces the interleaving that a race needs, with events and
barriers, rather than hoping for it: the windows are a few bytecodes wide."""

from __future__ import annotations

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
