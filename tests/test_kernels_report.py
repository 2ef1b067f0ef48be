"""The static compile report: kernels compile for sm_80/sm_90 without a GPU, no spills, 128-bit loads.

Runs ``python -m normbook.kernels.report --quick`` in a fresh process without TRITON_INTERPRET
(kernels must be real JITFunctions to compile); the full report is ``make``'s and the chapter's.
Its refusals (TRITON_INTERPRET set, an arch, an unwritable --json, no Triton) are one line each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.slow   # compiles kernels for sm_80/sm_90


def test_quick_report_compiles_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "normbook.kernels.report", "--quick", "--json", str(path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(path.read_text())["rows"]
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"norm_fwd_rows_kernel", "norm_bwd_rows_kernel", "norm_fwd_loop_kernel",
                       "norm_bwd_coop_kernel", "norm_bwd_finish_kernel"}
    for r in rows:
        assert "error" not in r, r
        assert r["spill_bytes"] == 0 and 0 < r["registers"] <= 255, r
        assert r["load_bits"] == 128, r                 # 16-byte-aligned rows: 128-bit loads,
                                                        # also at D = 3000 (VEC = 8, not 16)
    assert {r["norm"] for r in rows} == {"layer", "rms"} and any(r["residual"] for r in rows)
    assert "kernel" in out.stdout and "regs" in out.stdout      # the printed table
    assert all(r["triton"] and isinstance(r["pipelined"], bool) for r in rows)
    # every kernel with a row step has its chain of waits counted in SASS (the finish has none)
    for r in rows:
        if r["kernel"] == "norm_bwd_finish_kernel":
            assert "serial_s" not in r
            continue
        assert r["serial_s"] > 0 and set(r["serial"]) == {"exchange", "to_publish", "to_store"}, r
        assert (r["serial"]["to_publish"] is not None) == r["serial"]["exchange"] == (r["slices"] > 1)
    paths = json.loads(path.read_text())["paths"]
    # one forward and one backward per (D, norm, residual) compiled: 2 D x 2 norms, + residual at 3000
    assert len(paths) == 2 * (2 * 2 + 2)
    for p in paths:
        assert set(p) >= {"arch", "dtype", "norm", "residual", "direction", "D", "hbm_bytes_per_row",
                          "min_bytes_per_row", "programs_per_sm", "inflight_bytes_per_sm"}, p
        assert "predicted_fraction" not in p             # the model's predictions went
        assert p["hbm_bytes_per_row"] >= p["min_bytes_per_row"] > 0
        assert p["programs_per_sm"] >= 1 and p["inflight_bytes_per_sm"] > 0
    # the wide backward reads x and dy once: within 1% of the minimum (slots and partials)
    wide = next(p for p in paths if p["D"] == 65536 and p["direction"] == "bwd" and p["norm"] == "rms")
    assert 1.0 < wide["hbm_bytes_per_row"] / wide["min_bytes_per_row"] < 1.01
    # ... and its loop issues the next row's x and dy (two 128-bit loads each per thread, 16
    # bf16 values; the weight its sums need too, unless it is loaded once before the loop:
    # WEIGHT_LOADS 0) before it polls the other programs' sums: counted as one tile ahead
    for r in rows:
        if r["kernel"] == "norm_bwd_coop_kernel":
            per_thread = r["BLOCK_D"] // (32 * r["num_warps"])
            tensors = 2 if r["WEIGHT_LOADS"] == 0 else 3                  # x, dy (and w)
            assert r["pipelined"] and r["prefetched_loads"] >= tensors * per_thread // 8, r
            assert r["registers"] <= 128, r                 # two programs per SM, all resident
    # the wide forward counts x once and y once: its second sweep's re-read is served by L2
    wide = next(p for p in paths if p["D"] == 65536 and p["direction"] == "fwd" and p["norm"] == "rms")
    assert wide["hbm_bytes_per_row"] == wide["min_bytes_per_row"]
    assert "performance model" not in out.stdout and "predicted" not in out.stdout


def test_vec_is_what_d_and_the_strides_share():
    from normbook.kernels._config import narrow_loads, vec

    assert vec(4096, 2) == vec(4096, 4) == 1               # Triton's own specialization sees it
    assert vec(3000, 2) == vec(760, 2) == 8 and vec(3000, 4) == 4    # 16 bytes of values
    assert vec(760, 2, 763) == 1 and vec(760, 2, 764) == 4 and vec(1024, 2, 1000) == 8
    assert vec(1002, 2) == 2 and vec(3, 4) == 1
    assert not narrow_loads(3000, 2) and not narrow_loads(4096, 4)
    assert narrow_loads(1002, 2) and narrow_loads(760, 2, 764) and narrow_loads(6, 4)


def test_occupancy_by_hand():
    """Programs per SM and bytes in flight, on numbers worked out by hand (no compile)."""
    from normbook.bench import model

    # 64 registers x 32 threads x 8 warps = 16K registers: 4 programs fill the 64K file
    assert model.programs_per_sm(64, 8, 0) == 4
    assert model.programs_per_sm(61, 8, 0) == 4               # allocated in units of 8 per thread
    assert model.programs_per_sm(80, 16, 0) == 1              # 40K registers: one program
    assert model.programs_per_sm(32, 2, 100 * 1024) == 2      # shared memory limits: 228 KB / 100 KB
    assert model.programs_per_sm(16, 1, 0) == 32              # at most 32 programs per SM
    k = dict(registers=64, num_warps=8, shared_bytes=0, grid=10_000, tile_bytes=16384,
             pipelined=False, num_stages=3)
    # 4 programs, each waiting for its one 16 KB tile
    assert model.inflight_bytes(k) == dict(programs_per_sm=4, inflight_bytes_per_sm=65536)
    # 2 programs, each with 2 tiles ahead (3 stages)
    k2 = dict(k, pipelined=True, registers=128)
    assert model.inflight_bytes(k2) == dict(programs_per_sm=2, inflight_bytes_per_sm=65536)
    # a grid of 132 programs fills one per SM, whatever the registers allow
    assert model.inflight_bytes(dict(k, grid=132))["programs_per_sm"] == 1
    assert not hasattr(model, "predict")       # no speed is predicted (see the module)


def test_more_shared_memory_than_sm86_gives_a_program_is_a_problem_for_sm_80():
    """The plans are the same on every GPU, and the smaller Ampere and Ada GPUs (sm_86, sm_89:
    99 KB a program) compile sm_80's pipelines: a kernel compiled for sm_80 past that is a
    problem of the report; sm_90's own 227 KB are not held to it."""
    from normbook.bench.model import SHARED_SM86
    from normbook.kernels import report

    row = dict(kernel="norm_fwd_rows_kernel", arch="sm_80", dtype="bf16", D=1024,
               spill_bytes=0, load_bits=128, registers=64, num_warps=4, per_sm=1,
               shared_bytes=SHARED_SM86)
    assert report.problems(row) == []
    assert report.problems(dict(row, shared_bytes=SHARED_SM86 + 1)) == [
        f"{SHARED_SM86 + 1} bytes of shared memory, more than a program may have on sm_86 "
        f"and sm_89 ({SHARED_SM86})"]
    assert report.problems(dict(row, arch="sm_90", shared_bytes=SHARED_SM86 + 1)) == []


def test_sm_89_compiles_the_shared_memory_of_sm_80():
    """The premise of the rule above: Triton pipelines a kernel for sm_89 as for sm_80, so the
    compile report's sm_80 row stands for the GPUs with 99 KB a program. Checked on the kernel
    with the most shared memory of the report's configurations (the rows backward, fp32, short
    rows: three stages of 64 KB tiles), and on sm_75 (no cp.async), which stages none of it.
    Compiled in a fresh process without TRITON_INTERPRET, as the report runs."""
    from normbook.bench.model import SHARED_SM86

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json; from normbook.kernels import report; print(json.dumps({a: max("
            "r['shared_bytes'] for r in report.config_rows((a, 'fp32', 256, False, False))) "
            "for a in (75, 80, 89)}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    shared = {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    assert shared[89] == shared[80] <= SHARED_SM86 and shared[80] > 32 * 1024, shared
    assert shared[75] < 16 * 1024, shared


def test_traffic_is_counted_from_the_plans():
    """report.traffic reads a plan's counts, no per-kernel table: LayerNorm at D = 4096 bf16
    (whole rows, 2 per step), and at 65536 (the forward swept in chunks, its re-read from L2
    not counted; the backward's shared rows: the groups' rings of slots and a word per
    program, 8 bytes a word written back once per launch: kept, not zeroed, between launches)."""
    from normbook.kernels import report

    M, e, D = report.M_REPORT, 2, 4096
    fwd, bwd, finish = report.launches(D, False, False)
    assert (fwd.kernel, bwd.kernel, finish.kernel) == ("norm_fwd_rows_kernel", "norm_bwd_rows_kernel",
                                                       "norm_bwd_finish_kernel")
    # x in, y out, mean and rstd, weight and bias once
    assert report.traffic(fwd, D, "bf16")["bytes_per_row"] == 2 * D * e + 8 + 2 * D * e / M
    # x and dy in, dx out, the stats, the weight once, fp32 partials of dweight, dbias per group
    assert report.traffic(bwd, D, "bf16")["bytes_per_row"] == (3 * D * e + 8 + D * e / M
                                                              + 2 * bwd.groups * D * 4 / M)
    assert report.traffic(fwd, D, "bf16")["tile_bytes"] == fwd.rows * D * e
    assert finish.partials == bwd.partials == 2 * bwd.groups
    D = 65536
    fwd, bwd = report.launches(D, False, False)[:2]
    assert fwd.kernel == "norm_fwd_loop_kernel" and fwd.slices == 1      # swept, not shared
    assert report.traffic(fwd, D, "bf16")["bytes_per_row"] == 2 * D * e + 8 + 2 * D * e / M
    assert bwd.slices == D // bwd.constexprs["BLOCK_D"] > 1
    t = report.traffic(bwd, D, "bf16")
    ring = bwd.groups * bwd.constexprs["RING"] * bwd.constexprs["SLICES"]     # slots
    assert bwd.constexprs["RING"] == 2 and ring < M
    # two words a slot, then a word per program (its warps' first row left for the end)
    words = 2 * ring + bwd.grid[0]
    assert t["bytes_per_row"] == (3 * D * e + 8 + D * e / M + 2 * bwd.groups * D * 4 / M
                                  + 8 * words / M)
    assert t["grid"] == bwd.groups * bwd.slices and t["step_bytes"] == 3 * bwd.constexprs["BLOCK_D"] * e


def test_report_cli_names_itself_and_shows_examples(capsys):
    """``normbook-report --help``: the console script's name in the usage line (not report.py),
    examples, and the progress switch."""
    from normbook.kernels import report

    with pytest.raises(SystemExit) as stop:
        report.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: normbook-report") and "examples:" in out and "--no-progress" in out


# ---- refusals: one line, exit status 2, before anything is compiled --------------------------
def _refused(argv, monkeypatch, capsys) -> str:
    """report.main(argv) with compiling forbidden: its exit status must be 2, its stderr one
    line; returns that line."""
    from normbook.kernels import report

    monkeypatch.setattr(report, "run", lambda **kw: pytest.fail("compiled before refusing"))
    rc = report.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out, err)
    assert err.count("\n") == 1 and err.startswith("normbook-report: error: "), err
    return err


@pytest.mark.parametrize("value", ["1", "true", "yes", "2"])
def test_triton_interpret_set_is_one_line_saying_unset_it(value, tmp_path, monkeypatch, capsys):
    """Under the interpreter every configuration failed to compile (or the module's own
    __main__ ran itself again, silently): now one line that says what to do, and no JSON.
    Any value but "" and "0" is refused, the kernels' rule (_backward.INTERPRETED)."""
    monkeypatch.setenv("TRITON_INTERPRET", value)
    err = _refused(["--quick", "--json", tmp_path / "r.json"], monkeypatch, capsys)
    assert f"TRITON_INTERPRET='{value}' is set" in err and "unset TRITON_INTERPRET" in err, err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("value", [None, "", "0"])
def test_triton_interpret_unset_or_zero_compiles(value, tmp_path, monkeypatch, capsys):
    from normbook.kernels import report

    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    asked = []
    monkeypatch.setattr(report, "run", lambda **kw: asked.append(kw) or [])
    assert report.main(["--archs", "90,80,90", "--json", str(tmp_path / "r.json")]) == 0
    assert asked[0]["archs"] == (90, 80)                  # each once, in the order given
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == []
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("archs, words", [
    ("100", "(cannot compile for sm_100)"),     # ptxas fails on every kernel
    ("9", "(cannot compile for sm_9)"),         # LLVM aborts the process
    ("90,75", "(cannot compile for sm_75)"),
    ("90,x", "got '90,x'"), ("", "got ''"), ("90,", "got '90,'")])
def test_an_arch_it_cannot_compile_for_is_one_line(archs, words, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    err = _refused(["--quick", "--archs", archs], monkeypatch, capsys)
    assert "--archs: expected a comma list of 80,90" in err and words in err, err


def test_a_json_it_could_not_write_is_refused_before_compiling(tmp_path, monkeypatch, capsys):
    """The JSON is written after minutes of compiling: a path that cannot take it is refused
    first (as normbook-bench refuses its output files), whatever TRITON_INTERPRET says."""
    for bad, words in ((tmp_path / "no" / "r.json", f"no folder {tmp_path / 'no'}"),
                       (tmp_path, "is a folder")):
        err = _refused(["--quick", "--json", bad], monkeypatch, capsys)
        assert "--json: " in err and words in err, err


def test_a_json_that_exists_is_refused_unless_forced(tmp_path, monkeypatch, capsys):
    """--json onto a file that exists replaced it (a recorded run's report.json, say, with
    one from this machine's Triton): refused now, before compiling, as normbook-bench refuses
    its outputs; --force passes that check (here the next refusal, TRITON_INTERPRET, speaks)."""
    kept = tmp_path / "report.json"
    kept.write_text('{"precious": 1}')
    err = _refused(["--quick", "--json", kept], monkeypatch, capsys)
    assert f"--json: {kept} exists; pass --force to replace it" in err, err
    assert kept.read_text() == '{"precious": 1}'
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    err = _refused(["--quick", "--json", kept, "--force"], monkeypatch, capsys)
    assert "--json" not in err and "TRITON_INTERPRET" in err, err


# `import triton` fails, as where it is not installed; the console script as installed
# (pyproject's [project.scripts], through the package's metadata)
CONSOLE_SCRIPT = """
import sys
from importlib.metadata import entry_points
main = entry_points(group="console_scripts")["normbook-report"].load()
sys.exit(main())
"""


def _without_triton(tmp_path, *args, code=CONSOLE_SCRIPT):
    (tmp_path / "triton").mkdir(exist_ok=True)
    (tmp_path / "triton" / "__init__.py").write_text(
        "raise ImportError('No module named triton (hidden by the test)')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


def test_report_help_and_a_refusal_without_triton(tmp_path):
    """normbook-report's command line lies outside normbook.kernels (whose import raises without
    Triton): --help prints, and a report is refused in one line, before any JSON is written."""
    r = _without_triton(tmp_path, "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: normbook-report"), r.stderr
    assert "examples:" in r.stdout and "Traceback" not in r.stderr
    r = _without_triton(tmp_path, "--quick", "--json", str(tmp_path / "r.json"))
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(
        "normbook-report: error: needs Triton"), r.stderr
    assert "hidden by the test" in r.stderr and not (tmp_path / "r.json").exists()


def test_the_module_says_it_needs_triton_in_one_line(tmp_path):
    """``python -m normbook.kernels.report`` imports the package normbook.kernels first, whose
    import raises without Triton: runpy's one line carries the package's message, no traceback."""
    r = _without_triton(tmp_path, "-m", "normbook.kernels.report", "--help", code=None)
    assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "normbook.kernels needs Triton (Linux: pip install 'normbook[kernels]')" in r.stderr


def test_report_progress_counts_every_configuration(capsys):
    """The progress of a long report: every configuration passes through, a bar (or a count)
    goes to stderr when asked for, nothing when switched off."""
    from normbook.kernels import report

    items = list(range(25))
    assert list(report._progress(items, False)) == items
    assert capsys.readouterr().err == ""
    assert list(report._progress(items, True)) == items
    err = capsys.readouterr().err
    assert "25/25" in err
    # the default where stderr is no terminal (a log, CI): plain lines, never silent
    assert list(report._progress(items, None)) == items
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "normbook-report: compiling 25 configurations"
    assert [line.split(",")[0] for line in lines[1:]] == [
        f"normbook-report: {i}/25 configurations" for i in (2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 25)]


def test_a_pool_of_processes_gives_the_rows_of_one_process():
    """The full report compiles in a pool of processes (one per CPU); its rows, in order, are
    those that compiling one configuration after another in the calling process gives."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = (
        "import concurrent.futures as cf, os\n"
        "from normbook.kernels import report\n"
        "made = []\n"
        "class Pool(cf.ProcessPoolExecutor):\n"
        "    def __init__(self, *a, **k):\n"
        "        made.append(a[0]); super().__init__(*a, **k)\n"
        "cf.ProcessPoolExecutor = Pool\n"
        "os.cpu_count = lambda: 2\n"
        "kw = dict(archs=(90,), dtypes=('bf16',), ds=(3000,), residual_d=0)\n"
        "report.POOL_FROM = 2\n"
        "pooled = report.run(**kw)\n"
        "assert made == [2], made\n"
        "report.POOL_FROM = 10 ** 6\n"
        "alone = report.run(**kw)\n"
        "assert len(pooled) >= 4 and pooled == alone, (pooled, alone)\n"
        "assert all('error' not in r and r['registers'] > 0 for r in pooled), pooled\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_python_api_refuses_the_interpreter_as_the_command_line_does():
    """report.run under TRITON_INTERPRET=1 returned a row per configuration, each holding the
    same compile error, and raised nothing; sass.compile_plan failed inside Triton."""
    script = ("import pytest\n"
              "from normbook.kernels import report, sass, _config\n"
              "for call in (lambda: report.run(archs=(90,), dtypes=('bf16',), ds=(3000,)),\n"
              "             lambda: sass.compile_plan(_config.forward_plan(\n"
              "                 64, 3000, _config.Device(90, 132), 2, False, False, True, True)[0],"
              " 3000)):\n"
              "    with pytest.raises(RuntimeError, match='interpreter stands in'):\n"
              "        call()\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_without_triton_the_refusal_says_so_before_the_interpreter(tmp_path):
    """No Triton, and TRITON_INTERPRET=1 set: the refusal said to unset TRITON_INTERPRET,
    after which the report would still have had no Triton. It names the missing Triton."""
    r = _without_triton(tmp_path, "--quick",
                        code="import os; os.environ['TRITON_INTERPRET'] = '1'\n" + CONSOLE_SCRIPT)
    assert r.returncode == 2 and "needs Triton" in r.stderr, r.stderr
    assert "TRITON_INTERPRET" not in r.stderr, r.stderr
