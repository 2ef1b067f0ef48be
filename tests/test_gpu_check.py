"""benchmarks/gpu_check.sh keeps what it measured and cannot outlive its budget.

The GPU check runs once, on a machine lent for minutes: a run stopped from outside must leave
its partial results in $OUT, a hanging step must die with its whole process group inside the
budget, setup failures must stop before writing anything, and the exit status must say whether
every step passed. Each test runs the script itself (`DRY_RUN=1`: the CPU path), stopped early
or cut to a few steps with ONLY, so the file takes well under a minute; `make gpu-dry-run` runs
the whole dry run. Every process of a run carries a tag in its environment, so the tests can
check that none survives.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
PUBLISHED = {"results.json", "summary.txt", "report.json", "overview.png", "logs.tar.gz"}

pytestmark = [
    pytest.mark.slow,      # runs the script, a minute and more in all
    pytest.mark.skipif(shutil.which("bash") is None, reason="gpu_check.sh is a bash script"),
    pytest.mark.skipif(shutil.which("timeout") is None,
                       reason="gpu_check.sh bounds its steps with coreutils' timeout"),
    pytest.mark.skipif(not Path("/proc/self/environ").exists(),
                       reason="finding a run's surviving processes reads /proc/*/environ"),
]


def _env(tmp_path, **extra):
    """The script's environment: dry run, this interpreter, a private TMPDIR, a tag."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONLY", "OUT", "BUDGET_S")}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env.update(DRY_RUN="1", PYTHON=sys.executable, OUT=str(tmp_path / "out"),
               TMPDIR=str(tmp_path / "tmp"), NORMBOOK_GPU_CHECK_TAG=uuid.uuid4().hex)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _start(env):
    # its own session: the test stops the run as the device tool would, by process group
    return subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _run(env, timeout=60):
    p = _start(env)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def _survivors(tag: str, wait_s: float = 5.0) -> list[str]:
    """Processes whose environment holds ``tag`` (the run's and its children's), after up to
    ``wait_s`` for the dying to go."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if tag.encode() in (proc / "environ").read_bytes():
                    found.append(f"{proc.name}: {(proc / 'cmdline').read_bytes()!r}")
            except OSError:   # gone meanwhile, or not ours
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def _steps(summary: str) -> dict[str, str]:
    """The summary's list of steps: {name: "rc=... Ns (note)"}."""
    lines = summary.split("== steps", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    return dict(line.split(" ", 1) for line in lines if " rc=" in line)


def _check_out(out: Path):
    """What the device tool brings back: at most 8 files, no folder, no half-written file."""
    names = {p.name for p in out.iterdir()}
    assert names <= PUBLISHED and len(names) <= 8, names
    assert not [p for p in out.iterdir() if p.is_dir()]


def test_setup_failures_stop_with_a_message(tmp_path):
    (tmp_path / "a-file").write_text("")
    rc, out = _run(_env(tmp_path, OUT=tmp_path / "a-file" / "out"))
    assert rc == 2 and "cannot create OUT=" in out and "nothing run" in out
    rc, out = _run(_env(tmp_path, TMPDIR=tmp_path / "missing"))
    assert rc == 2 and "mktemp -d failed" in out
    assert list((tmp_path / "out").iterdir()) == []          # nothing written
    rc, out = _run(_env(tmp_path, BUDGET_S="8m"))
    assert rc == 2 and "BUDGET_S=8m" in out
    rc, out = _run(_env(tmp_path, ONLY="env,gpu_test"))
    assert rc == 2 and "no step 'gpu_test'" in out


@pytest.mark.parametrize("hidden, only, failed", [
    (None, "env", None),                      # the control: the exit status can say 0
    ("torch", "env", "env"),                  # env's python failed: once recorded as rc 0
    ("pytest", "env,gpu_tests", "gpu_tests"),  # no pytest: once a note and exit 0
])
def test_exit_status_says_whether_every_step_passed(tmp_path, hidden, only, failed):
    """A module made unimportable (a shadowing file on PYTHONPATH that raises ImportError, as
    on a machine without it) fails its step, and the run's exit status with it."""
    env = _env(tmp_path, ONLY=only)
    if hidden:
        (tmp_path / "shadow").mkdir()
        (tmp_path / "shadow" / f"{hidden}.py").write_text(
            f"raise ImportError('{hidden} is hidden by tests/test_gpu_check.py')\n")
        env["PYTHONPATH"] = str(tmp_path / "shadow")
    rc, out = _run(env)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    steps = _steps(summary)
    assert set(steps) == set(only.split(",")), summary
    if failed is None:
        assert rc == 0 and steps["env"].startswith("rc=0 "), out
        assert "torch " in summary and "done in" in summary
    else:
        assert rc == 1, out
        assert not steps[failed].startswith("rc=0 "), summary
        assert f"not passed: {failed}" in summary
        assert all(v.startswith("rc=0 ") for k, v in steps.items() if k != failed), summary
    _check_out(tmp_path / "out")


def _stop(p, timeout):
    """SIGTERM to the run's process group, as a device tool stopping it would; its output."""
    os.killpg(p.pid, signal.SIGTERM)
    return p.communicate(timeout=timeout)[0]


def test_stopped_from_outside_keeps_partial_results(tmp_path):
    """SIGTERM to the run's process group once a step has finished: the running step is
    stopped with its processes, summary.txt lists what finished, logs.tar.gz holds the logs,
    the temporary folder is gone and no process of the run survives."""
    env = _env(tmp_path, BUDGET_S=120)
    summary_txt = tmp_path / "out" / "summary.txt"
    t0 = time.monotonic()
    p = _start(env)
    try:
        while "\nenv rc=" not in (summary_txt.read_text() if summary_txt.exists() else ""):
            assert p.poll() is None, p.communicate()[0]
            assert time.monotonic() - t0 < 60, "env did not finish within 60 s"
            time.sleep(0.2)
        time.sleep(1.0)                                   # the next step is running
        out = _stop(p, 30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 128 + signal.SIGTERM, out
    summary = summary_txt.read_text()
    assert "STOPPED by SIGTERM" in summary, summary
    steps = _steps(summary)
    assert steps["env"].startswith("rc=0 "), summary
    stopped = [k for k, v in steps.items() if "stopped by SIGTERM" in v]
    assert len(stopped) == 1 and stopped[0] in ("wheels", "bench_bf16"), summary  # wheels: .whl/
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"logs/env.txt", "logs/steps.txt", f"logs/{stopped[0]}.txt", "summary.txt"} <= names
    _check_out(tmp_path / "out")
    assert not list((tmp_path / "tmp").glob("gpu_check.*")), "the temporary folder is left"
    assert _survivors(env["NORMBOOK_GPU_CHECK_TAG"]) == []


def test_stopped_benchmark_keeps_its_rows(tmp_path):
    """SIGTERM while the benchmark runs, once it has written a row: results.json in $OUT holds
    the rows measured so far (the benchmark rewrites its JSON after every shape)."""
    env = _env(tmp_path, ONLY="bench_bf16", BUDGET_S=120)
    t0 = time.monotonic()
    p = _start(env)
    try:
        while True:
            assert p.poll() is None, p.communicate()[0]
            assert time.monotonic() - t0 < 60, "no benchmark row within 60 s"
            rows = []
            for f in (tmp_path / "tmp").glob("gpu_check.*/bench-bf16/results.json"):
                try:
                    rows = json.loads(f.read_text())["rows"]
                except (OSError, ValueError, KeyError):   # being written
                    pass
            if rows:
                break
            time.sleep(0.2)
        out = _stop(p, 45)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 128 + signal.SIGTERM, out
    merged = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(merged["rows"]) >= len(rows) >= 1
    assert "bench_bf16 rc=143" in (tmp_path / "out" / "summary.txt").read_text()
    _check_out(tmp_path / "out")
    assert _survivors(env["NORMBOOK_GPU_CHECK_TAG"]) == []


HANGING_PYTHON = """#!/usr/bin/env bash
# a python that hangs, with a grandchild deaf to SIGTERM: only a kill of the group ends it
( trap '' TERM; exec sleep 300 ) &
exec sleep 300
"""


def test_hanging_step_dies_with_its_group_inside_the_budget(tmp_path):
    """A step that hangs (its grandchild ignoring SIGTERM) is cut at the limit the budget
    leaves, its whole group dies, the steps the budget has no time for are recorded as not
    run, and the run ends inside BUDGET_S with a failing status."""
    fake = tmp_path / "python"
    fake.write_text(HANGING_PYTHON)
    fake.chmod(0o755)
    budget = 12
    env = _env(tmp_path, PYTHON=fake, BUDGET_S=budget, RESERVE_S=2, KILL_AFTER_S=2,
               MIN_STEP_S=3)
    t0 = time.monotonic()
    rc, out = _run(env, timeout=budget + 30)
    took = time.monotonic() - t0
    assert rc == 1, out
    assert took < budget + 1, f"{took:.1f} s for a budget of {budget} s"
    steps = _steps((tmp_path / "out" / "summary.txt").read_text())
    assert re.match(r"rc=124 \d+s \(timed out at \d+s\)", steps["env"]), steps
    assert "not run: budget spent" in steps["gpu_tests"], steps
    assert _survivors(env["NORMBOOK_GPU_CHECK_TAG"], wait_s=2) == []
    _check_out(tmp_path / "out")


ECHO_PYTHON = """#!/usr/bin/env bash
# a python that only says what it was asked to run
echo "args: $*"
"""


@pytest.mark.parametrize("only, alone", [("shapes", True), ("env,shapes", True),
                                         ("shapes,report", False),
                                         ("gpu_tests,shapes,llama", False)])
def test_shapes_takes_the_budget_only_in_a_call_of_its_own(tmp_path, only, alone):
    """The GPU run's shapes step (not the dry run's): 75 s, POST_S kept for the steps after it,
    unless ONLY names no step after it, when it gets what the budget leaves, its own
    --time-budget 30 s inside that. A step named after it keeps its time: any ONLY gave shapes
    the whole budget, and ONLY=shapes,report left the report 25 s of 480."""
    fake = tmp_path / "python"
    fake.write_text(ECHO_PYTHON)
    fake.chmod(0o755)
    rc, out = _run(_env(tmp_path, PYTHON=fake, DRY_RUN=0, ONLY=only, BUDGET_S=480))
    assert rc == 0, out
    limit = int(re.search(r"=== \[\d+s\] shapes \(limit (\d+)s\)", out).group(1))
    budget = int(re.search(r"args: -m normbook\.bench shapes .*--time-budget (\d+)",
                           out).group(1))
    if alone:
        assert limit >= 480 - 20 - 5 - 5 and budget == limit - 30, out
    else:
        assert (limit, budget) == (75, 45), out
