"""The serial path of a row step, counted in SASS (normbook.kernels.sass).

The parser on a handwritten SASS snippet (exact counts), then on the kernels compiled for
sm_90 bf16 in a fresh process without TRITON_INTERPRET (kernels must be real JITFunctions to
compile).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from normbook.kernels import sass  # noqa: E402


def _sass(instructions) -> str:
    """cuobjdump's layout for (address, text, write scoreboard, wait mask) rows: each
    instruction followed by the word that holds its control bits (read scoreboard: none)."""
    out = ["\tcode for sm_90a", "\t\tFunction : k"]
    for addr, text, wb, wait in instructions:
        ctl = (7 if wb is None else wb) << 5 | 7 << 8 | wait << 11
        out.append(f"        /*{addr:04x}*/                   {text} ;   /* 0x{0:016x} */")
        out.append(f"                                                   /* 0x{ctl << 41:016x} */")
    return "\n".join(out) + "\n"


SB = [1 << k for k in range(6)]     # wait masks of scoreboards 0..5

# a row step shaped as the sharing kernels': loads the row's statistics (address written in
# the loop: HBM) and the weight (same address every step: L2) together, a block reduction of
# two shuffle levels, a rare branch over a barrier, the publish, the next row's load (never
# waited for in the step), the wait loop, the weight again, a statistic's store, the row's store
STEP = [
    (0x00, "MOV R1, c[0x0][0x28]", None, 0),
    (0x10, "LDG.E.128 R4, desc[UR4][R2.64]", 0, 0),                  # before the loop
    (0x20, "IADD3 R10, R10, 0x10, RZ", None, 0),                     # loop head
    (0x30, "LDG.E R12, desc[UR4][R10.64]", 1, 0),                    # statistics: HBM
    (0x40, "LDG.E.128 R16, desc[UR4][R2.64]", 2, 0),                 # weight: L2
    (0x50, "FMUL R20, R12, R4", None, SB[0] | SB[1]),                # round 1 (both loads)
    (0x60, "FMUL R21, R16, R20", None, SB[2]),                       # same round
    (0x70, "SHFL.BFLY PT, R22, R21, 0x10, 0x1f", 3, 0),
    (0x80, "FADD R21, R21, R22", None, SB[3]),                       # shuffle level 1
    (0x90, "SHFL.BFLY PT, R22, R21, 0x8, 0x1f", 3, 0),
    (0xa0, "FADD R21, R21, R22", None, SB[3]),                       # shuffle level 2
    (0xb0, "STS [R0], R21", None, 0),
    (0xc0, "BAR.SYNC.DEFER_BLOCKING 0x0", None, 0),
    (0xd0, "LDS R23, [R0]", 3, 0),                                   # block reduction
    (0xe0, "@P0 BRA 0x100", None, 0),                                # skips the rare path
    (0xf0, "BAR.SYNC.DEFER_BLOCKING 0x0", None, 0),
    (0x100, "FADD R24, R23, RZ", None, SB[3]),
    (0x110, "ATOMG.E.EXCH.64.STRONG.GPU PT, RZ, desc[UR4][R8.64], R24", 4, 0),   # publish
    (0x120, "LDG.E.128 R4, desc[UR4][R10.64+0x10]", 0, 0),           # next row: in flight
    (0x130, "LDG.E.64.STRONG.SYS R26, desc[UR4][R8.64]", 1, 0),      # first poll
    (0x140, "ISETP.NE.AND P1, PT, R26, RZ, PT", None, SB[1]),        # wait loop head
    (0x150, "@!P1 LDG.E.64.STRONG.SYS R26, desc[UR4][R8.64]", 1, 0),
    (0x160, "@!P1 BRA 0x140", None, 0),
    (0x170, "LDG.E.128 R16, desc[UR4][R2.64]", 2, 0),                # weight again: L2
    (0x180, "FMUL R28, R26, R16", None, SB[1] | SB[2]),              # round 1
    (0x190, "STG.E desc[UR4][R14.64], R28", None, 0),                # a statistic
    (0x1a0, "STG.E.128 desc[UR4][R14.64], R28", None, 0),            # the row
    (0x1b0, "@P2 BRA 0x20", None, 0),
    (0x1c0, "EXIT", None, 0),
]


def _line(text: str, addr: int) -> int:
    return next(i + 1 for i, t in enumerate(text.splitlines()) if t.strip().startswith(f"/*{addr:04x}*/"))


def test_serial_path_on_a_handwritten_step():
    text = _sass(STEP)
    c = sass.serial_path(text)
    assert c["loop"] == (_line(text, 0x20), _line(text, 0x1b0))
    assert c["exchange"] and c["publish"] == _line(text, 0x110)
    assert c["wait"] == (_line(text, 0x140), _line(text, 0x160))
    assert c["to_publish"] == dict(lines=(_line(text, 0x20), _line(text, 0x110)), hbm_loads=1,
                                   l2_loads=0, shuffle_rounds=2, reductions=1, barriers=1,
                                   load_lines=[[_line(text, 0x30), _line(text, 0x40)]])
    assert c["to_store"] == dict(lines=(_line(text, 0x170), _line(text, 0x1a0)), hbm_loads=0,
                                 l2_loads=1, shuffle_rounds=0, reductions=0, barriers=0,
                                 load_lines=[[_line(text, 0x170)]])
    hw = dict(latency=1e-6, exchange=1e-6, l2_latency=0.4e-6)
    expected = 1e-6 + 1e-6 + 0.4e-6 + sass.BARRIER_ROUND_S + 2 * sass.SHUFFLE_ROUND_S
    assert sass.serial_latency_s(c, hw) == pytest.approx(expected)


def test_rows_step_and_depbar():
    """No exchange: one segment from the loop head to the row's store. Two loads on one
    scoreboard: DEPBAR.LE SB0, 0x1 waits for the older only, a round that both were in
    flight for; a third, issued after that wait, is a second round when the store waits."""
    text = _sass([
        (0x00, "LDG.E.128 R4, desc[UR4][R10.64]", 0, 0),     # loop head
        (0x10, "FMUL R8, R4, R4", None, 0),
        (0x20, "LDG.E.128 R12, desc[UR4][R10.64+0x10]", 0, 0),
        (0x30, "DEPBAR.LE SB0, 0x1", None, 0),
        (0x40, "LDG.E.128 R16, desc[UR4][R10.64+0x20]", 0, 0),
        (0x50, "STG.E.128 desc[UR4][R2.64], R16", None, SB[0]),
        (0x60, "IADD3 R10, R10, 0x40, RZ", None, 0),
        (0x70, "@P0 BRA 0x0", None, 0),
        (0x80, "EXIT", None, 0),
    ])
    c = sass.serial_path(text)
    assert not c["exchange"] and c["to_publish"] is None and c["wait"] is None
    s = c["to_store"]
    assert s["lines"] == (_line(text, 0x00), _line(text, 0x50))
    assert (s["hbm_loads"], s["l2_loads"]) == (2, 0)
    assert s["load_lines"] == [[_line(text, 0x00), _line(text, 0x20)], [_line(text, 0x40)]]
    assert sass.serial_latency_s(c, dict(latency=1e-6, exchange=1e-6)) == pytest.approx(2e-6)


def test_parse_needs_control_words():
    with pytest.raises(ValueError, match="control word"):
        sass.serial_path("        /*0000*/                   EXIT ;   /* 0x000000000000794d */\n")


def test_local_signature_matches_the_report():
    import triton
    from normbook.kernels import _backward, _forward, report
    for kernel in (_forward.norm_fwd_loop_kernel, _backward.norm_bwd_coop_kernel,
                   _backward.norm_bwd_finish_kernel, _forward.norm_fwd_rows_kernel):
        fn = kernel if isinstance(kernel, triton.runtime.JITFunction) else triton.JITFunction(kernel.fn)
        for D in (3000, 32768):
            assert sass._local_signature(fn, "bf16", {"BLOCK_D": 1}, D) == \
                report.signature(fn, "bf16", {"BLOCK_D": 1}, D)


@pytest.mark.slow   # compiles four kernels for sm_90 (about 15 s)
def test_compiled_kernels_sm90_bf16(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = tmp_path / "paths.json"
    code = ("import json, sys; from normbook.kernels import sass; "
            "json.dump(sass.kernel_serial_paths(ds=(32768,), rows_ds=(8192,)), open(sys.argv[1], 'w'))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {(r["kernel"], r["D"]): r for r in json.loads(path.read_text())}
    assert set(rows) == {("norm_fwd_rows_kernel", 8192), ("norm_bwd_rows_kernel", 8192),
                         ("norm_fwd_loop_kernel", 32768), ("norm_bwd_coop_kernel", 32768)}
    coop = rows["norm_bwd_coop_kernel", 32768]
    assert coop["exchange"] and coop["wait"] is not None and coop["slices"] == 8
    head, back = coop["loop"]
    # the publish segment holds the block reductions of c1 and c2's shares, and then the wait
    # loop, the segment to the store, inside the row loop in that order
    assert coop["to_publish"]["reductions"] >= 1
    assert head == coop["to_publish"]["lines"][0] < coop["publish"] < coop["wait"][0]
    assert coop["wait"][1] < coop["to_store"]["lines"][0] < coop["to_store"]["lines"][1] < back
    assert coop["serial_s"] > 1e-6                      # the exchange (1 us) and more
    for key in (("norm_fwd_rows_kernel", 8192), ("norm_bwd_rows_kernel", 8192),
                ("norm_fwd_loop_kernel", 32768)):
        r = rows[key]
        assert not r["exchange"] and r["publish"] is None and r["to_publish"] is None, r
    for key in (("norm_fwd_rows_kernel", 8192), ("norm_bwd_rows_kernel", 8192)):
        r = rows[key]
        assert r["to_store"]["reductions"] >= 1 and 0 < r["serial_s"], r
    # the pipelined backward waits for no load in its step (the tiles were copied steps ahead,
    # the weight is held): no exchange either
    assert rows["norm_bwd_rows_kernel", 8192]["serial_s"] < coop["serial_s"]
    assert rows["norm_bwd_rows_kernel", 8192]["to_store"]["hbm_loads"] == 0
    # the forward's row a program is not pipelined: its one step waits for its row's loads
    assert rows["norm_fwd_rows_kernel", 8192]["to_store"]["hbm_loads"] >= 1
