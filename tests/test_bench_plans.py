"""normbook-bench plans (normbook.bench.plans): the backward of few rows timed as one program and
as a grid with its finish. Here in Triton's interpreter, which times nothing worth keeping:
that each side runs the plan it names, and that the command writes what it says."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from normbook.bench import plans  # noqa: E402
from normbook.kernels import _config  # noqa: E402


def test_one_program_rows_switches_the_plans_and_restores_them():
    before = _config.backward_plan(4, 4096, -1, 2, False, False, True, True, 0, False)
    with plans.one_program_rows(0):
        grid = _config.backward_plan(4, 4096, -1, 2, False, False, True, True, 0, False)
    after = _config.backward_plan(4, 4096, -1, 2, False, False, True, True, 0, False)
    assert before[0].grid == (1,) and len(before) == 1      # M = 4 <= ONE_PROGRAM_ROWS
    assert grid[0].grid[0] > 1 and len(grid) == 2            # partials and the finish
    assert after == before and _config.ONE_PROGRAM_ROWS >= 4


def test_each_side_runs_its_plan(tmp_path, capsys):
    from normbook.bench.cli import main

    out = tmp_path / "plans.json"
    assert main(["plans", "--dims", "2048", "--rows", "4", "--share-rows", "64",
                 "--forward-dims", "1024", "--json", str(out)]) == 0
    found = json.loads(out.read_text())
    rows = found["rows"]
    assert [(r["D"], r["M"]) for r in rows] == [(2048, 4), (2048, 64)]
    few, many = rows
    assert few["one_us"] > 0 and few["grid_programs"] > 1 and few["finish_us"] > 0
    assert many["one_us"] is None and many["grid_programs"] > 1
    # (the interpreter's wall clock: the finish's share is the ratio, whatever the machine's
    # load makes of either time; a fraction of the backward only on a GPU)
    assert many["finish_share"] == pytest.approx(many["finish_us"] / many["grid_us"])
    assert many["finish_share"] > 0
    assert "finish_block_us" not in few and sorted(many["finish_block_us"]) == ["16", "32", "64"]
    assert all(us > 0 for us in many["finish_block_us"].values())
    (fwd,) = found["forward"]
    assert (fwd["D"], fwd["M"]) == (1024, 64) and fwd["tiles_us"] > 0 and fwd["row_us"] > 0
    assert found["row_from"] == _config.ROW_FROM
    printed = capsys.readouterr().out
    assert "D   2048 M      4" in printed and "forward D   1024 M     64" in printed


def test_row_from_switches_the_forward_plans_and_restores_them():
    """On a GPU (an H200's shape), rows of 1024 share tiles of a persistent grid; with
    ROW_FROM at 1024 they are a program each, 4 warps (8 values a thread), grid M; after it,
    tiles again. Rows of 4096 and wider are a program each either way."""
    h200 = _config.Device(90, 132)

    def plan(D):
        return _config.forward_plan(32768, D, h200, 2, False, False, True, True)[0]
    before = plan(1024)
    with plans.row_from(1024):
        row = plan(1024)
        assert plan(512).constexprs["ROWS"] > 1               # narrower: tiles still
    assert before.constexprs["ROWS"] > 1 and before.grid[0] < 32768
    assert (row.grid, row.constexprs["ROWS"], row.options["num_warps"]) == ((32768,), 1, 4)
    assert plan(1024) == before and plan(4096).grid == (32768,)


def test_it_refuses_rows_the_rows_backward_does_not_take(capsys):
    from normbook.bench.cli import main

    assert main(["plans", "--dims", str(2 * _config.MAX_FUSED_D_BWD)]) == 2
    assert "--dims: the rows backward takes D up to" in capsys.readouterr().err
    assert main(["plans", "--forward-dims", str(2 * _config.MAX_FUSED_D_FWD)]) == 2
    assert "--forward-dims: the rows forward takes D up to" in capsys.readouterr().err


def test_the_one_program_backward_matches_the_grid_s():
    """The same sums either way (not bitwise: the grid adds partials in another order)."""
    from normbook.kernels import _backward, _forward

    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(6, 2048, generator=g), torch.randn(6, 2048, generator=g)
    w, b = torch.randn(2048, generator=g), torch.randn(2048, generator=g)
    _, _, stats = _forward.norm_forward(x, None, w, b, 1e-5, False)
    one = _backward.norm_backward(dy, None, x, w, stats, torch.float32, False)
    with plans.one_program_rows(0):
        grid = _backward.norm_backward(dy, None, x, w, stats, torch.float32, False)
    assert _config.backward_plan(6, 2048, -1, 4, False, False, True, True, 0, False)[0].grid \
        == (1,)
    for a, c in zip(one, grid):
        torch.testing.assert_close(a, c)


def test_the_finish_s_column_width_changes_no_bit():
    """The finish candidates the command times differ only in their columns per program: each
    column's partials are summed FINISH_BLOCK_P rows a step in the same order, so dweight and
    dbias are the same bits whichever width wins."""
    from normbook.kernels import _backward, _launch

    g = torch.Generator().manual_seed(1)
    groups, D = 37, 1000
    pw, pb = torch.randn(2, groups, D, generator=g)
    got = []
    for block in (64, 32, 16):
        finish = _config.finish_plan(D, True, True, groups, block)
        assert finish.grid == (-(-D // block),)
        dw, db = torch.empty(D, dtype=torch.bfloat16), torch.empty(D)
        _launch.launch(_backward._KERNELS[finish.kernel], finish.grid,
                       (pw, pb, dw, db, groups, D), finish.flags)
        got.append((dw, db))
    for dw, db in got[1:]:
        assert torch.equal(dw, got[0][0]) and torch.equal(db, got[0][1])


def test_a_row_that_fails_is_recorded_and_the_json_is_written_as_it_goes(tmp_path, monkeypatch):
    """plans wrote its JSON once, at the end, and a row that raised (a capture refused, a
    plan not as assumed) ended the command: a run stopped at its limit, or one failure, lost
    every row. Now each row that raises records its error, the others are measured, and the
    JSON is written again after every row."""
    import json

    from normbook.bench.cli import main

    real_case, seen = plans._case, []

    def case(M, D, device, finish_block=0):
        if M == 4:
            raise RuntimeError("planted")
        return real_case(M, D, device, finish_block)

    def bench(fn, device):
        out = tmp_path / "plans.json"
        seen.append(len(json.loads(out.read_text())["rows"]) if out.exists() else 0)
        return (0.001,)

    monkeypatch.setattr(plans, "_case", case)
    monkeypatch.setattr("normbook.bench.timing.bench", bench)
    out = tmp_path / "plans.json"
    assert main(["plans", "--dims", "256", "--rows", "1,4", "--share-rows", "8",
                 "--forward-dims", "256", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["M"] for r in rows] == [1, 4, 8]
    assert rows[1]["error"] == "RuntimeError: planted" and "error" not in rows[0]
    assert rows[2]["grid_us"] == 1.0
    # the JSON on disk as each timing starts: none yet for M = 1, both rows before it for
    # M = 8, all three for the forward's two timings
    assert seen[:3] == [0, 0, 2] and seen[-2:] == [3, 3], seen
