"""The serial path of a row step, counted in the SASS that runs (``cuobjdump -sass``).

A row step cannot end sooner than its chain of waits: the loads whose values it needs before
it can go on, the block reductions (warp shuffles, shared memory, a barrier), and, for the
kernels that share a row among programs, the exchange of partial sums. PTX order is not what
runs (ptxas hoists loads and interleaves reductions), so the chain is read from the compiled
cubin. A program whose chain is longer than its step's time at bandwidth needs other
programs resident to hide it.

    python -m normbook.kernels.sass      # the table for sm_90 bf16

The count, for one row step (the body of the program's main loop):

* the **main loop** is the outermost backward branch whose body publishes (a 64-bit atomic
  exchange, ``ATOM*.EXCH``, or a ``RED``) or, in a kernel without an exchange, stores (``STG``);
* segment **to_publish**: from the loop head to the publish; segment **to_store**: from the end
  of the wait (the exit of the inner loop that polls the slots with strong, volatile loads) to
  the last store of the widest width (the output row, not a statistic, nor the h = x + residual
  that a forward with the fused add stores before its reductions); without an exchange,
  from the loop head to that store;
* a segment is one path through the loop body's forward branches, the one with the fewest
  instructions that reaches its end: rare branches (an overflowing row, the row a late program
  finishes, the slice that stores the statistics) are skipped; inner loops count once;
* **waits** are read from the control words that cuobjdump prints as the second hex word of
  each instruction (sm_70 and later): an instruction that produces a value late (a load, a
  shuffle) sets a scoreboard, one that needs it waits on that scoreboard. A wait that resolves
  a global load issued after the previous such wait is one **dependent load** (a round: loads
  issued before a wait are in flight together and all arrive with it). A load whose address
  is the same every step (no register of it written in the loop: the weight, the bias) is an
  **L2** load; strong and volatile loads (the slots) too; the others are **HBM** loads.
  Shuffle rounds are counted the same way;
* a **block reduction** is a barrier (``BAR.SYNC``) with a shared-memory store before it and
  a shared-memory load after it (since and until the neighbouring barriers); a ``BAR.RED`` is
  one by itself. Other barriers are counted as ``barriers`` only.

Limits, stated so that a GPU run can correct them: loads issued outside a segment are taken as
arrived (the next row's loads issued before the wait, the async copies of a pipelined loop
issued steps ahead: their latency is the bandwidth part of the model); a round costs a full
latency even when arithmetic overlaps part of it; the path with the fewest instructions is
assumed to be the common one; the exchange's cost (the other programs' skew and the L2 round
trips of the publish and the polls) is the model's ``exchange`` setting, not counted here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from typing import NamedTuple, Optional

# Assumed prices of a chain's steps, not measurements: the chain's counts are facts of the
# code, its microseconds only these assumptions (the H200's run of 2026-12-04 measured the
# kernels that share a row well below what these prices allowed: benchmarks/results/).
from normbook.bench.model import EXCHANGE_S, HBM_LATENCY_S  # noqa: E402,F401  (1 us each)
L2_LATENCY_S = 0.5e-6      # a load that hits in L2 (weights, slots) under a full memory load
BARRIER_ROUND_S = 80e-9    # shared-memory store, bar.sync of the block, shared-memory load
SHUFFLE_ROUND_S = 15e-9    # one butterfly level: a SHFL and the add that waits for it
# so one block reduction of 8 warps (5 + 3 levels and a barrier) is about 200 ns

ROWS_DS = (4096, 8192)     # rows kernels compiled for comparison by kernel_serial_paths


# --------------------------------------------------------------------------- the SASS text

def cuobjdump() -> str:
    """Path of the cuobjdump that ships with Triton's NVIDIA backend."""
    import triton.backends.nvidia as nvidia
    path = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"cuobjdump not found at {path}: Triton's NVIDIA backend ships it "
                                "in its bin/ folder; reinstall triton")
    return path


def sass_of(compiled) -> str:
    """The SASS of a compiled Triton kernel (``compiled.asm["cubin"]``), as ``cuobjdump -sass``
    prints it: each instruction followed by its two 64-bit encoding words."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"cuobjdump -sass failed: {out.stderr.strip()}")
    return out.stdout


def _cache_dir() -> str:
    """Where :func:`serial_path_of` keeps its counts: beside Triton's own cache."""
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton",
                                                                 "cache")
    return os.path.join(root, "normbook-sass")


def serial_path_of(compiled) -> dict:
    """:func:`serial_path` of a compiled kernel, kept on disk by the hash of its cubin and of
    this module's source: disassembling takes nvdisasm about half a second to start, the
    compile report asks for hundreds of kernels, and Triton's cache already makes their
    compiles free the second time."""
    import hashlib
    import json
    with open(__file__, "rb") as f:
        key = hashlib.sha256(compiled.asm["cubin"] + f.read()).hexdigest()
    path = os.path.join(_cache_dir(), key[:40] + ".json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    counts = serial_path(sass_of(compiled))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{id(counts)}"
        with open(tmp, "w") as f:
            json.dump(counts, f)
        os.replace(tmp, path)            # whole or absent, also with several writers
    except OSError:
        pass                             # a read-only cache: count again next time
    return json.loads(json.dumps(counts))   # the same types as from the cache (lists)


class Ins(NamedTuple):
    """One SASS instruction: its 1-based line in the text, address, guard predicate, opcode
    with modifiers, operands, and from its control word the scoreboard it sets when its result
    is ready (``wb``), the one it sets when its sources are read (``rb``; None: none) and the
    scoreboards it waits on (``wait``, a 6-bit mask)."""

    line: int
    addr: int
    pred: str
    op: str
    args: str
    wb: Optional[int]
    rb: Optional[int]
    wait: int


_INS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(?:(@!?U?P\w+)\s+)?([A-Z][\w.]*)\s*([^;]*?)\s*;"
                  r"\s*/\*\s*0x[0-9a-f]{16}\s*\*/\s*$")
_CONTROL = re.compile(r"^\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")


def parse(sass: str) -> list[Ins]:
    """The instructions of the first function in cuobjdump's output. The control bits sit at
    bits 105-125 of the 128-bit encoding, the top of the second word: stall (4 bits), yield,
    write scoreboard (3), read scoreboard (3, 7 = none), wait mask (6), reuse (4)."""
    lines = sass.splitlines()
    out, seen_function = [], False
    for i, text in enumerate(lines):
        if "Function :" in text:
            if seen_function:
                break
            seen_function = True
        m = _INS.match(text)
        if not m:
            continue
        c = _CONTROL.match(lines[i + 1]) if i + 1 < len(lines) else None
        if c is None:
            raise ValueError(f"line {i + 1}: no control word after the instruction; serial_path "
                             "needs cuobjdump -sass output (both encoding words)")
        ctl = int(c[1], 16) >> 41
        wb, rb = (ctl >> 5) & 7, (ctl >> 8) & 7
        out.append(Ins(i + 1, int(m[1], 16), m[2] or "", m[3], m[4], None if wb == 7 else wb,
                       None if rb == 7 else rb, (ctl >> 11) & 63))
    if not out:
        raise ValueError("no SASS instructions found")
    return out


# --------------------------------------------------------------------------- the structure

def _target(x: Ins) -> Optional[int]:
    """A branch's target address (BRA, BRA.DIV, BRA with a predicate operand)."""
    if not x.op.startswith("BRA"):
        return None
    m = re.search(r"0x([0-9a-f]+)\s*$", x.args)
    return int(m[1], 16) if m else None


def _loops(ins: list[Ins]) -> list[tuple[int, int]]:
    """(head, back branch) indices of every loop: a branch to an earlier address."""
    index = {x.addr: i for i, x in enumerate(ins)}
    out = []
    for i, x in enumerate(ins):
        t = _target(x)
        if t is not None and t <= x.addr and t in index:
            out.append((index[t], i))
    return out


def _is_publish(x: Ins) -> bool:
    return (x.op.startswith("ATOM") and ".EXCH" in x.op) or x.op.startswith("RED")


def _is_store(x: Ins) -> bool:
    return x.op.startswith("STG") or x.op.startswith("ST.E")


def _is_strong_load(x: Ins) -> bool:
    return (x.op.startswith("LDG") or x.op.startswith("LD.")) and (
        ".STRONG" in x.op or ".VOLATILE" in x.op or ".MMIO" in x.op)


def _width(x: Ins) -> int:
    m = re.search(r"\.(128|64|U16|S16|U8|S8)\b", x.op)
    return {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}[m[1]] if m else 32


def _path(ins: list[Ins], start: int, end: int, lo: int, hi: int) -> list[int]:
    """Indices of the path from ``start`` to ``end`` with the fewest instructions, through
    fall-throughs and forward branches that stay in [lo, hi] (back edges are not followed:
    an inner loop counts once)."""
    index = {x.addr: i for i, x in enumerate(ins)}
    dist, prev = {start: 0}, {}
    for i in range(start, end):
        if i not in dist:
            continue
        x = ins[i]
        t = _target(x)
        conditional = x.pred or ".DIV" in x.op or re.match(r"\s*!?U?P\w+\s*,", x.args)
        stops = (x.op.startswith("BRA") and not conditional and t is not None) or (
            x.op.split(".")[0] in ("EXIT", "RET") and not x.pred)
        succ = [] if stops else [i + 1]
        if t is not None and t in index and i < index[t] <= min(end, hi) and index[t] >= lo:
            succ.append(index[t])
        for j in succ:
            if j <= end and dist[i] + 1 < dist.get(j, 1 << 30):
                dist[j], prev[j] = dist[i] + 1, i
    if end not in dist:
        raise ValueError(f"no path from SASS line {ins[start].line} to line {ins[end].line}")
    path = [end]
    while path[-1] != start:
        path.append(prev[path[-1]])
    return path[::-1]


_REG = re.compile(r"\b(U?R\d+)\b")


def _written(ins: list[Ins], lo: int, hi: int) -> set[str]:
    """Registers an instruction in [lo, hi] writes: its first operand (a 64-bit result for
    .64 and .WIDE, four registers for .128), except for stores, branches and barriers."""
    out = set()
    for x in ins[lo:hi + 1]:
        if x.op.startswith(("ST", "RED", "BRA", "BAR", "BSSY", "BSYNC", "EXIT")) \
                or "SETP" in x.op.split(".")[0] or x.op.startswith(("PLOP3", "R2P")):
            continue                    # stores, control, predicates only
        m = re.match(r"\s*(?:!?U?P\w+\s*,\s*)*(U?R)(\d+)\b", x.args)
        if not m:
            continue
        n = 4 if ".128" in x.op else 2 if (".64" in x.op or ".WIDE" in x.op) else 1
        out.update(f"{m[1]}{int(m[2]) + k}" for k in range(n))
    return out


def _load_kind(x: Ins, loop_written: set[str]) -> Optional[str]:
    """"hbm" or "l2" for a global load (or an atomic that returns a value), else None."""
    if _is_strong_load(x):
        return "l2"                     # the slots: 64-bit words at L2
    if x.op.startswith("ATOM"):
        return None if re.match(r"\s*(?:PT|!?P\d)\s*,\s*RZ\b", x.args) else "l2"
    if x.op.split(".")[0] not in ("LDG", "LD"):
        return None
    address = x.args.rsplit("[", 1)[-1]
    regs = set()
    for r in _REG.findall(address):
        regs.update({r, f"{r.rstrip('0123456789')}{int(re.sub(r'^U?R', '', r)) + 1}"})
    return "hbm" if regs & loop_written else "l2"   # same address every step: cached in L2


def _producer(x: Ins, loop_written: set[str]) -> str:
    """What an instruction that sets a write scoreboard produces late: "hbm" or "l2" (a
    global load, see :func:`_load_kind`), "shuffle", or "other" (shared memory, special
    registers, ...)."""
    return _load_kind(x, loop_written) or ("shuffle" if x.op.startswith("SHFL") else "other")


def _waits(ins: list[Ins], path: list[int]) -> list[list[int]]:
    """For each position on the path, the positions of the producers its instruction waits
    for: every one pending on a scoreboard in its wait mask (a scoreboard counts all that
    were set on it), or, for ``DEPBAR.LE SBk, N``, all on k but the newest N."""
    pending: dict[int, list[int]] = {}
    out = []
    for pos, i in enumerate(path):
        x = ins[i]
        resolved = []
        for sb in range(6):
            if x.wait >> sb & 1:
                resolved += pending.pop(sb, [])
        m = x.op.startswith("DEPBAR") and re.search(r"SB(\d)\s*,\s*(0x[0-9a-f]+|\d+)", x.args)
        if m:
            q, keep = pending.get(int(m[1]), []), int(m[2], 0)
            resolved += q[:len(q) - keep]
            pending[int(m[1])] = q[len(q) - keep:]
        out.append(resolved)
        if x.wb is not None:
            pending.setdefault(x.wb, []).append(pos)
    return out


def _rounds(waits: list[list[int]], kinds: list[str], classes: tuple[str, ...]) -> list[list[int]]:
    """Rounds of latency: a wait for a producer of ``classes`` not yet in a round starts one,
    made of every producer of those classes issued so far, not yet in a round, that the path
    waits for somewhere (they are in flight together; a prefetch that no one waits for is
    not part of the chain). Each round as the positions of its producers."""
    used = {p for w in waits for p in w if kinds[p] in classes}
    done, out = set(), []
    for pos, w in enumerate(waits):
        if any(kinds[p] in classes and p not in done for p in w):
            group = [p for p in range(pos) if p in used and p not in done]
            done.update(group)
            out.append(group)
    return out


def _count(ins: list[Ins], path: list[int], loop_written: set[str]) -> dict:
    """The waits along a path: dependent load rounds (HBM when any load of the round is),
    shuffle rounds, block reductions, barriers, and the lines of each load round's loads."""
    kinds = [_producer(ins[i], loop_written) if ins[i].wb is not None else "" for i in path]
    waits = _waits(ins, path)
    loads = _rounds(waits, kinds, ("hbm", "l2"))
    hbm = sum(any(kinds[p] == "hbm" for p in r) for r in loads)
    c = dict(hbm_loads=hbm, l2_loads=len(loads) - hbm,
             shuffle_rounds=len(_rounds(waits, kinds, ("shuffle",))), reductions=0, barriers=0,
             load_lines=[[ins[path[p]].line for p in r] for r in loads])
    sts_since_bar, bar_open = False, False
    for i in path:
        x = ins[i]
        if x.op.startswith("BAR"):
            c["barriers"] += 1
            if ".RED" in x.op:
                c["reductions"] += 1
            bar_open, sts_since_bar = sts_since_bar, False
        elif x.op.startswith("STS"):
            sts_since_bar = True
        elif x.op.startswith("LDS") and bar_open:   # stored, synchronized, loaded: a reduction
            c["reductions"] += 1
            bar_open = False
    return c


def serial_path(sass: str) -> dict:
    """The chain of waits of one row step of a kernel, from its SASS (see the module's
    docstring for how it is counted and what it leaves out).

    Returns a dict: ``loop``, the SASS lines (1-based) of the main loop's head and back
    branch (None: no loop, the whole function is the step); ``exchange``, whether the step
    publishes and waits; ``publish`` and ``wait``, the line of the publish and the lines of
    the wait loop (head, back branch), or None; ``to_publish`` (None without an exchange) and
    ``to_store``, the segments, each with ``lines`` (first, last), ``hbm_loads``,
    ``l2_loads`` (dependent load rounds), ``reductions`` (block reductions),
    ``shuffle_rounds``, ``barriers`` and ``load_lines`` (the lines of each round's loads).
    """
    ins = parse(sass)
    loops = _loops(ins)
    publishing = [(h, b) for h, b in loops if any(_is_publish(x) for x in ins[h:b + 1])]
    storing = [(h, b) for h, b in loops if any(_is_store(x) for x in ins[h:b + 1])]
    candidates = publishing or storing
    if candidates:   # the outermost, first: not inside another candidate
        lo, hi = min(candidates, key=lambda hb: (hb[0], -hb[1]))
    else:
        lo, hi = 0, len(ins) - 1
    written = _written(ins, lo, hi)
    out = dict(loop=(ins[lo].line, ins[hi].line) if candidates else None, exchange=False,
               publish=None, wait=None, to_publish=None)
    start = lo
    publish = next((i for i in range(lo, hi + 1) if _is_publish(ins[i])), None)
    if publish is not None:
        seg = _count(ins, _path(ins, lo, publish, lo, hi), written)
        out.update(exchange=True, publish=ins[publish].line,
                   to_publish=dict(lines=(ins[lo].line, ins[publish].line), **seg))
        waits = [(h, b) for h, b in loops if publish < h and b < hi
                 and any(_is_strong_load(x) for x in ins[h:b + 1])]
        if waits:
            h, b = min(waits)
            out["wait"] = (ins[h].line, ins[b].line)
            start = b + 1
        else:
            start = publish + 1
    stores = [i for i in range(start, hi + 1) if _is_store(ins[i])]
    if not stores:
        raise ValueError(f"no global store after SASS line {ins[start].line} in the row step")
    widest = max(_width(ins[i]) for i in stores)
    end = max(i for i in stores if _width(ins[i]) == widest)
    seg = _count(ins, _path(ins, start, end, lo, hi), written)
    out["to_store"] = dict(lines=(ins[start].line, ins[end].line), **seg)
    return out


# --------------------------------------------------------------------------- the latency

def serial_latency_s(counts: dict, hw: Optional[dict] = None) -> float:
    """Seconds one row step's chain of waits takes (:func:`serial_path`'s counts): each HBM
    load round ``hw["latency"]``, each L2 round ``hw["l2_latency"]`` (L2_LATENCY_S if absent),
    each block reduction BARRIER_ROUND_S, each shuffle level SHUFFLE_ROUND_S, and with an
    exchange, ``hw["exchange"]``. ``hw``: HBM_LATENCY_S and EXCHANGE_S by default."""
    if hw is None:
        hw = dict(latency=HBM_LATENCY_S, exchange=EXCHANGE_S)
    t = hw["exchange"] if counts["exchange"] else 0.0
    for seg in (counts.get("to_publish"), counts.get("to_store")):
        if seg:
            t += (seg["hbm_loads"] * hw["latency"] + seg["l2_loads"] * hw.get("l2_latency", L2_LATENCY_S)
                  + seg["reductions"] * BARRIER_ROUND_S + seg["shuffle_rounds"] * SHUFFLE_ROUND_S)
    return t


# --------------------------------------------------------------------------- the kernels

ROW_TENSORS = {"X", "R", "H", "Y", "W", "B", "DY", "DH", "DX"}     # the input's dtype
FP32_TENSORS = {"Stats", "DW", "DB", "PW", "PB"}                    # statistics and partials


def _signature(fn, dtype: str, constexprs: dict, D: int):
    """Triton signature and divisibility hints as the JIT gives them for 16-byte-aligned rows:
    :func:`normbook.kernels.report.signature`, or :func:`_local_signature` if that cannot be
    imported."""
    try:
        from normbook.kernels.report import signature
    except (ImportError, AttributeError):
        return _local_signature(fn, dtype, constexprs, D)
    return signature(fn, dtype, constexprs, D)


def _local_signature(fn, dtype: str, constexprs: dict, D: int):
    """The same as the report's signature, for the kernels' argument names: row tensors in
    ``dtype``, statistics and partials fp32, the slots int64, sizes and strides i32 (with the
    divisibility-by-16 hint when D has it), every pointer 16-byte aligned."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name] = (f"*{dtype}" if name in ROW_TENSORS else "*fp32" if name in FP32_TENSORS
                     else "*i64" if name == "Slots" else "fp32" if name == "eps" else "i32")
        if sig[name].startswith("*") or (D % 16 == 0 and (name == "D" or name.startswith("stride"))):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_plan(plan, D: int, dtype: str = "bf16", arch: int = 90):
    """Compile the kernel of a launch plan (:class:`normbook.kernels._config.Plan`) for sm_<arch>
    without a GPU. Needs a process where TRITON_INTERPRET is unset."""
    from normbook.kernels.report import compiles_here

    compiles_here()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from normbook.kernels import _backward, _forward
    kernel = getattr(_forward if plan.kernel.startswith("norm_fwd") else _backward, plan.kernel)
    fn = kernel if isinstance(kernel, triton.runtime.JITFunction) else triton.JITFunction(kernel.fn)
    sig, attrs = _signature(fn, dtype, plan.constexprs, D)
    src = ASTSource(fn=fn, signature=sig, constexprs=plan.constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=plan.options)


def kernel_serial_paths(arch: int = 90, dtype: str = "bf16", ds=(16384, 32768, 65536, 131072),
                        rows_ds=ROWS_DS, M: int = 32768) -> list[dict]:
    """The serial path of every kernel the launchers run for LayerNorm (weight and bias, no
    residual) on M rows of each D in ``ds`` and ``rows_ds`` (the finish kernel aside), with
    the plans' constexprs and options. Per kernel: its plan (kernel, direction, D, slices S,
    BLOCK_D, num_warps, programs per SM), the counts of :func:`serial_path`, ``serial_s``
    (:func:`serial_latency_s`) and ``step_s``: the step's bytes (its programs' share of the
    row-sized tensors read and written, all programs resident on an SM) at the SM's share of
    the bandwidth, the time the chain has to fit in."""
    from normbook.bench.model import H200
    from normbook.kernels._config import Device, backward_plan, forward_plan
    dev, e = Device(arch, H200["sms"]), {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    out = []
    for D in sorted(set(ds) | set(rows_ds)):
        plans = [*forward_plan(M, D, dev, e, False, False, True, True),
                 *(backward_plan(M, D, dev, e, False, False, True, True) or ())]
        for plan in plans:
            if plan.kernel == "norm_bwd_finish_kernel":
                continue
            counts = serial_path(sass_of(compile_plan(plan, D, dtype, arch)))
            width = min(D, plan.constexprs["BLOCK_D"]) * plan.rows
            step_bytes = plan.per_sm * width * e * (plan.reads + plan.writes)
            out.append(dict(kernel=plan.kernel, direction="fwd" if "fwd" in plan.kernel else "bwd",
                            D=D, slices=plan.slices, BLOCK_D=plan.constexprs["BLOCK_D"],
                            num_warps=plan.options["num_warps"], per_sm=plan.per_sm, **counts,
                            serial_s=serial_latency_s(counts),
                            step_s=step_bytes / (H200["bandwidth"] / H200["sms"])))
    return out


def table(rows: list[dict]) -> str:
    """One line per kernel: the counts of each segment (HBM rounds / L2 rounds / block
    reductions / shuffle levels), the serial latency and the step's time at bandwidth (us)."""
    head = ("kernel", "D", "S", "warps", "to_publish h/l2/red/shfl", "to_store h/l2/red/shfl",
            "exch", "serial us", "step us")

    def seg(s):
        return "-" if s is None else (f"{s['hbm_loads']}/{s['l2_loads']}/{s['reductions']}/"
                                      f"{s['shuffle_rounds']}")
    lines = [head] + [(r["kernel"].removeprefix("norm_").removesuffix("_kernel"), str(r["D"]),
                       str(r["slices"]), str(r["num_warps"]), seg(r["to_publish"]), seg(r["to_store"]),
                       "y" if r["exchange"] else "", f"{r['serial_s'] * 1e6:.2f}",
                       f"{r['step_s'] * 1e6:.2f}") for r in rows]
    widths = [max(len(line[k]) for line in lines) for k in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines)


def main() -> int:
    import json
    rows = kernel_serial_paths()
    print(table(rows))
    if len(sys.argv) > 2 and sys.argv[1] == "--json":
        with open(sys.argv[2], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # kernels compile only where the interpreter is off (see normbook.kernels.report)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, "-m", "normbook.kernels.sass", *sys.argv[1:]], env)
    sys.exit(main())
