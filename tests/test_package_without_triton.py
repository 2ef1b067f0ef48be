"""A reader without Triton (macOS): the package imports, and the kernels chapter runs and skips.

Simulated honestly: a Python started with -S sees a copy of this environment's site-packages
(symlinks) with triton left out, so ``find_spec("triton")`` is None exactly as where it is not
installed.
"""

import subprocess
import sys
import sysconfig
from pathlib import Path

import jupytext
import pytest

pytestmark = pytest.mark.slow   # fresh interpreters without triton

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def no_triton_env(tmp_path_factory):
    site = Path(sysconfig.get_paths()["purelib"])
    farm = tmp_path_factory.mktemp("site-without-triton")
    for entry in site.iterdir():
        if not entry.name.lower().startswith("triton"):
            (farm / entry.name).symlink_to(entry)
    env = {"PYTHONPATH": f"{ROOT / 'src'}:{farm}", "MPLBACKEND": "Agg", "PATH": "/usr/bin:/bin"}
    return env


def run(code, env, cwd):
    return subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_package_without_triton(no_triton_env, tmp_path):
    code = """
import importlib.util, torch, normbook

assert importlib.util.find_spec("triton") is None
x = torch.randn(3, 8, requires_grad=True)
normbook.layer_norm(x, (8,)).sum().backward()
try:
    import normbook.kernels
except ImportError as e:
    print("kernels:", e)
"""
    out = run(code, no_triton_env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "kernels:" in out.stdout and "triton" in out.stdout.lower()


def test_kernels_chapter_skips_its_triton_cells(no_triton_env, tmp_path):
    script = tmp_path / "ch09.py"
    script.write_text(jupytext.writes(jupytext.read(ROOT / "book" / "09-kernels.md"), fmt="py:percent"))
    code = f"exec(compile(open({str(script)!r}).read(), 'ch09', 'exec'), {{'__name__': '__main__'}})"
    out = run(code, no_triton_env, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "skipped: Triton is not installed" in out.stdout
