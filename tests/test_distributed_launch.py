"""normbook.distributed.launch and the chapter's experiments, on two gloo CPU processes.

One spawn runs all four experiments (starting two Pythons is most of the time); a second checks
that a failure on one rank comes back to the parent as an error with the child's traceback.
"""

from __future__ import annotations

import pytest

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():   # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from normbook import distributed as nd  # noqa: E402

pytestmark = pytest.mark.slow   # gloo processes: seconds each

WORLD = 2


def _all_experiments(rank, world, with_kernels):
    """Every experiment of the chapter in one process group."""
    out = {"rank": rank, "world": world,
           "sp": nd.sequence_parallel_experiment(rank, world),
           "tp": nd.feature_parallel_experiment(rank, world),
           "fsdp": nd.fsdp_experiment(rank, world)}
    if with_kernels:
        out["dtensor"] = nd.dtensor_experiment(rank, world)
    return out


def _fails_on_rank_one(rank, world):
    if rank == 1:
        raise ArithmeticError("deliberate failure on rank 1")
    return rank


def test_launch_runs_the_experiments():
    import importlib.util

    with_kernels = importlib.util.find_spec("triton") is not None
    results = nd.launch(_all_experiments, with_kernels, world=WORLD)
    assert [r["rank"] for r in results] == [0, 1] and results[0]["world"] == WORLD
    for r in results:
        sp = r["sp"]
        # half the tokens give a dweight far from the whole batch's; summed, equal up to rounding
        assert sp["dweight_err_local"] > 0.1 and sp["dweight_err_reduced"] < 1e-14
        # without the all-reduce the replicas drift apart; with it they stay bitwise equal
        assert sp["drift_local"] > 0.1 and sp["drift_synced"] == 0.0
        assert sp["err_local"] > 0.1 and sp["err_synced"] < 1e-12   # float64, 20 SGD steps
        tp = r["tp"]
        assert tp["layer_norm_err"] < 1e-12 and tp["rms_norm_err"] < 1e-12   # float64
        fs = r["fsdp"]
        assert fs["at_rest"] == (16 // WORLD,) and fs["placement"] == "S(0)"
        assert fs["y_err"] < 1e-6 and fs["grad_err"] < 1e-5      # fp32, 8 tokens
        if with_kernels:
            seq, feat = r["dtensor"][1], r["dtensor"][2]
            assert (seq["y"], seq["dweight"], seq["comms"]) == ("S(1)", "P(sum)", {})
            assert feat["y"] == "R" and sum(feat["comms"].values()) >= 1
            assert seq["err"] < 1e-5 and feat["err"] < 1e-5       # fp32 kernels vs torch


def test_launch_reports_a_failing_rank():
    with pytest.raises(RuntimeError, match="(?s)rank 1.*deliberate failure on rank 1"):
        nd.launch(_fails_on_rank_one, world=WORLD)


def test_launch_refuses_functions_a_child_cannot_import():
    def local(rank, world):
        return rank

    with pytest.raises(ValueError, match="module-level"):
        nd.launch(local)
