"""The static compile report: kernels compile for sm_80/sm_90 without a GPU, no spills, 128-bit loads.

Runs ``python -m normbook.kernels.report --quick`` in a fresh process without TRITON_INTERPRET
(kernels must be real JITFunctions to compile); the full report is ``make``'s and the chapter's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_quick_report_compiles_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "normbook.kernels.report", "--quick", "--json", str(path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(path.read_text())["rows"]
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"norm_fwd_rows_kernel", "norm_bwd_rows_kernel", "norm_fwd_chunked_kernel",
                       "norm_bwd_stats_kernel", "norm_bwd_chunked_kernel", "norm_bwd_finish_kernel"}
    for r in rows:
        assert "error" not in r, r
        assert r["spill_bytes"] == 0 and 0 < r["registers"] <= 255, r
        assert r["load_bits"] == 128, r                 # 16-byte-aligned rows: 128-bit loads
    assert {r["norm"] for r in rows} == {"layer", "rms"} and any(r["residual"] for r in rows)
    assert "kernel" in out.stdout and "regs" in out.stdout      # the printed table
