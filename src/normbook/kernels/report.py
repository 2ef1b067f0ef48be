"""The static compile report: every kernel compiled for sm_80 and sm_90 on a machine without a GPU.

    python -m normbook.kernels.report [--json PATH] [--quick]

For each kernel, arch, dtype and row length D it compiles the kernel exactly as the launchers
would configure it for a large batch (M = 32768), runs ptxas -v on the PTX and reports
registers per thread, spill bytes, the widest global load (from the PTX: ld.global.v4.b32 is
128 bits, eight bf16 or four fp32 values) and the shared memory Triton allocated.

Pointers, row strides and D carry a divisibility-by-16 hint, as Triton's JIT gives them at run
time for 16-byte-aligned rows; that hint is what lets the loads be 128 bits wide.

Exits non-zero if a compile fails, a configuration with D <= 16384 spills, or a kernel at
D >= 1024 has no 128-bit global load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# The default changes in Triton 3.10; pin today's behaviour and silence the warning.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from normbook.kernels import _backward, _forward  # noqa: E402
from normbook.kernels._config import MAX_FUSED_D_FWD, backward_config, forward_config  # noqa: E402

M_REPORT = 32768                                   # the batch of the performance goal
ARCHS = (80, 90)
DTYPES = ("bf16", "fp32")
DS = (1024, 4096, 8192, 16384, 65536)   # 8192: widest fused backward; 65536: chunked
QUICK = dict(archs=(90,), dtypes=("bf16",), ds=(4096, 65536))
ROW_TENSORS = {"X", "R", "S", "Y", "W", "B", "DY", "DS", "DX"}   # input dtype (weight too, here)
FP32_TENSORS = {"Stats", "DW", "DB", "PW", "PB", "C1", "C2"}           # statistics and partials


def _jit(kernel):
    """A compilable JITFunction, also when TRITON_INTERPRET=1 made the kernel interpreted."""
    return kernel if isinstance(kernel, triton.runtime.JITFunction) else triton.JITFunction(kernel.fn)


def launches(D: int, is_rms: bool, residual: bool):
    """(kernel, constexprs, launch options) of every kernel that one forward and one backward run."""
    flags = dict(IS_RMS=is_rms, HAS_WEIGHT=True)
    fwd_flags = dict(flags, HAS_RESIDUAL=residual, HAS_BIAS=not is_rms)
    bwd_flags = dict(flags, HAS_DS=residual, HAS_BIAS=not is_rms)
    fwd, bwd = forward_config(M_REPORT, D), backward_config(M_REPORT, D)
    out = []
    if fwd.chunked:
        out.append((_forward.norm_fwd_chunked_kernel, dict(fwd_flags, BLOCK_D=fwd.BLOCK_D), fwd))
    else:
        rows = dict(ROWS=fwd.ROWS, BLOCK_D=fwd.BLOCK_D)
        out.append((_forward.norm_fwd_rows_kernel, dict(fwd_flags, **rows), fwd))
    if bwd.chunked:
        out.append((_backward.norm_bwd_stats_kernel, dict(flags, BLOCK_D=bwd.BLOCK_D), bwd))
        out.append((_backward.norm_bwd_chunked_kernel, dict(bwd_flags, BLOCK_D=bwd.BLOCK_D), bwd))
    else:
        rows = dict(ROWS=bwd.ROWS, BLOCK_D=bwd.BLOCK_D)
        out.append((_backward.norm_bwd_rows_kernel, dict(bwd_flags, **rows), bwd))
    finish = _backward.FINISH_CONFIG
    out.append((_backward.norm_bwd_finish_kernel,
                dict(HAS_WEIGHT=True, HAS_BIAS=not is_rms, BLOCK_P=finish.ROWS, BLOCK_D=finish.BLOCK_D),
                finish))
    return out


def signature(fn, dtype: str, constexprs: dict):
    """Triton signature and divisibility attrs, from the argument names of a kernel."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in ROW_TENSORS:
            sig[name] = f"*{dtype}"
        elif name in FP32_TENSORS:
            sig[name] = "*fp32"
        elif name == "eps":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"                                # M, D, stride_*
        if sig[name].startswith("*") or name == "D" or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]       # 16-byte aligned rows
    return sig, attrs


def load_bits(ptx: str) -> int:
    """Width in bits of the widest global load in the PTX (ld.global.v4.b32 -> 128)."""
    widest = 0
    for vec, bits in re.findall(r"ld\.global(?:\.[a-z]\w*)*?(?:\.v(\d))?\.[bfsu](\d+)", ptx):
        widest = max(widest, int(vec or 1) * int(bits))
    return widest


def ptxas_info(ptx: str, arch: int) -> tuple[int, int]:
    """(registers per thread, spill store + load bytes) from ptxas -v."""
    ptxas = get_ptxas(arch).path
    gpu = "sm_90a" if arch == 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    registers = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", text))
    return registers, spills


def compile_one(kernel, constexprs, options: dict, dtype, arch) -> dict:
    fn = _jit(kernel)
    sig, attrs = signature(fn, dtype, constexprs)
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    registers, spills = ptxas_info(compiled.asm["ptx"], arch)
    return dict(registers=registers, spill_bytes=spills, load_bits=load_bits(compiled.asm["ptx"]),
                shared_bytes=compiled.metadata.shared)


def run(archs=ARCHS, dtypes=DTYPES, ds=DS, residual_d=4096) -> list[dict]:
    """Compile every configuration; one row per (kernel, arch, dtype, D, norm, residual)."""
    rows = []
    for arch in archs:
        for dtype in dtypes:
            for D in ds:
                for is_rms in (False, True):
                    for residual in (False, True) if D == residual_d else (False,):
                        for kernel, constexprs, cfg in launches(D, is_rms, residual):
                            row = dict(kernel=kernel.fn.__name__,
                                       arch=f"sm_{arch}", dtype=dtype, D=D,
                                       norm="rms" if is_rms else "layer", residual=residual,
                                       num_warps=cfg.num_warps, ROWS=constexprs.get("ROWS", 1),
                                       BLOCK_D=constexprs["BLOCK_D"])
                            try:
                                row.update(compile_one(kernel, constexprs, cfg.launch(), dtype, arch))
                            except Exception as e:  # noqa: BLE001 - reported, and the exit code says so
                                row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
                            rows.append(row)
    return rows


def problems(row: dict) -> list[str]:
    """Why a row fails the report: a compile error, spills at D <= MAX_FUSED_D, narrow loads."""
    if "error" in row:
        return [row["error"]]
    out = []
    if row["D"] <= MAX_FUSED_D_FWD and row["spill_bytes"] > 0:
        out.append(f"spills {row['spill_bytes']} bytes")
    if row["D"] >= 1024 and row["load_bits"] < 128:
        out.append(f"widest load {row['load_bits']} bits, expected 128")
    return out


def table(rows: list[dict]) -> str:
    head = ("kernel", "arch", "dtype", "D", "norm", "res", "warps", "ROWS", "regs", "spill", "ld bits", "smem", "")
    lines = [head]
    for r in rows:
        lines.append((r["kernel"], r["arch"], r["dtype"], str(r["D"]), r["norm"], "y" if r["residual"] else "",
                      str(r["num_warps"]), str(r["ROWS"]), str(r.get("registers", "-")),
                      str(r.get("spill_bytes", "-")), str(r.get("load_bits", "-")),
                      str(r.get("shared_bytes", "-")), "; ".join(problems(r)) or "ok"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="sm_90, bf16, D in (4096, 65536) only")
    parser.add_argument("--archs", help="comma list of compute capabilities (default 80,90)")
    args = parser.parse_args(argv)
    opts = dict(QUICK) if args.quick else {}
    if args.archs:
        try:
            opts["archs"] = tuple(int(a) for a in args.archs.split(","))
        except ValueError:
            parser.error(f"--archs: expected a comma list such as 80,90, got {args.archs!r}")
    start = time.perf_counter()
    rows = run(**opts)
    seconds = time.perf_counter() - start
    print(table(rows))
    failed = [r for r in rows if problems(r)]
    print(f"\n{len(rows)} kernel configurations compiled in {seconds:.1f} s with Triton "
          f"{triton.__version__}; {len(failed)} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, m=M_REPORT, seconds=round(seconds, 1),
                           rows=rows), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # The interpreter replaces triton's compiler in this process (and make exports
        # TRITON_INTERPRET=1): run the report again in a process where kernels compile.
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, "-m", "normbook.kernels.report", *sys.argv[1:]], env)
    sys.exit(main())
