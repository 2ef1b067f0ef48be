"""Wide rows timed in several block shapes: the forward's two sweeps and the backward's shared rows.

    normbook-bench shapes [--json FILE [--force]] [--dims 32768,65536,131072] [--rows 32768]
                          [--ops layer_norm] [--modes fwd,bwd] [--forward SHAPES]
                          [--backward SHAPES] [--time-budget S] [--compile-only]

Why. The shape of the wide forward (``norm_fwd_loop_kernel``, ``_config.LOOP_*``) is the best
of a probe of a simpler kernel on the H200, and normbook's own loop kernel has not been timed
yet; above D = 32768 neither reached the goal's 0.80 of copy. The slice of the sharing backward
(``norm_bwd_coop_kernel``, ``_config.COOP_*``) was chosen by registers, not by time, and the
H200 measured its exchange at 2-3.8 us a row, growing with the slices a row has. Changing
either rests on a measurement: this takes one, candidate by candidate, beside the shape in
force, on the same GPU in the same process.

A forward shape is CHUNKxWARPSxRESIDENTxGRID[xSTAGES]: CHUNK bytes of a row per step of a
sweep, WARPS warps, registers capped so that RESIDENT programs fit on an SM (65536 / (32 WARPS
RESIDENT), at most 255), GRID ``M`` (a program a row) or programs per SM, each looping over
rows, and STAGES (1 unless given) the chunks of a sweep in flight (``_config.LOOP_STAGES``:
2-4 pipeline the loads through shared memory, which may leave fewer programs resident). A
backward shape is SLICExWARPSxRESIDENT[xLAG]: SLICE bytes of a row per program (a row of D
values shared by cdiv(D, SLICE / itemsize) programs), WARPS warps, RESIDENT programs per SM by
the same register cap (the grid is what the device holds at once, as always for that kernel),
and LAG (0 unless given) the rows a program publishes ahead of the one it waits for
(``_config.EXCHANGE_LAG``: 1 overlaps the exchange with the next row's loads and sums, and
gives the same bits).

For each op, mode, D and shape: the shape as planned on this device (``asked`` beside it
where the device clamps the one asked, or M leaves a grid of programs per SM a program a row;
a candidate planned as one already timed is not timed again); device time
(:func:`normbook.bench.timing.timed`: CUDA graph replays on a GPU, do_bench where a graph
cannot hold the call, the row naming its timer); GB/s of
:func:`normbook.bench.bytemodel.bytes_moved` and its fraction of a copy timed in the same run;
the plan's programs; the kernel's registers, spill bytes and shared memory, compiled for this
device's architecture by :mod:`normbook.kernels.report` (not in Triton's interpreter), and the
programs an SM holds by them; and ``max_diff``, the largest difference from the outputs of the
shape in force, each relative to that output's largest value (other chunks or slices sum in
another order: rounding, within ``ROUNDING``; a candidate that differs by more is a defect, not
a speed, and is not among the fastest; None where the shape in force has no output to compare
with). ``--compile-only`` compiles the candidates' plans for sm_90 (an H200 planned,
no device needed, the interpreter off) and gives registers and spills alone: the candidates
that spill are known before a GPU's minutes are spent on them.

JSON, written again after every row: ``rows`` (op, mode, D, M, shape, in_force and the
figures above, or ``error``), ``best`` (per op, mode and D: the fastest shape and its time
beside the shape in force's), ``copy_gbps``, the device and the versions.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import NamedTuple

import torch

from normbook.bench.model import H200, SHARED_SM86

__all__ = ["LoopShape", "CoopShape", "parse", "using", "in_force", "measure", "main",
           "FORWARD", "BACKWARD"]

DESCRIPTION = __doc__.split("\n\n")[0]
EXAMPLES = """examples:
  normbook-bench shapes --json shapes.json    # on a GPU: every candidate
  normbook-bench shapes --compile-only --ops layer_norm,rms_norm
                                              # no GPU: registers and spills, sm_90
  TRITON_INTERPRET=1 normbook-bench shapes --dims 20000 --rows 3 --forward 16384x32x1x1 \\
      --backward 16384x16x1                   # on a CPU: the code runs; no speed
"""
REGISTERS = H200["registers"]        # an SM's register file (sm_80, sm_90)


def _cap(warps: int, resident: int) -> int:
    """Registers a thread may use so that ``resident`` programs of ``warps`` warps fit an SM."""
    return min(H200["thread_registers"], REGISTERS // (32 * warps * resident))


class LoopShape(NamedTuple):
    """A shape of the wide forward: see the module docstring. ``grid`` 0 is ``M``."""

    chunk_bytes: int
    warps: int
    resident: int
    grid: int
    stages: int = 1

    @property
    def maxnreg(self) -> int:
        return _cap(self.warps, self.resident)

    def __str__(self) -> str:
        return f"{self.chunk_bytes}x{self.warps}x{self.resident}x{self.grid or 'M'}" + (
            f"x{self.stages}" if self.stages > 1 else "")


class CoopShape(NamedTuple):
    """A shape of the sharing backward: see the module docstring."""

    slice_bytes: int
    warps: int
    resident: int
    lag: int = 0

    @property
    def maxnreg(self) -> int:
        return _cap(self.warps, self.resident)

    def __str__(self) -> str:
        return f"{self.slice_bytes}x{self.warps}x{self.resident}" + (
            f"x{self.lag}" if self.lag else "")


# The candidates timed by default, beside the shape in force (a candidate equal to it is not
# timed twice). Forward: the probe's best shapes (chunks of 8192 bytes, a row a program, up to
# D = 32768; 16384 bytes and 8 programs per SM past it), each with the other grid; four programs
# per SM resident (8 warps: more rows in flight) and one (32 warps, one program per SM: fewer,
# and less of L2 held between the sweeps); chunks of 32768 bytes; and the probe's shapes with
# their sweeps' loads pipelined (2-3 chunks in flight). None spills on sm_90 (``--compile-only``:
# 40-63 registers). Backward: the slice in force (8192 bytes, 8 warps, two per SM), the same one
# row behind (LAG 1: the exchange overlapped with the next row's work), half the slice (twice
# the slices a row; four per SM) and twice it (half the slices: the exchange's cost a row grew
# with them; 16 warps, one per SM); 16384 bytes on 8 warps spills 976-1768 bytes.
FORWARD = ("8192x16x2xM", "16384x16x2x8", "16384x16x2xM", "8192x8x4xM", "16384x32x1x1",
           "32768x32x1xM", "8192x16x2xMx3", "16384x16x2x8x3", "16384x16x2xMx2")
BACKWARD = ("8192x8x2", "8192x8x2x1", "4096x4x4", "16384x16x1")


def parse(text: str, kind: str):
    """A shape from its text (``kind`` "forward": CHUNKxWARPSxRESIDENTxGRID; "backward":
    SLICExWARPSxRESIDENT[xLAG]). Raises ValueError naming what it expected."""
    form = ("CHUNKxWARPSxRESIDENTxGRID[xSTAGES]" if kind == "forward"
            else "SLICExWARPSxRESIDENT[xLAG]")
    parts = text.strip().lower().split("x")
    want = (4, 5) if kind == "forward" else (3, 4)
    try:
        if len(parts) not in want:
            raise ValueError
        if kind == "forward" and parts[3] == "m":
            parts[3] = "0"
        values = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"--{kind}: expected {form}, e.g. "
                         f"{FORWARD[0] if kind == 'forward' else BACKWARD[0]}, got {text!r}") from None
    size, warps, resident = values[:3]
    if size < 256 or size & (size - 1):
        raise ValueError(f"--{kind}: the bytes a step, a power of two of at least 256, got {size} "
                         f"in {text!r}")
    if warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"--{kind}: warps, a power of two from 1 to 32, got {warps} in {text!r}")
    if not 1 <= resident <= 64 // warps or _cap(warps, resident) < 32:
        raise ValueError(f"--{kind}: {resident} programs of {warps} warps resident leave "
                         f"{_cap(warps, resident)} registers a thread (at least 32; at most "
                         f"64 warps an SM), in {text!r}")
    if kind == "forward":
        if values[3] < 0:
            raise ValueError(f"--forward: the grid, M or programs per SM, got {parts[3]} in "
                             f"{text!r}")
        if len(values) == 5 and not 1 <= values[4] <= 4:
            raise ValueError(f"--forward: STAGES, 1 to 4, got {values[4]} in {text!r}")
        return LoopShape(*values)
    if len(values) == 4 and values[3] not in (0, 1):
        raise ValueError(f"--backward: LAG, 0 or 1, got {values[3]} in {text!r}")
    return CoopShape(*values)


_LOOP = ("LOOP_CHUNK_BYTES", "LOOP_WIDE_CHUNK_BYTES", "LOOP_WIDE_FROM", "LOOP_PER_SM",
         "LOOP_WARPS", "LOOP_MAXNREG", "LOOP_STAGES")
_COOP = ("COOP_BYTES", "COOP_WARPS", "COOP_MAXNREG", "EXCHANGE_LAG")


@contextlib.contextmanager
def using(loop: LoopShape | None = None, coop: CoopShape | None = None):
    """Plans made with the wide forward in ``loop``'s shape and the sharing backward in
    ``coop``'s (None: as in force) for the duration, the plans cached before and after
    forgotten (kernels kept by launch are kept by their flags: another shape is another key)."""
    from normbook.kernels import _config, _take

    saved = {name: getattr(_config, name) for name in _LOOP + _COOP}
    caches = (_config.forward_plan, _config.forward_config, _config.backward_plan,
              _config.backward_config, _take._fits)
    if loop is not None:
        _config.LOOP_CHUNK_BYTES = _config.LOOP_WIDE_CHUNK_BYTES = loop.chunk_bytes
        # a grid of M everywhere, or per SM everywhere: the switch between them moved past D
        _config.LOOP_WIDE_FROM = 1 << 62 if loop.grid == 0 else 0
        _config.LOOP_PER_SM = loop.grid or _config.LOOP_PER_SM
        _config.LOOP_WARPS, _config.LOOP_MAXNREG = loop.warps, loop.maxnreg
        _config.LOOP_STAGES = loop.stages
    if coop is not None:
        _config.COOP_BYTES, _config.COOP_WARPS = coop.slice_bytes, coop.warps
        _config.COOP_MAXNREG, _config.EXCHANGE_LAG = coop.maxnreg, coop.lag
    for cached in caches:
        cached.cache_clear()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(_config, name, value)
        for cached in caches:
            cached.cache_clear()


def in_force(plan, M: int, sms: int, itemsize: int):
    """The shape of a wide plan as it stands (a forward's loop or a backward's shared rows),
    in the notation above: what a candidate is measured against."""
    warps, maxnreg = plan.options["num_warps"], plan.options["maxnreg"]
    resident = max(1, REGISTERS // (32 * warps * maxnreg))
    size = plan.constexprs["BLOCK_D"] * itemsize
    if plan.kernel == "norm_fwd_loop_kernel":
        grid = plan.grid[0]
        return LoopShape(size, warps, resident, 0 if grid == M or not sms else grid // sms,
                         plan.constexprs.get("STAGES", 1))
    return CoopShape(size, warps, resident, plan.constexprs.get("LAG", 0))


_OPS = {"layer_norm": (False, False), "rms_norm": (True, False),
        "add_layer_norm": (False, True), "add_rms_norm": (True, True)}


class _Case:
    """One op's tensors at (M, D), bf16, and its forward and backward calls on the plans in
    force at the time of the call."""

    def __init__(self, op: str, M: int, D: int, device: str):
        self.op = op
        self.is_rms, self.add = _OPS[op]
        g = torch.Generator(device=device).manual_seed(M * 3 + D)
        shape = (M, D)

        def new(*size):
            return torch.randn(*size, generator=g, device=device, dtype=torch.bfloat16)

        self.x, self.dy = new(*shape), new(*shape)
        self.r = new(*shape) if self.add else None
        self.dh = new(*shape) if self.add else None
        self.w = new(D)
        self.b = None if self.is_rms else new(D)
        y, h, self.stats = self.forward()
        self.h = h if self.add else self.x      # what the backward normalizes

    def forward(self):
        from normbook.kernels import _forward
        return _forward.norm_forward(self.x, self.r, self.w, self.b, 1e-5, self.is_rms)

    def backward(self):
        from normbook.kernels import _backward
        return _backward.norm_backward(self.dy, self.dh, self.h, self.w, self.stats,
                                       None if self.is_rms else torch.bfloat16, self.is_rms)

    def plan(self, mode: str, index):
        from normbook.kernels import _config
        e = self.x.element_size()
        if mode == "fwd":
            return _config.forward_plan(*self.x.shape, index, e, self.is_rms, self.add, True,
                                        not self.is_rms, 0)[0]
        plans = _config.backward_plan(*self.x.shape, index, e, self.is_rms, self.add, True,
                                      not self.is_rms, 0, True)
        return None if plans is None else plans[0]


def _outputs(out) -> list:
    """The tensors a call returned (y, h, stats; dx, dweight, dbias), None dropped."""
    return [t for t in out if t is not None]


ROUNDING = 2.0 ** -6     # max_diff of a match: 4 bf16 ulps of an output's largest value (a
                         # reordered fp32 sum moves a bf16 y or dweight by an ulp or so)


def _max_diff(got: list, want: list, rows: int = 256) -> float:
    """The largest |got - want| over the tensors, each relative to that output's largest
    |want| (y, dx and dweight differ in scale; an output of zeros: absolute), in fp32,
    ``rows`` rows at a time (at D = 131072 a whole (M, D) difference in fp32 would take
    17 GB); a NaN counts as infinite."""
    worst = 0.0
    for a, b in zip(got, want):
        lead = a.shape[0] if a.dim() > 1 else 1          # rows, or one for a (D,) vector
        a, b = a.reshape(lead, -1), b.reshape(lead, -1)
        diff = scale = 0.0
        for i in range(0, lead, rows):
            d = (a[i:i + rows].float() - b[i:i + rows].float()).abs()
            diff = max(diff, torch.nan_to_num(d, nan=float("inf")).max().item())
            scale = max(scale, b[i:i + rows].float().abs().max().item())
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


_compiles: dict = {}


def _compiled(plan, D: int, arch: int) -> dict:
    """Registers and spill bytes of a plan's kernel compiled for sm_<arch> (bf16), once per
    kernel, flags and D's alignment (D is otherwise a runtime argument)."""
    from normbook.kernels import report
    key = (plan.kernel, plan.key, D % 16 == 0, arch)
    if key not in _compiles:
        out = report.compile_one(report.kernel_of(plan), plan.constexprs, plan.options, "bf16",
                                 arch, D, serial=False)
        _compiles[key] = dict(registers=out["registers"], spill_bytes=out["spill_bytes"],
                              shared_bytes=out["shared_bytes"])
    return _compiles[key]


def _shape_row(case, mode, M, D, shape, device, index, sms, copy_gbps, reference, arch,
               time_it: bool, seen: set) -> dict:
    """One row: ``shape`` None is the shape in force (its outputs are ``reference``); (None,
    None) for a candidate that plans as a shape in ``seen``, the shapes planned so far (the
    device clamps it, or M leaves its grid a row a program): nothing new to time."""
    from normbook.bench import bytemodel
    from normbook.bench.model import programs_per_sm
    from normbook.bench.timing import timed

    from normbook.kernels import _backward

    loop = shape if isinstance(shape, LoopShape) else None
    coop = shape if isinstance(shape, CoopShape) else None
    # a candidate the driver refuses to launch cooperatively is launched plainly (and timed so,
    # said in its row); the refusal, for good in a process, must not reach the other rows
    refused = _backward._cooperation_refused
    with using(loop, coop), _restored(_backward, "_cooperation_refused"):
        call = case.forward if mode == "fwd" else case.backward
        row: dict = {}
        plan = case.plan(mode, index)
        if plan is None:
            raise ValueError(f"no plan: {shape} gives more slices a row than the device runs "
                             "at once")
        # the shape as planned on this device for these rows, which may not be the one asked
        planned = str(in_force(plan, M, sms, case.x.element_size()))
        if planned in seen:
            return None, None
        seen.add(planned)
        row.update(shape=planned, in_force=shape is None)
        if shape is not None and str(shape) != planned:
            row["asked"] = str(shape)
        if time_it:
            out = _outputs(call())     # compiled, measured: the plan's final grid
            # None for a candidate with no reference (the shape in force's row failed): a
            # 0 would claim a match that nothing was compared with
            row["max_diff"] = (0.0 if shape is None else None if reference is None
                               else _max_diff(out, reference))
        plan = case.plan(mode, index)          # (after a GPU's first launch: measured)
        row.update(programs=plan.grid[0], per_sm=plan.per_sm)
        if arch:
            row.update(_compiled(plan, D, arch))
            # programs an SM holds by the compiled kernel's registers, warps and shared
            # memory (a plan's own figure goes by registers alone where nothing measured it)
            row["per_sm"] = programs_per_sm(row["registers"], plan.options["num_warps"],
                                            row["shared_bytes"])
        if time_it:
            # CUDA graph replays, or do_bench where a graph cannot hold the call (said in
            # the row: compare a candidate with the shape in force under one timer)
            t = timed(call, device, 10, 50)
            ms = t.ms
            row["timer"] = t.timer
            notes = [t.note] if t.note else []
            if _backward._cooperation_refused and not refused:
                notes.append("the driver refused the cooperative launch: timed without it")
            if notes:
                row["note"] = "; ".join(notes)
            gbps = bytemodel.bytes_moved(case.op, mode, M, D, "bf16") / (ms * 1e-3) / 1e9
            row.update(us=ms * 1e3, gbps=gbps,
                       frac_copy=gbps / copy_gbps if copy_gbps else None)
        return row, (out if time_it and shape is None else None)


@contextlib.contextmanager
def _restored(owner, name: str):
    """``owner.name`` as it was before, after the block."""
    was = getattr(owner, name)
    try:
        yield
    finally:
        setattr(owner, name, was)


def _line(r: dict) -> str:
    head = f"{r['op']:14s} {r['mode']} D {r['D']:6d} M {r['M']:6d}"
    if "error" in r:
        return f"{head}  {r.get('shape', '?')}: {r['error']}"
    regs = (f", {r['registers']} regs, {r['spill_bytes']} B spilled, "
            f"{r['shared_bytes'] >> 10} KB shared" if "registers" in r else "")
    if r.get("shared_bytes", 0) > SHARED_SM86:   # (the plans are the same on every GPU)
        regs += ", more than sm_86 and sm_89 give a program: not for every GPU as it is"
    times = (f"  {r['us']:9.1f} us" + (   # (GB/s only where a copy was timed: a GPU)
        f" {r['gbps']:7.1f} GB/s ({r['frac_copy']:.2f} of copy)" if r.get("frac_copy") else "")
        + (f", max diff {r['max_diff']:.3g}" + (" (DIFFERS)" if r["max_diff"] > ROUNDING
                                                 else "") if r["max_diff"] is not None
           else ", no max diff (the shape in force failed)")) if "us" in r else ""
    asked = f" (asked {r['asked']})" if "asked" in r else ""
    return (f"{head}  {r['shape']:>14s}{' (in force)' if r['in_force'] else '           '}{asked}"
            f"{times}  {r['programs']} programs, {r['per_sm']} per SM{regs}"
            + (f"  ({r['note']})" if "note" in r else ""))


def best(rows: list[dict]) -> list[dict]:
    """Per (op, mode, D): the fastest shape timed whose outputs match the shape in force's
    (``max_diff`` within ROUNDING), its microseconds, the shape in force's."""
    out, groups = [], {}
    for r in rows:   # (a candidate that gives another answer is no candidate: see ROUNDING)
        if "us" in r and (r["in_force"] or (r.get("max_diff") is not None
                                            and r["max_diff"] <= ROUNDING)):
            groups.setdefault((r["op"], r["mode"], r["D"]), []).append(r)
    for (op, mode, D), found in groups.items():
        top = min(found, key=lambda r: r["us"])
        now = next((r for r in found if r["in_force"]), None)
        out.append(dict(op=op, mode=mode, D=D, shape=top["shape"], us=top["us"],
                        frac_copy=top.get("frac_copy"), timer=top.get("timer"),
                        in_force_timer=None if now is None else now.get("timer"),
                        in_force_us=None if now is None else now["us"],
                        speedup=None if now is None else now["us"] / top["us"]))
    return out


def measure(ops, modes, dims, rows, forward, backward, device: str, arch: int = 0,
            time_budget: float = 0, copy_gbps: float | None = None, out=None,
            done=None) -> list[dict]:
    """The rows (see the module docstring), appended to ``out`` one by one (``done`` called
    after each: the JSON written again). ``device`` "cuda", "cpu" (Triton's interpreter) or
    "none" (``--compile-only``: plans for an H200, compiled, nothing run); ``arch``: compile
    each plan for sm_<arch> too (0: do not); ``time_budget``: seconds, after which no new
    (op, mode, D, M) is started (0: none); ``copy_gbps``: the copy's bandwidth, for the
    fractions (None: none given)."""
    from normbook.kernels._config import Device

    out = [] if out is None else out
    start = time.monotonic()
    time_it = device != "none"
    if device == "cuda":
        index = torch.cuda.current_device()
        sms = torch.cuda.get_device_properties(index).multi_processor_count
    elif device == "cpu":
        index, sms = -1, 0
    else:
        index, sms = Device(arch or 90, H200["sms"]), H200["sms"]
    spent = f"not measured: time budget of {time_budget:g} s spent"

    def late() -> bool:
        return bool(time_budget) and time.monotonic() - start > time_budget

    for op in ops:
        for mode in modes:
            for D in dims:
                for M in rows:
                    if late():
                        out.append(dict(op=op, mode=mode, D=D, M=M, error=spent))
                        print(_line(out[-1]), flush=True)
                        continue
                    _measure_group(out, done, op, mode, D, M, forward, backward, device,
                                   index, sms, copy_gbps, arch, time_it, late, spent)
    return out


def _measure_group(out, done, op, mode, D, M, forward, backward, device, index, sms,
                   copy_gbps, arch, time_it, late=lambda: False, spent=""):
    """Every shape of one (op, mode, D, M), the shape in force first; once ``late()``, the
    rest recorded with the error ``spent``."""
    try:
        case = _Case(op, M, D, device) if time_it else _Plans(op, M, D)
    except Exception as e:  # noqa: BLE001 - one shape's failure (OOM) must not lose the rest
        out.append(dict(op=op, mode=mode, D=D, M=M, error=f"{type(e).__name__}: {e}"))
        print(_line(out[-1]), flush=True)
        return
    reference, seen = None, set()             # the shapes planned so far
    for shape in (None, *(forward if mode == "fwd" else backward)):
        row = dict(op=op, mode=mode, D=D, M=M)
        if shape is not None and late():
            out.append(dict(row, shape=str(shape), in_force=False, error=spent))
            print(_line(out[-1]), flush=True)
            continue
        try:
            found, outputs = _shape_row(case, mode, M, D, shape, device, index, sms, copy_gbps,
                                        reference, arch, time_it, seen)
            if found is None:
                print(f"{op:14s} {mode} D {D:6d} M {M:6d}  {shape}: planned here as a shape "
                      "timed already", flush=True)
                continue
            row.update(found)
            if shape is None:
                reference = outputs
        except Exception as e:  # noqa: BLE001
            row.update(shape=str(shape) if shape is not None else "in force", in_force=False,
                       error=f"{type(e).__name__}: {e}")
        out.append(row)
        print(_line(row), flush=True)
        if done is not None:
            done()
    if time_it:
        del case
        if device == "cuda":
            torch.cuda.empty_cache()


class _Plans(_Case):
    """A case with no tensors, for ``--compile-only``: the plans alone."""

    def __init__(self, op: str, M: int, D: int):
        self.op = op
        self.is_rms, self.add = _OPS[op]
        self.x = torch.empty(M, D, dtype=torch.bfloat16, device="meta")


def main(argv=None) -> int:
    """``normbook-bench shapes``; 0. A refusal raises (printed by :mod:`normbook.bench.cli`)."""
    import argparse

    from normbook.bench.cli import PROG, BenchError, Parser, _sizes, add_json_out, json_out

    p = Parser(prog=f"{PROG} shapes", description=DESCRIPTION, epilog=EXAMPLES,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_json_out(p, "the rows")
    p.add_argument("--dims", default="32768,65536,131072", help="D, comma-separated")
    p.add_argument("--rows", default="32768", help="M, comma-separated")
    p.add_argument("--ops", default="layer_norm",
                   help=f"comma-separated, of {', '.join(_OPS)}")
    p.add_argument("--modes", default="fwd,bwd", help="fwd, bwd or both")
    p.add_argument("--forward", default=",".join(FORWARD),
                   help="forward shapes CHUNKxWARPSxRESIDENTxGRID[xSTAGES], comma-separated")
    p.add_argument("--backward", default=",".join(BACKWARD),
                   help="backward shapes SLICExWARPSxRESIDENT[xLAG], comma-separated")
    p.add_argument("--time-budget", type=float, default=0,
                   help="seconds after which no new shape starts (0: none)")
    p.add_argument("--compile-only", action="store_true",
                   help="registers and spills of each candidate compiled for sm_90, nothing "
                        "run (no GPU needed; Triton's interpreter off)")
    args = p.parse_args(argv)
    dims, rows = _sizes(p, "--dims", args.dims), _sizes(p, "--rows", args.rows)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for o in ops:
        if o not in _OPS:
            p.error(f"--ops: expected some of {', '.join(_OPS)}, got {o!r}")
    for m in modes:
        if m not in ("fwd", "bwd"):
            p.error(f"--modes: expected fwd, bwd or both, got {m!r}")
    try:
        forward = [parse(s, "forward") for s in args.forward.split(",") if s.strip()]
        backward = [parse(s, "backward") for s in args.backward.split(",") if s.strip()]
    except ValueError as e:
        p.error(str(e))
    json_out(args)
    try:
        import triton
        from normbook.kernels import _config
    except ImportError as e:
        raise BenchError(f"the kernels it times cannot be imported: {e}") from None
    narrow = [D for D in dims if D <= _config.MAX_FUSED_D_FWD]
    if narrow:
        raise BenchError(f"--dims: wide rows, past {_config.MAX_FUSED_D_FWD} values (the "
                         f"forward's loop and the backward's shared rows), got {narrow}")
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    arch = 0
    if args.compile_only:
        if interpreted:
            raise BenchError("--compile-only compiles for sm_90: unset TRITON_INTERPRET")
        device, arch = "none", 90
    elif torch.cuda.is_available() and not interpreted:
        device = "cuda"
        major, minor = torch.cuda.get_device_capability()
        arch = 10 * major + minor
    elif interpreted:
        device = "cpu"
    else:
        raise BenchError("no CUDA device: set TRITON_INTERPRET=1 to run it in Triton's "
                         "interpreter (which says only that it runs), or --compile-only")
    found: list = []
    record = {"rows": found, "best": [], "copy_gbps": None,
              "device": (torch.cuda.get_device_name() if device == "cuda" else
                         "cpu (Triton's interpreter)" if device == "cpu" else
                         "none (compiled for sm_90 only)"),
              "torch": torch.__version__, "triton": triton.__version__,
              "forward": [str(s) for s in forward], "backward": [str(s) for s in backward]}

    def write():
        """The JSON so far, after every row, replaced whole (written beside it, renamed)."""
        record["best"] = best(found)
        if args.json:
            part = f"{args.json}.part"
            with open(part, "w") as f:
                json.dump(record, f, indent=1)
            os.replace(part, args.json)

    if device == "cuda":
        from normbook.bench.timing import copy_bandwidth
        record["copy_gbps"] = copy_bandwidth(device, warmup_ms=200)["gbps"]
        print(f"copy bandwidth: {record['copy_gbps']:.1f} GB/s", flush=True)
    measure(ops, modes, dims, rows, forward, backward, device, arch, args.time_budget,
            record["copy_gbps"], out=found, done=write)
    write()
    for b in record["best"] if device == "cuda" else ():   # (the interpreter's times: no speed)
        gain = "" if b["speedup"] is None else f", {b['speedup']:.2f}x the shape in force"
        print(f"fastest: {b['op']} {b['mode']} D {b['D']}: {b['shape']} {b['us']:.1f} us{gain}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
