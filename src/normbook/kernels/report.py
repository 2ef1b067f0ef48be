"""The static compile report: every kernel compiled for sm_80 and sm_90 on a machine without a GPU.

    python -m normbook.kernels.report [--json PATH] [--quick]

For each kernel, arch, dtype and row length D it compiles the kernel exactly as the launchers
would configure it for a large batch (M = 32768), runs ptxas -v on the PTX and reports
registers per thread, spill bytes, the widest global load (from the PTX: ld.global.v4.b32 is
128 bits, eight bf16 or four fp32 values) and the shared memory Triton allocated; and from the
SASS (:mod:`normbook.kernels.sass`) the chain of waits of a row step: dependent load rounds
and block reductions from the step's first load to its publish and from the wait to the
store, and their latency at assumed prices (``sass.HBM_LATENCY_S`` and others).

Pointers, row strides and D carry a divisibility-by-16 hint, as Triton's JIT gives them at run
time for 16-byte-aligned rows; that hint is what lets the loads be 128 bits wide.

Exits non-zero if a compile fails, a configuration spills, a kernel at D >= 256 has no
128-bit global load where D is a multiple of 16 bytes, or a kernel compiled for sm_80 takes
more shared memory than a program may have on sm_86 and sm_89
(``normbook.bench.model.SHARED_SM86``): the plans do not depend on the device's shared
memory, and the smaller Ampere and Ada GPUs (RTX 30 and 40, A10, L4) compile the same
pipelines as sm_80, which would not launch there.

Refusals are one line, ``normbook-report: error: ...``, exit status 2, before anything is
compiled: an architecture outside ``ARCHS`` (the plans, the model and the goal are sm_80's
and sm_90's; sm_100 and sm_120 fail in ptxas, and a mistyped 9 aborts LLVM, taking the report
with it), a ``--json`` that could not be written, no Triton, or TRITON_INTERPRET set (Triton's
interpreter then stands in for its compiler, and every configuration failed to compile).
The command line, those refusals included, is ``normbook._report_cli``, outside this
package (which imports Triton when imported): the console script ``normbook-report`` prints
its ``--help`` and refuses in one line without Triton, and imports this module only to compile.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# The default changes in Triton 3.10; pin today's behaviour and silence the warning.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

# the command line (main) and what --archs accepts (ARCHS, run's default) live outside this package
from normbook._report_cli import ARCHS, main  # noqa: E402,F401
from normbook.bench import bytemodel, goal, model  # noqa: E402
from normbook.kernels import sass  # noqa: E402
from normbook.kernels._config import (  # noqa: E402
    Device, Plan, backward_plan, forward_plan, narrow_loads)

try:   # needed to compile, not to print --help: without it main refuses in one line
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from normbook.kernels import _backward, _forward
    NO_TRITON = None
except ImportError as e:
    NO_TRITON = f"{type(e).__name__}: {e}"

M_REPORT = goal.GOAL["M"]                          # the batch of the performance goal
DTYPES = ("bf16", "fp32")
# every power of two of the goal, and odd widths (760, 3000: D % 16 != 0; 12288: 3 x 4096)
DS = (760, 1024, 2048, 3000, 4096, 8192, 12288, 16384, 32768, 65536, 131072)
QUICK = dict(archs=(90,), dtypes=("bf16",), ds=(3000, 65536), residual_d=3000)
ROW_TENSORS = {"X", "R", "H", "Y", "W", "B", "DY", "DH", "DX"}   # input dtype (weight too, here)
FP32_TENSORS = {"Stats", "DW", "DB", "PW", "PB", "Mean", "Rstd"}    # statistics and partials


def _jit(kernel):
    """A compilable JITFunction, also when TRITON_INTERPRET=1 made the kernel interpreted."""
    return kernel if isinstance(kernel, triton.runtime.JITFunction) else triton.JITFunction(kernel.fn)


def launches(D: int, is_rms: bool, residual: bool, dtype: str = "bf16", arch: int = 90,
             M: int = M_REPORT, sms: int = model.H200["sms"]) -> list[Plan]:
    """The plans of one forward and one backward (weight, and bias for LayerNorm), as the
    launchers make them for M rows on a GPU of ``sms`` SMs: the same functions, the same
    cache. Empty for a direction that has no plan for rows of D."""
    dev, e = Device(arch, sms), bytemodel.itemsize(dtype)
    fwd = forward_plan(M, D, dev, e, is_rms, residual, True, not is_rms)
    bwd = backward_plan(M, D, dev, e, is_rms, residual, True, not is_rms)
    return [*fwd, *(bwd or ())]


def kernel_of(plan: Plan):
    """The @triton.jit function a plan launches."""
    return getattr(_forward if plan.kernel.startswith("norm_fwd") else _backward, plan.kernel)


def direction(plan: Plan) -> str:
    return "fwd" if plan.kernel.startswith("norm_fwd") else "bwd"


def traffic(plan: Plan, D: int, dtype: str, M: int = M_REPORT) -> dict:
    """What one launch moves, counted from its plan: HBM bytes per row of the problem (its
    row-sized tensors read and written, the fp32 statistics; once per launch, the parameters,
    the fp32 partials and a shared row's slot buffer, 8 bytes a word (:attr:`Plan.slot_words`:
    exchanged at L2 and written back at most once; kept, not zeroed, between launches), the
    bytes of loads one program has in flight per step of its loop (its tile), its grid, and (but for the finish kernel, which has no rows) the bytes
    one program's row step reads and writes, which must outlast its chain of waits."""
    e = bytemodel.itemsize(dtype)
    out = dict(bytes_per_row=D * e * (plan.reads + plan.writes) + 4 * plan.stats
               + (D * (e * plan.params + 4 * plan.partials)
                  + 8 * plan.slot_words) / M,
               tile_bytes=plan.rows * min(D, plan.constexprs["BLOCK_D"]) * plan.elem_bytes * plan.ahead,
               grid=plan.grid[0])
    if plan.kernel != "norm_bwd_finish_kernel":
        width = plan.rows * min(D, plan.constexprs["BLOCK_D"])
        out["step_bytes"] = width * e * (plan.reads + plan.writes)
    return out


def paths(rows: list[dict]) -> list[dict]:
    """What each path (arch, dtype, norm, residual, direction, D: the kernels of one forward or
    one backward) moves and keeps in flight: HBM bytes per row against the byte model's
    minimum, and its main kernel's (the one that moves most) programs per SM and bytes of
    loads in flight per SM (:func:`normbook.bench.model.inflight_bytes`). Counts, not a speed
    (see :mod:`normbook.bench.model` for why the predicted fraction went)."""
    groups: dict = {}
    for r in rows:
        key = (r["arch"], r["dtype"], r["norm"], r["residual"], r["direction"], r["D"])
        groups.setdefault(key, []).append(r)
    out = []
    for (arch, dtype, norm, residual, direction, D), ks in groups.items():
        p = dict(arch=arch, dtype=dtype, norm=norm, residual=residual, direction=direction, D=D,
                 kernels=[k["kernel"] for k in ks])
        if any("error" in k for k in ks):
            p["error"] = "a kernel of this path did not compile"
            out.append(p)
            continue
        op = ("add_" if residual else "") + ("rms_norm" if norm == "rms" else "layer_norm")
        minimum = bytemodel.bytes_moved(op, direction, M_REPORT, D, dtype) / M_REPORT
        main = max(ks, key=lambda k: k["bytes_per_row"])
        p.update(hbm_bytes_per_row=round(sum(k["bytes_per_row"] for k in ks), 1),
                 min_bytes_per_row=round(minimum, 1), **model.inflight_bytes(main))
        out.append(p)
    return out


def signature(fn, dtype: str, constexprs: dict, D: int = 1024):
    """Triton signature and divisibility attrs, from the argument names of a kernel. D, and the
    row strides (D for contiguous rows), carry the divisibility-by-16 hint only when D has it,
    as Triton's JIT would specialize them."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in ROW_TENSORS:
            sig[name] = f"*{dtype}"
        elif name in FP32_TENSORS:
            sig[name] = "*fp32"
        elif name == "Slots":
            sig[name] = "*i64"                           # the backward's exchange slots
        elif name == "eps":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"                                # M, D, stride_*
        if sig[name].startswith("*") or (D % 16 == 0 and (name == "D" or name.startswith("stride"))):
            attrs[(i,)] = [["tt.divisibility", 16]]       # 16-byte aligned rows
    return sig, attrs


def load_bits(ptx: str) -> int:
    """Width in bits of the widest global load in the PTX: ld.global.v4.b32 is 128, and so is
    an asynchronous copy of 16 bytes into shared memory (cp.async ... 0x10), how a pipelined
    loop loads."""
    widest = 0
    for vec, bits in re.findall(r"ld\.global(?:\.[a-z]\w*)*?(?:\.v(\d))?\.[bfsu](\d+)", ptx):
        widest = max(widest, int(vec or 1) * int(bits))
    for size in re.findall(r"cp\.async\.c[ag]\.shared\.global[^,]*,[^,]*,\s*(0x[0-9a-fA-F]+|\d+)", ptx):
        widest = max(widest, 8 * int(size, 0))
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


def compile_one(kernel, constexprs, options: dict, dtype, arch, D: int = 1024,
                serial: bool = True) -> dict:
    """Compile one kernel and read off what the report shows (see the module docstring);
    ``serial``: also count its row step's chain of waits in the SASS (:func:`serial_counts`)."""
    out, compiled = _compile(kernel, constexprs, options, dtype, arch, D)
    if serial:
        out.update(serial_counts(sass.serial_path_of(compiled)))
    return out


def _compile(kernel, constexprs, options: dict, dtype, arch, D: int):
    """compile_one without the SASS: its row and the compiled kernel."""
    fn = _jit(kernel)
    sig, attrs = signature(fn, dtype, constexprs, D)
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    registers, spills = ptxas_info(compiled.asm["ptx"], arch)
    # a loop is software-pipelined when the compiler turned its loads into async copies, or
    # when it issues the next row's loads before it waits for the other programs' sums
    ptx = compiled.asm["ptx"]
    ahead = prefetched_loads(ptx)
    pipelined = "async_copy" in compiled.asm["ttgir"] or ahead > 0
    if options.get("launch_cooperative_grid"):   # the option reached the launcher's metadata
        assert compiled.metadata.launch_cooperative_grid, "launch_cooperative_grid was dropped"
    out = dict(registers=registers, spill_bytes=spills, load_bits=load_bits(ptx),
               int32_offsets=len(int32_offsets(compiled.asm["ttir"])),
               shared_bytes=compiled.metadata.shared, pipelined=pipelined,
               num_stages=constexprs.get("NUM_STAGES", 2 if ahead else compiled.metadata.num_stages),
               **({"prefetched_loads": ahead} if ahead else {}))
    return out, compiled


SEGMENT_COUNTS = ("hbm_loads", "l2_loads", "reductions", "shuffle_rounds")


def serial_counts(path: dict) -> dict:
    """A report row's share of :func:`normbook.kernels.sass.serial_path`: per segment
    (``to_publish``: from the step's first load to its publish, None without an exchange;
    ``to_store``: from the wait, or the step's head, to the row's store) the dependent HBM and
    L2 load rounds, block reductions and shuffle levels; whether it exchanges; and the chain's
    latency on the model's H200, ``serial_s``."""
    counts = {seg: None if path[seg] is None else {k: path[seg][k] for k in SEGMENT_COUNTS}
              for seg in ("to_publish", "to_store")}
    return dict(serial=dict(exchange=path["exchange"], **counts),
                serial_s=sass.serial_latency_s(path))


def int32_offsets(ttir: str) -> list[str]:
    """The 32-bit products of a program id and a runtime size in a kernel's Triton IR: offsets
    such as ``pid * D`` that wrap past 2^31 (programs x D elements) and then address memory
    outside the tensor. Each value is followed from ``tt.get_program_id`` and from the
    integer arguments (M, D, strides) through every op that uses it; an ``arith.muli`` in i32
    of one of each is reported. A product in i64 (``pid.to(tl.int64) * D``) is not."""
    head = re.search(r"tt\.func public @\w+\((.*?)\)\s*(?:attributes|\{)", ttir, re.S)
    if head is None:
        raise ValueError("int32_offsets: no 'tt.func public' header in the Triton IR")
    from_pid, from_arg = set(), set(re.findall(r"(%\w+): i(?:32|64)\b", head.group(1)))
    found = []
    for line in ttir.splitlines():
        code = line.split(" loc(")[0]
        defined = re.findall(r"(%[\w.#]+)(?::\d+)? = ", code)
        if not defined:
            continue
        used = [n for n in re.findall(r"%[\w.#]+", code) if n not in defined]
        if "tt.get_program_id" in code or any(u in from_pid for u in used):
            from_pid.update(defined)
        if any(u in from_arg for u in used):
            from_arg.update(defined)
        mul = re.search(r"= arith\.muli (%[\w.#]+), (%[\w.#]+) : (i32|tensor<[^>]*xi32>)$", code.strip())
        if mul and any(a in from_pid and b in from_arg for a, b in ((mul[1], mul[2]), (mul[2], mul[1]))):
            found.append(code.strip())
    return found


def prefetched_loads(ptx: str) -> int:
    """128-bit global loads a loop issues before it first polls another program's slot (an
    ``ld.volatile``), counted from the loop's header: loads in flight while it waits. 0 when
    the kernel never polls."""
    wait = ptx.find("ld.volatile.global")
    if wait < 0:
        return 0
    header = ptx.rfind("Loop Header", 0, wait)
    return len(re.findall(r"ld\.global(?:\.[a-z]\w*)*\.v4\.b32", ptx[header:wait])) if header >= 0 else 0


def _progress(items: list, progress):
    """``items`` with their progress on stderr. ``progress`` None (the default): a tqdm bar
    when stderr is a terminal, else (a log, CI) one plain line every tenth of the way with
    the seconds so far, so that a run of minutes is never silent; True: the bar (the plain
    lines without tqdm); False: nothing."""
    if progress is False:
        return items
    if progress or sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            return tqdm(items, desc="normbook-report: compiling", unit="config", file=sys.stderr)

    def counted():
        step, start = max(1, len(items) // 10), time.perf_counter()
        print(f"normbook-report: compiling {len(items)} configurations", file=sys.stderr, flush=True)
        for i, item in enumerate(items, 1):
            yield item
            if i % step == 0 or i == len(items):
                print(f"normbook-report: {i}/{len(items)} configurations, "
                      f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return counted()


def compiles_here() -> None:
    """A RuntimeError of one line, as the command line refuses, where the kernels were made
    interpreted (TRITON_INTERPRET set when they were decorated, ``_backward.INTERPRETED``):
    their helpers are then the interpreter's, which no compile can reference, and every row
    would hold that error."""
    from normbook.kernels import _backward

    if _backward.INTERPRETED:
        raise RuntimeError("the kernels were decorated under TRITON_INTERPRET, so Triton's "
                           "interpreter stands in for the compiler the report runs; run it "
                           "where TRITON_INTERPRET is unset (env -u TRITON_INTERPRET ...)")


def run(archs=ARCHS, dtypes=DTYPES, ds=DS, residual_d=None, progress=False) -> list[dict]:
    """Compile every configuration; one row per (kernel, arch, dtype, D, norm, residual), with
    what the kernel moves (:func:`traffic`). ``residual_d``: only that D with the fused add
    (None: every D with and without it). Many configurations are compiled in a pool of
    processes, one per CPU (Triton's compiler holds the GIL for most of a compile: in threads
    they ran one at a time, about 0.8 s each on a 2-core VM); a few, in this one. Either way
    the SASS is disassembled in threads while the next kernels compile (cuobjdump takes about
    half a second to start; the counts are cached, :func:`normbook.kernels.sass.serial_path_of`)."""
    compiles_here()
    configs = [(arch, dtype, D, is_rms, residual) for arch in archs for dtype in dtypes for D in ds
               for is_rms in (False, True)
               for residual in ((False, True) if residual_d in (None, D) else (False,))]
    workers = min(16, os.cpu_count() or 1)
    if workers < 2 or len(configs) < POOL_FROM:
        with concurrent.futures.ThreadPoolExecutor(workers) as sass_pool:
            started = [_started_rows(config, sass_pool) for config in _progress(configs, progress)]
            return [row for rows, pending in started for row in _finished(rows, pending)]
    import multiprocessing

    # spawn: a fork of a process that has imported torch and triton (and their threads) is not safe
    with concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = pool.map(config_rows, configs)   # in order, as they finish
        return [row for _, rows in zip(_progress(configs, progress), done) for row in rows]


POOL_FROM = 16   # fewer configurations than this compile in the calling process (--quick: 6)


def config_rows(config: tuple) -> list[dict]:
    """The report's rows of one configuration ``(arch, dtype, D, is_rms, residual)``: each
    launch's kernel compiled, and a row step's chain of waits counted in its SASS."""
    with concurrent.futures.ThreadPoolExecutor(2) as sass_pool:
        return _finished(*_started_rows(config, sass_pool))


def _started_rows(config: tuple, sass_pool) -> tuple[list[dict], list]:
    """:func:`config_rows`'s compiles, with each row step's SASS counting submitted to
    ``sass_pool``: (rows, [(row, future)])."""
    arch, dtype, D, is_rms, residual = config
    rows, pending = [], []
    for plan in launches(D, is_rms, residual, dtype, arch):
        row = dict(kernel=plan.kernel, direction=direction(plan),
                   arch=f"sm_{arch}", dtype=dtype, D=D,
                   norm="rms" if is_rms else "layer", residual=residual,
                   num_warps=plan.options["num_warps"], ROWS=plan.rows,
                   BLOCK_D=plan.constexprs["BLOCK_D"], slices=plan.slices,
                   **({"WEIGHT_LOADS": plan.constexprs["WEIGHT_LOADS"]}
                      if "WEIGHT_LOADS" in plan.constexprs else {}),
                   per_sm=plan.per_sm, triton=triton.__version__,
                   **traffic(plan, D, dtype))
        rows.append(row)
        try:
            out, compiled = _compile(kernel_of(plan), plan.constexprs, plan.options, dtype, arch, D)
        except Exception as e:  # noqa: BLE001 - reported, and the exit code says so
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            continue
        row.update(out)
        if "step_bytes" in row:      # a row step: its chain of waits
            pending.append((row, sass_pool.submit(sass.serial_path_of, compiled)))
    return rows, pending


def _finished(rows: list[dict], pending: list) -> list[dict]:
    """``rows`` with the SASS counts of :func:`_started_rows` waited for and added."""
    for row, counted in pending:
        try:
            row.update(serial_counts(counted.result()))
        except Exception as e:  # noqa: BLE001 - reported, and the exit code says so
            row["error"] = f"serial path: {type(e).__name__}: {e}".splitlines()[0]
    return rows


def problems(row: dict) -> list[str]:
    """Why a row fails the report: a compile error, an int32 offset that can wrap
    (:func:`int32_offsets`), spills (a row, a slice, a tile is held in registers: none may
    go to local memory), narrow loads where D is a multiple of 16 bytes of values, a
    persistent rows kernel less resident than its grid assumes, more shared memory (compiled
    for sm_80) than sm_86 and sm_89 give a program (``normbook.bench.model.SHARED_SM86``)."""
    if "error" in row:
        return [row["error"]]
    out = []
    if row.get("int32_offsets"):
        out.append(f"{row['int32_offsets']} int32 products of a program id and a size (wrap at 2^31)")
    if row["spill_bytes"]:
        out.append(f"spills {row['spill_bytes']} bytes")
    if row["arch"] == "sm_80" and row["shared_bytes"] > model.SHARED_SM86:
        out.append(f"{row['shared_bytes']} bytes of shared memory, more than a program may have "
                   f"on sm_86 and sm_89 ({model.SHARED_SM86})")
    wide_possible = not narrow_loads(row["D"], bytemodel.itemsize(row["dtype"]))
    if row["D"] >= 256 and wide_possible and row["load_bits"] < 128:
        out.append(f"widest load {row['load_bits']} bits, expected 128")
    # the persistent grid assumes per_sm programs resident; a cooperative launch fails if not
    have = model.programs_per_sm(row["registers"], row["num_warps"], row["shared_bytes"])
    if row["kernel"] != "norm_bwd_finish_kernel" and have < row["per_sm"]:
        out.append(f"{have} programs per SM, the persistent grid assumes {row['per_sm']}")
    return out


def _columns(head, lines, compact: bool) -> str:
    """Aligned text; ``compact`` drops the arch and dtype columns (the caller names them once)."""
    keep = [i for i, h in enumerate(head) if not (compact and h in ("arch", "dtype"))]
    if compact:                      # narrow enough for a book's column: short names, one space
        head = tuple(_SHORT.get(h, h) for h in head)
    lines = [head] + lines
    widths = {i: max(len(line[i]) for line in lines) for i in keep}
    sep = " " if compact else "  "
    return "\n".join(sep.join(line[i].ljust(widths[i]) for i in keep).rstrip() for line in lines)


_SHORT = {"per SM": "/SM", "warps": "w", "spill": "spill", "smem": "smem"}


def path_table(counted: list[dict], compact: bool = False) -> str:
    """:func:`paths`, one line each (``compact``: without arch and dtype)."""
    head = ("arch", "dtype", "D", "norm", "res", "dir", "bytes", "min", "per SM", "KB")
    lines = []
    for p in counted:
        start = (p["arch"], p["dtype"], str(p["D"]), p["norm"], "y" if p["residual"] else "",
                 p["direction"])
        if "error" in p:
            lines.append((*start, "-", "-", "-", p["error"]))
            continue
        lines.append((*start, f"{p['hbm_bytes_per_row']:.0f}", f"{p['min_bytes_per_row']:.0f}",
                      str(p["programs_per_sm"]), f"{p['inflight_bytes_per_sm'] / 1024:.1f}"))
    return _columns(head, lines, compact)


def table(rows: list[dict], compact: bool = False) -> str:
    """One line per compiled kernel (``compact``: without arch and dtype, and the kernel named
    without its ``norm_`` prefix and ``_kernel`` suffix)."""
    head = ("kernel", "arch", "dtype", "D", "norm", "res", "warps", "ROWS", "S", "regs", "spill", "load",
            "smem", "")
    lines = []
    for r in rows:
        name = r["kernel"].removeprefix("norm_").removesuffix("_kernel") if compact else r["kernel"]
        lines.append((name, r["arch"], r["dtype"], str(r["D"]), r["norm"], "y" if r["residual"] else "",
                      str(r["num_warps"]), str(r["ROWS"]), str(r.get("slices", 1)), str(r.get("registers", "-")),
                      str(r.get("spill_bytes", "-")), str(r.get("load_bits", "-")),
                      str(r.get("shared_bytes", "-")), "; ".join(problems(r)) or "ok"))
    return _columns(head, lines, compact)


def print_report(quick=False, archs=None, json_path=None, progress=None) -> int:
    """The command line's report, once nothing refused: compile (``QUICK``'s configurations if
    ``quick``, for ``archs`` if given), print the tables, write the JSON to ``json_path`` if
    given; returns the exit status, 1 if a configuration has a problem, else 0."""
    opts = dict(QUICK) if quick else {}
    if archs is not None:
        opts["archs"] = archs
    start = time.perf_counter()
    rows = run(**opts, progress=progress)
    seconds = time.perf_counter() - start
    print(table(rows))
    failed = [r for r in rows if problems(r)]
    counted = paths(rows)
    print("\n" + path_table(counted))
    print(f"\n{len(rows)} kernel configurations compiled in {seconds:.1f} s with Triton "
          f"{triton.__version__}; {len(failed)} failed")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(triton=triton.__version__, m=M_REPORT, seconds=round(seconds, 1),
                           rows=rows, paths=counted), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
