"""normbook-bench shapes (normbook.bench.shapes): wide rows timed in candidate block shapes beside
the shape in force. Here in Triton's interpreter, which times nothing worth keeping: that each
shape is the plan it names, that the plans in force are restored, that every candidate gives the
shape in force's answer, and (the interpreter off, in a subprocess) that --compile-only compiles
them for sm_90 and reads registers and spills."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from normbook.bench import shapes  # noqa: E402
from normbook.kernels import _backward, _config  # noqa: E402

H200 = _config.Device(90, 132)
M = 32768


def _fwd(D):
    return _config.forward_plan(M, D, H200, 2, False, False, True, True, 0)[0]


def _bwd(D):
    return _config.backward_plan(M, D, H200, 2, False, False, True, True, 0, True)[0]


def test_shapes_in_force_are_the_ones_the_module_names():
    """The defaults' comment says which candidates are the shapes in force; in_force reads them
    off the plans, so that the comment cannot drift from _config."""
    assert str(shapes.in_force(_fwd(32768), M, 132, 2)) == "8192x16x2xM"
    assert str(shapes.in_force(_fwd(65536), M, 132, 2)) == "16384x16x2x8"
    assert str(shapes.in_force(_bwd(65536), M, 132, 2)) == "8192x8x2"
    assert {"8192x16x2xM", "16384x16x2x8"} <= set(shapes.FORWARD)
    assert "8192x8x2" in shapes.BACKWARD


def test_a_shape_is_the_plan_it_names_and_the_plans_come_back():
    before = (_fwd(131072), _bwd(131072))
    loop, coop = shapes.parse("16384x32x1x1", "forward"), shapes.parse("16384X16X1", "backward")
    with shapes.using(loop, coop):
        fwd, bwd = _fwd(131072), _bwd(131072)
        assert fwd.constexprs["BLOCK_D"] == 8192 and fwd.options["num_warps"] == 32
        assert fwd.options["maxnreg"] == 64 and fwd.grid == (132,)        # one per SM
        assert bwd.constexprs["BLOCK_D"] == 8192 and bwd.options["num_warps"] == 16
        assert bwd.options["maxnreg"] == 128 and bwd.slices == 16
        assert str(shapes.in_force(fwd, M, 132, 2)) == str(loop)
        assert str(shapes.in_force(bwd, M, 132, 2)) == str(coop)
        with shapes.using(shapes.parse("8192x16x2xM", "forward")):
            assert _fwd(131072).grid == (M,)                              # a row a program
        with shapes.using(shapes.parse("16384x16x2x8x3", "forward")):
            staged = _fwd(131072)                 # the sweeps' loads pipelined, 3 stages
            assert staged.constexprs["STAGES"] == 3 and staged.grid == (8 * 132,)
            assert str(shapes.in_force(staged, M, 132, 2)) == "16384x16x2x8x3"
        with shapes.using(coop=shapes.parse("8192x8x2x1", "backward")):
            lagged = _bwd(131072)                 # one row behind: a ring of four rows
            assert lagged.constexprs["LAG"] == 1 and lagged.constexprs["RING"] == 4
            assert str(shapes.in_force(lagged, M, 132, 2)) == "8192x8x2x1"
    assert (_fwd(131072), _bwd(131072)) == before
    assert before[0].constexprs["STAGES"] == 1
    assert before[1].constexprs["LAG"] == 0 and before[1].constexprs["RING"] == 2


@pytest.mark.parametrize("text, kind, says", [
    ("8192x16x2", "forward", "expected CHUNKxWARPSxRESIDENTxGRID[xSTAGES]"),
    ("8192x8x2x1x1", "backward", "expected SLICExWARPSxRESIDENT[xLAG]"),
    ("3000x8x2", "backward", "a power of two of at least 256, got 3000"),
    ("8192x12x2xM", "forward", "warps, a power of two from 1 to 32, got 12"),
    ("8192x32x4xM", "forward", "4 programs of 32 warps resident"),
    ("8192x16x8", "backward", "leave 16 registers a thread"),
    ("8192x16x2xK", "forward", "expected CHUNKxWARPSxRESIDENTxGRID[xSTAGES]"),
    ("8192x8x2x2", "backward", "LAG, 0 or 1, got 2"),
    ("8192x16x2xMx5", "forward", "STAGES, 1 to 4, got 5"),
    ("8192x16x2xMx1x1", "forward", "expected CHUNKxWARPSxRESIDENTxGRID[xSTAGES]"),
])
def test_a_shape_that_cannot_be_is_refused_by_name(text, kind, says):
    with pytest.raises(ValueError, match=f"--{kind}") as e:
        shapes.parse(text, kind)
    assert says in str(e.value) and repr(text) in str(e.value)


def test_every_candidate_gives_the_answer_of_the_shape_in_force(tmp_path, capsys):
    """In the interpreter: both modes of an add op, the candidates that differ from the shape
    in force timed (one equal to it is not timed twice), each row's outputs within rounding of
    the shape in force's, the JSON written; a cooperative refusal stays inside its row."""
    from normbook.bench.cli import main

    out = tmp_path / "shapes.json"
    was = _backward._cooperation_refused
    assert main(["shapes", "--dims", "20000", "--rows", "3", "--ops", "add_layer_norm",
                 "--forward", "8192x16x2xM,16384x32x1x1", "--backward", "16384x16x1",
                 "--json", str(out)]) == 0
    assert _backward._cooperation_refused == was
    found = json.loads(out.read_text())
    rows = found["rows"]
    # (the interpreter has no SMs: a grid of programs per SM is planned as one a row, and the
    # row says what was asked)
    assert [(r["mode"], r["shape"], r["in_force"], r.get("asked")) for r in rows] == [
        ("fwd", "8192x16x2xM", True, None), ("fwd", "16384x32x1xM", False, "16384x32x1x1"),
        ("bwd", "8192x8x2", True, None), ("bwd", "16384x16x1", False, None)]
    assert all(r["us"] > 0 and r["max_diff"] <= shapes.ROUNDING for r in rows), rows
    assert rows[0]["max_diff"] == 0 and "registers" not in rows[0]      # nothing compiled
    assert [(b["mode"], b["D"]) for b in found["best"]] == [("fwd", 20000), ("bwd", 20000)]
    assert found["device"] == "cpu (Triton's interpreter)" and found["copy_gbps"] is None
    assert "fastest" not in capsys.readouterr().out      # the interpreter times no speed


def test_a_candidate_without_the_shape_in_force_claims_no_match(monkeypatch, capsys):
    """When the shape in force's row fails (an out-of-memory, say), its candidates are timed
    with nothing to compare their outputs with: max_diff None, said in the line, not a 0
    that reads as an exact match."""
    from normbook.kernels import _config as config

    real = shapes._Case.backward

    def backward(case):
        if config.COOP_BYTES == 8192:                  # the shape in force's slice
            raise RuntimeError("out of memory (simulated)")
        return real(case)

    monkeypatch.setattr(shapes._Case, "backward", backward)
    rows = shapes.measure(["layer_norm"], ["bwd"], [20000], [3], [],
                          [shapes.parse("16384x16x1", "backward")], "cpu")
    assert [(r["shape"], r["in_force"], "error" in r) for r in rows] == [
        ("in force", False, True), ("16384x16x1", False, False)]
    assert rows[1]["us"] > 0 and rows[1]["max_diff"] is None, rows
    assert "no max diff (the shape in force failed)" in capsys.readouterr().out


def test_max_diff_is_relative_taken_in_pieces_and_a_nan_is_infinite():
    """What a candidate is held to: the largest difference from the shape in force's outputs,
    each relative to that output's largest value (y, dx and dweight differ in scale), over
    every row (taken a few rows at a time, so that a GPU's widest rows need no fp32 copy of a
    whole output); a NaN where the shape in force has a number is no match. The fastest shape
    is chosen among the rows within ROUNDING of the shape in force."""
    torch = pytest.importorskip("torch")
    a = torch.zeros(1000, 300)
    a[0, 0] = 4.0
    b = a.clone()
    b[777, 5] = 0.5
    w = torch.full((300,), 100.0)
    w2 = w.clone()
    w2[7] = 101.0
    assert shapes._max_diff([b, w], [a, w], rows=64) == 0.125       # 0.5 of a largest 4
    assert shapes._max_diff([a, w2], [a, w]) == 0.01                 # 1 of 100
    nan = w.clone()
    nan[3] = float("nan")
    assert shapes._max_diff([a, nan], [a, w]) == float("inf")
    assert shapes._max_diff([torch.zeros(3)], [torch.zeros(3)]) == 0
    rows = [dict(op="layer_norm", mode="fwd", D=32768, shape=name, in_force=name == "now",
                 us=us, max_diff=diff)
            for name, us, diff in (("now", 10.0, 0.0), ("wrong", 5.0, 0.125),
                                   ("unknown", 6.0, None), ("right", 8.0, 0.004))]
    (top,) = shapes.best(rows)
    assert (top["shape"], top["speedup"]) == ("right", 10.0 / 8.0)
    assert "(DIFFERS)" in shapes._line(dict(rows[1], M=M, programs=1, per_sm=1))


def test_the_time_budget_leaves_the_rest_recorded_as_not_measured(tmp_path):
    """--time-budget: no candidate and no (op, mode, D, M) starts after it."""
    from normbook.bench.cli import main

    out = tmp_path / "shapes.json"
    assert main(["shapes", "--dims", "20000", "--rows", "2", "--forward", "16384x32x1x1",
                 "--backward", "16384x16x1", "--time-budget", "0.05", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    # the shape in force timed; once the budget is spent, the candidate after it and the
    # backward's group recorded as not measured (a GPU run's step ends inside its limit)
    assert [(r["mode"], r.get("shape"), "us" in r) for r in rows] == [
        ("fwd", "8192x16x2xM", True), ("fwd", "16384x32x1x1", False), ("bwd", None, False)]
    assert {r["error"] for r in rows[1:]} == {"not measured: time budget of 0.05 s spent"}


def test_refusals_name_the_flag(capsys):
    from normbook.bench.cli import main

    assert main(["shapes", "--dims", "16384"]) == 2
    assert "--dims: wide rows, past 16384 values" in capsys.readouterr().err
    assert main(["shapes", "--compile-only", "--dims", "32768"]) == 2
    assert "unset TRITON_INTERPRET" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["shapes", "--ops", "batch_norm"])
    assert "--ops: expected some of layer_norm" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["shapes", "--forward", "8192x16"])
    assert "--forward: expected CHUNKxWARPSxRESIDENTxGRID[xSTAGES]" in capsys.readouterr().err


@pytest.mark.slow
def test_compile_only_reads_registers_and_spills_for_sm_90(tmp_path):
    """What the GPU run compiles for its own architecture, here for sm_90 without a GPU: each
    candidate's plan on an H200 (132 SMs), with its registers and spill bytes, and the
    programs an SM holds by them and by shared memory: four pipelined stages of a 16 KB chunk
    leave room for one, where the registers alone would allow two. A candidate planned as one
    timed already (here the shape in force itself) is not timed twice."""
    out = tmp_path / "shapes.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "normbook.bench", "shapes", "--compile-only",
                          "--dims", "65536", "--ops", "layer_norm", "--forward",
                          "16384x32x1x1,16384x16x2x8x4,16384x16x2x8",
                          "--backward", "16384x16x1", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["shape"], r["programs"], r["per_sm"]) for r in rows] == [
        ("fwd", "16384x16x2x8", 1056, 2), ("fwd", "16384x32x1x1", 132, 1),
        ("fwd", "16384x16x2x8x4", 1056, 1),
        ("bwd", "8192x8x2", 256, 2), ("bwd", "16384x16x1", 128, 1)]
    assert rows[2]["shared_bytes"] > 228 * 1024 // 2 > rows[0]["shared_bytes"]
    # four stages of 16 KB chunks would not launch on sm_86 or sm_89 (99 KB a program): said
    marked = [line for line in run.stdout.splitlines() if "more than sm_86 and sm_89" in line]
    assert len(marked) == 1 and "16384x16x2x8x4" in marked[0], run.stdout
    assert all(0 < r["registers"] <= 255 and r["spill_bytes"] == 0 and "us" not in r
               for r in rows), rows
    assert "16384x16x2x8: planned here as a shape timed already" in run.stdout
