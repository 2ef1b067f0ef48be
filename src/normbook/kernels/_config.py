"""From (M, D, dtype, device) to a plan: which kernel runs, on what grid, with which
compile-time flags. A :class:`Plan` is one launch as data; :func:`forward_plan` and
:func:`backward_plan` build them (cached: a launch computes nothing), the launchers run them,
and ``python -m normbook.kernels.report`` compiles them and counts their bytes, so the
decision exists once. Read those two functions first; the rest of the file is what they call.

On a GPU (BLOCK_D = next_power_of_2(D); bf16 figures):

=========  ===============  ======================  =====================================
direction  D                kernel                  grid, shape
=========  ===============  ======================  =====================================
forward    BLOCK_D < 4096   norm_fwd_rows_kernel    persistent: tiles of ROWS short rows,
                                                    ELEMS_FWD values a thread, pipelined
forward    4096 .. 16384    norm_fwd_rows_kernel    M programs, a row each, ROW_ELEMS
           (ROW_FROM ..)                            values a thread, not pipelined
forward    > 16384          norm_fwd_loop_kernel    M programs (LOOP_PER_SM per SM past
                                                    32768), two sweeps of chunks
backward   <= 8192          norm_bwd_rows_kernel    persistent, ROWS rows a tile, pipelined,
                                                    ELEMS_BWD values a thread
backward   > 8192           norm_bwd_coop_kernel    groups of S programs sharing a row, a
                                                    slice of COOP_BYTES each, cooperative
=========  ===============  ======================  =====================================

The backward adds ``norm_bwd_finish_kernel`` when several programs kept partial sums of
dweight and dbias (one program of at most ONE_PROGRAM_ROWS rows writes them itself). Each
shape names the measurement it rests on beside its constants. Triton's interpreter (device
-1) runs the rows kernels on CPU_PROGRAMS programs and shares rows among up to CPU_SLICES.

D and the row strides are runtime arguments, so a new D seldom recompiles: the constexprs are
the flags (IS_RMS, HAS_*), the block shape, bucketed by BLOCK_D, ROWS, NUM_STAGES and VEC, the
alignment D and the strides share (:func:`vec`). Triton's JIT also specializes on D % 16 == 0
and on 16-byte-aligned pointers and strides: that lets the loads be 128 bits wide.

Rows whose backward has more slices than the device runs at once, and every row wider than
MAX_FUSED_D_BWD when NORMBOOK_SHARED_ROWS is off, have no backward plan: ``_take`` says which
rows the kernels take, and the front door sends the rest to the torch-ops backend. On a GPU a
plan's grid first assumes the programs per SM its block shape allows
(:func:`resident_per_sm`); its first launch measures the compiled kernel
(``_launch.measure``), and the plans are rebuilt with that.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple, Optional

import torch

from normbook.bench.model import H200 as _H200


# the forward ------------------------------------------------------------------------------------

MAX_FUSED_D_FWD = 16384   # widest row the forward holds in registers: 32 values per thread (64
                          # fp32 with the add: x and r), 16 warps; twice that needs 32 warps, a
                          # program with no registers left to pipeline (see the appendix)
ELEMS_FWD = 32            # values per thread of the tiles of several short rows: four
                          # 128-bit loads of bf16; 4 warps for a 4096-value tile
TILE_ELEMS = 4096         # target elements per tile when several small rows share one
MAX_ROWS = 32             # at most this many rows per tile
MIN_BLOCK_D = 16          # narrower blocks only waste the 128-bit loads
MAX_STAGES = 4            # rows kernels: up to three tiles' loads in flight ahead
SMEM_PER_PROGRAM = 64 * 1024   # shared memory for pipelined tiles: two programs fit on sm_80 too
# A row of a tile of its own (BLOCK_D >= TILE_ELEMS): one program a row, grid M, no pipeline,
# ROW_ELEMS values a thread up to ROW_MAX_WARPS warps: Liger's RMSNorm forward, which measured
# 0.94-0.98 of copy at D = 4096..16384 (bf16, M = 32768) on the H200 where the persistent,
# pipelined rows kernel (32 values a thread, 4-16 warps) measured 0.88-0.91, and its fused add
# 0.95-0.97 against 0.91-0.93; Liger's LayerNorm in fp32 0.97 and 0.93 at D = 4096 and 16384
# against 0.91 and 0.91 (benchmarks/results/2026-12-04-h200/summary.txt). Not measured as
# normbook's kernel yet: the next GPU run's bench step is its measurement.
ROW_ELEMS = 16
ROW_MAX_WARPS = 16
ROW_MIN_WARPS = 4         # Liger's fewest (8 values a thread at D = 1024)
ROW_FROM = TILE_ELEMS     # on a GPU, a row a program from this BLOCK_D on; narrower rows
                          # share tiles. Rows of 1024 and 2048 were not measured as a program
                          # each (Liger's shape there): `normbook-bench plans` times both
# The wide forward (norm_fwd_loop_kernel): one program a row, two sweeps of chunks. Its shape is
# the best of a probe on the H200 (benchmarks/results/2026-12-04-h200/README.md, the last table:
# a plain two-pass forward, bf16, BLOCK 2048-8192, 8-16 warps, grid M or 1-8 programs per SM):
# 0.888 of copy at D = 32768 with chunks of 4096 and grid M, 0.751 at 65536 and 0.659 at 131072
# with chunks of 8192 and 8 programs per SM, where the kernel that shared a row measured 0.671,
# 0.634 and 0.585. Untried: the residual add, fp32 (chunks of the same bytes: half the values,
# which Triton 3.6 compiles for sm_90 without spilling at D = 65536, where a chunk of 8192 fp32
# values spilled), rows between 16384 and 32768.
LOOP_CHUNK_BYTES = 8192   # a chunk, up to D = LOOP_WIDE_FROM: 4096 bf16 values
LOOP_WIDE_CHUNK_BYTES = 16384  # a chunk of wider rows: 8192 bf16 values
LOOP_WIDE_FROM = 32768    # rows wider than this: LOOP_PER_SM programs per SM loop over them;
LOOP_PER_SM = 8           # up to it, one program per row (grid M)
LOOP_WARPS = 16
LOOP_MAXNREG = 64         # two programs of 16 warps per SM: half the register file each
LOOP_STAGES = 1           # chunks of a sweep in flight per program: 1, none ahead (as in the
                          # probe); 2-4 pipeline the sweeps' loads (async copies, the rows
                          # kernels' way: 16-147 KB of shared memory). Not measured yet: the
                          # GPU check's `shapes` step times them


# the backward -----------------------------------------------------------------------------------

MAX_FUSED_D_BWD = 8192    # backward holds x, dy, dweight and dbias partials: 32 per thread
ELEMS_BWD = 32            # values per thread in the backward: 4 warps (8 at D = 8192), so two
                          # programs (one) share an SM and each pipelines its loads
# The backward of at most ONE_PROGRAM_ROWS rows runs as one program, which
# writes dweight and dbias itself: one launch, no partials, no finish. The H200 (2026-12-04,
# ../shared/measured: M = 4, D = 4096, bf16, 257 us forward+backward against torch's 102 us)
# showed small batches bound by host time, a launch and an allocation each; one program's
# serial rows cost device time that the host time hides there. An estimate, not measured:
# the GPU check's `plans` step times both plans.
ONE_PROGRAM_ROWS = 8
COOP_BYTES = 8192         # slice of x per program of the wide-row backward: 4096 bf16 or 2048
                          # fp32 values; its x and dy for the next row (16 KB) are in flight
                          # while it waits for the row's sums, two programs per SM: 32 KB
COOP_WARPS = 8            # 256 threads, 16 values each (bf16 on sm_90): about 123 registers
COOP_MAXNREG = 128        # half the register file, so that two programs are resident
COOP_VALUES_SM80 = 8      # before Hopper, values a thread of it holds: ptxas for sm_80 needs
                          # more registers for 16 and would spill (python -m normbook.kernels.report)
EXCHANGE_POLLS = 1 << 16  # bound of a wait for the other slices of a row: about 50 ms of
                          # L2 reads, far past the programs' skew under a cooperative launch
RING = 2                  # rows of a group whose slots are kept at once: one being read, the
                          # next being published (the interpreter keeps all of a group's rows);
                          # 2 + 2 EXCHANGE_LAG (see the kernel's LAG)
EXCHANGE_LAG = 0          # rows a program of the sharing backward publishes ahead of the one it
                          # waits for: 1 overlaps the exchange with the next row's loads and
                          # sums (issue 46), bitwise the same dx. Not measured yet: the GPU
                          # check's `shapes` step times it (8192x8x2x1) against 0
CPU_SLICES = 64           # the interpreter shares a row among up to this many slices (it runs
                          # them one by one: the first program of a row computes every slot)
CPU_POLLS = 0             # the interpreter's bound of a wait: no read (a program computes and
                          # publishes a slot still empty itself)
WEIGHT_ONCE_FROM = (3, 9)  # from this Triton on the sharing backward holds its weight slice
                          # through its loop unspilled (see weight_loads)
FINISH_BLOCK_D = 64       # the finish kernel sums (32, 64) fp32 tiles of partials, 8 KB per
FINISH_BLOCK_P = 32       # program: narrow column blocks, so D / 64 programs share the reduction
FINISH_WARPS = 4


# the hardware, the interpreter ------------------------------------------------------------------

MAX_WARPS = 32            # 1024 threads, the most a program can have
MAX_REGISTERS = _H200["thread_registers"]   # the most registers a thread can have (255:
                                            # sm_80, sm_90)
CPU_PROGRAMS = 4          # persistent grid size in the interpreter (any fixed number is deterministic)


# a launch as data -------------------------------------------------------------------------------

class Config(NamedTuple):
    """One block shape. BLOCK_D and ROWS are constexpr; everything else is a runtime argument.
    (A NamedTuple: it hashes in C, and the plan caches below hash it.)"""

    BLOCK_D: int    # columns per block: next_power_of_2(D), or a slice's width when SLICES
    ROWS: int       # rows per tile, one step of a program's row loop (1 for slices)
    num_warps: int
    maxnreg: int    # register cap: the whole register file for one program (see below)
    SLICES: int = 0  # rows shared by S programs: next_power_of_2(S); 0 for whole rows

    def launch(self) -> dict:
        """Launch options. ``maxnreg`` stops ptxas from squeezing a kernel that needs, say,
        34 registers into 32 for occupancy by spilling: it takes what it needs up to the cap.
        ``enable_fp_fusion``: multiply-adds fused, as every kernel was compiled, measured and
        reported so far; Triton 3.9 warns at each compile that its default, which it is
        today, changes in 3.10 (TRITON_FORCE_DISABLE_FP_FUSION still turns it off)."""
        return dict(num_warps=self.num_warps, maxnreg=self.maxnreg, enable_fp_fusion=True)


class Device(NamedTuple):
    """What a plan needs to know of a device: its compute capability as 80, 90, ... and its
    streaming multiprocessors, 0 for Triton's interpreter (which runs a launch's programs one
    by one on the CPU). The compile report plans for the model's H200 with one."""

    arch: int
    sms: int


class Plan(NamedTuple):
    """One launch, as data: what the launcher runs and what the compile report compiles and
    counts the traffic of. S = ``slices`` programs share each row (1: whole rows, ``rows`` of
    them per step of a program's loop); ``groups`` persistent groups of S programs each keep
    one (D,) row of fp32 partials (the backward). The counts say what one row of the problem
    moves: row-sized tensors read and written, fp32 statistics, (D,) parameter vectors and
    fp32 partial rows for the whole launch, and ``ahead``, the row-sized tensors whose next
    tile is loaded while a program works on (or, sharing a row, waits for) the current one."""

    kernel: str          # the @triton.jit function's name in _forward or _backward
    grid: tuple          # (groups x slices,) programs
    constexprs: dict     # compile-time arguments (do not mutate: the plan is cached)
    options: dict        # launch options: num_warps, maxnreg, launch_cooperative_grid
    flags: dict          # constexprs and options together: the launch's keywords
    slices: int          # S = cdiv(D, BLOCK_D) programs per row; 1: whole rows
    groups: int          # persistent programs (of S slices each)
    rows: int            # ROWS: rows per step of a program's loop
    per_sm: int          # programs per SM the grid assumes resident (the report checks it)
    reads: int           # row-sized tensors read, per row
    writes: int          # row-sized tensors written, per row
    stats: int           # fp32 statistics per row, read or written
    params: int          # (D,) parameter vectors read (the finish: written)
    partials: int        # (D,) fp32 rows of partials, in all: written (the finish: read)
    ahead: int           # row-sized tensors of a tile in flight ahead of the arithmetic
    elem_bytes: int      # bytes of one value of those tensors
    measured: bool = True  # per_sm is the compiled kernel's (or nothing to measure: the
                           # interpreter); False: the launcher measures it at its first launch
    simple: bool = False   # the launchers' common case, one test: whole rows (S = 1), measured,
                           # and (the backward) no finish after it
    key: int = -1          # the launch (kernel, flags) as one small int, the same for equal
    slot_words: int = 0    # int64 words of the slot buffer a sharing launch uses: each
                           # group's ring (RING rows of 2 words a slice), then one word a
                           # program (where its warps agree on the first row they left for)


# the two plans: read these first ----------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def forward_plan(M: int, D: int, device_index, itemsize: int, is_rms: bool,
                 has_residual: bool, has_weight: bool, has_bias: bool,
                 strides: int = 0, round_xhat: bool = False) -> tuple[Plan]:
    """The forward's launch, one :class:`Plan`, on a device (Tensor.get_device(): -1 for the
    interpreter; or a :class:`Device`), cached: a launch computes and builds nothing. Rows of
    any length have one. ``strides``: the low four bits of the row strides ORed (see
    :func:`vec`). ``round_xhat``: see :func:`_rounding`."""
    dev = device(device_index)
    cfg = forward_config(M, D, itemsize)
    flags = dict(IS_RMS=is_rms, HAS_RESIDUAL=has_residual, HAS_WEIGHT=has_weight,
                 HAS_BIAS=has_bias, VEC=vec(D, itemsize, strides),
                 **_rounding(round_xhat, D, MAX_FUSED_D_FWD))
    inputs = 2 if has_residual else 1                  # x (and the residual) in, y (and h) out
    counts = dict(reads=inputs, writes=inputs, stats=1 if is_rms else 2,
                  params=int(has_weight) + int(has_bias), partials=0, ahead=inputs,
                  elem_bytes=itemsize)
    if D > MAX_FUSED_D_FWD:
        # two sweeps of chunks: one program a row up to LOOP_WIDE_FROM, else LOOP_PER_SM per SM
        # looping over the rows; CPU_PROGRAMS in the interpreter. The grid depends on the
        # device alone: nothing to measure
        programs = M if D <= LOOP_WIDE_FROM else LOOP_PER_SM * dev.sms
        grid = max(1, min(M, programs if dev.sms else CPU_PROGRAMS))
        return (_plan("norm_fwd_loop_kernel", grid,
                      dict(flags, BLOCK_D=cfg.BLOCK_D, STAGES=LOOP_STAGES), cfg, **counts),)
    if cfg.BLOCK_D >= ROW_FROM and dev.sms:
        # a row a program on a GPU, its loads not pipelined (see ROW_ELEMS)
        constexprs = dict(flags, ROWS=1, BLOCK_D=cfg.BLOCK_D, NUM_STAGES=1)
        return (_plan("norm_fwd_rows_kernel", M, constexprs, cfg, **counts),)
    return (_persistent("norm_fwd_rows_kernel", M, cfg, dev, device_index, flags, **counts),)


@functools.lru_cache(maxsize=4096)
def backward_plan(M: int, D: int, device_index, itemsize: int, is_rms: bool, has_dh: bool,
                  has_weight: bool, has_bias: bool, strides: int = 0,
                  shared: bool = True, round_xhat: bool = False) -> Optional[tuple[Plan, ...]]:
    """The backward's launches on a device, cached as :func:`forward_plan`: the kernel, then,
    when several groups kept partials of dweight or dbias, the finish that sums them. None
    when no plan takes the rows: wider than MAX_FUSED_D_BWD with ``shared`` False, or with
    more slices than the device runs at once. ``round_xhat``: see :func:`_rounding`."""
    dev = device(device_index)
    cfg = backward_config(M, D, narrow_loads(D, itemsize, strides), itemsize, dev.arch)
    flags = dict(IS_RMS=is_rms, HAS_DH=has_dh, HAS_WEIGHT=has_weight, HAS_BIAS=has_bias,
                 VEC=vec(D, itemsize, strides), **_rounding(round_xhat, D, MAX_FUSED_D_BWD))
    n_par = int(has_weight) + int(has_bias)
    counts = dict(reads=2 + has_dh, writes=1, stats=1 if is_rms else 2, params=int(has_weight),
                  partials=0, elem_bytes=itemsize)
    if not cfg.SLICES:
        main = _persistent("norm_bwd_rows_kernel", M, cfg, dev, device_index, flags,
                           ahead=2 + has_dh, **counts)
        if M <= ONE_PROGRAM_ROWS and n_par and main.groups > 1:
            main = main._replace(grid=(1,), groups=1)       # one launch for a few rows
    elif not shared:
        return None
    else:   # the next row's x and dy are in flight while a program waits (dh comes after)
        main = _shared("norm_bwd_coop_kernel", M, D, cfg, dev, device_index,
                       dict(flags, WEIGHT_LOADS=weight_loads(has_dh), LAG=EXCHANGE_LAG),
                       ahead=2, **counts)
        if main is None:
            return None
    if main.groups == 1 or not n_par:      # one group writes dweight and dbias itself
        return (main,)
    main = main._replace(partials=main.groups * n_par, simple=False)
    return main, finish_plan(D, has_weight, has_bias, main.groups)


def finish_plan(D: int, has_weight: bool, has_bias: bool, groups: int,
                block_d: Optional[int] = None) -> Plan:
    """(groups, D) fp32 partials summed in a fixed order into dweight and dbias: column blocks
    of FINISH_BLOCK_D (or ``block_d``: the same sums, in the same order), FINISH_BLOCK_P
    partial rows a step."""
    block_d = block_d or FINISH_BLOCK_D
    cfg = Config(block_d, FINISH_BLOCK_P, FINISH_WARPS, maxnreg_for(FINISH_WARPS))
    n_par = int(has_weight) + int(has_bias)
    constexprs = dict(HAS_WEIGHT=has_weight, HAS_BIAS=has_bias, BLOCK_P=FINISH_BLOCK_P,
                      BLOCK_D=block_d, VEC=vec(D, 4))
    return _plan("norm_bwd_finish_kernel", -(-D // block_d), constexprs, cfg, groups=1,
                 reads=0, writes=0, stats=0, params=n_par, partials=groups * n_par,
                 ahead=n_par, elem_bytes=4)


# block shapes -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def forward_config(M: int, D: int, itemsize: int = 2) -> Config:
    """Block shape of the forward for M rows of length D (cached).
    Rows up to MAX_FUSED_D_FWD are held in registers: several short rows a tile of about
    TILE_ELEMS values, ELEMS_FWD a thread; from ROW_FROM on a row a program, ROW_ELEMS a
    thread (at least ROW_MIN_WARPS warps, at most ROW_MAX_WARPS). Wider
    rows are swept in chunks of LOOP_CHUNK_BYTES (LOOP_WIDE_CHUNK_BYTES past LOOP_WIDE_FROM),
    LOOP_WARPS warps."""
    if D > MAX_FUSED_D_FWD:
        chunk = LOOP_CHUNK_BYTES if D <= LOOP_WIDE_FROM else LOOP_WIDE_CHUNK_BYTES
        return Config(chunk // itemsize, 1, LOOP_WARPS, LOOP_MAXNREG)
    block_d = max(MIN_BLOCK_D, next_power_of_2(D))
    if block_d >= ROW_FROM:         # a row a program (see ROW_ELEMS)
        warps = min(ROW_MAX_WARPS, max(ROW_MIN_WARPS, block_d // (32 * ROW_ELEMS)))
        return Config(block_d, 1, warps, maxnreg_for(warps))
    return _tiles(M, block_d, ELEMS_FWD)


@functools.lru_cache(maxsize=4096)
def backward_config(M: int, D: int, narrow: bool = False, itemsize: int = 2,
                    arch: int = 90) -> Config:
    """Block shape of the backward for M rows of length D (cached): tiles of several rows as
    the forward's, ELEMS_BWD values a thread. ``narrow``: loads narrower than 16 bytes
    (:func:`narrow_loads`), which take more registers per value: half as many values per
    thread, twice the warps, then. Wider rows than MAX_FUSED_D_BWD: slices of COOP_BYTES (half
    that with narrow loads; at most COOP_VALUES_SM80 values a thread before Hopper, ``arch``
    < 90) that exchange their sums (``SLICES``)."""
    if D > MAX_FUSED_D_BWD:
        block = COOP_BYTES // itemsize // (2 if narrow else 1)
        if arch < 90:
            block = min(block, COOP_VALUES_SM80 * 32 * COOP_WARPS)
        return Config(block, 1, COOP_WARPS, COOP_MAXNREG, SLICES=next_power_of_2(-(-D // block)))
    block_d = max(MIN_BLOCK_D, next_power_of_2(D))
    return _tiles(M, block_d, ELEMS_BWD // 2 if narrow else ELEMS_BWD)


def _tiles(M: int, block_d: int, elems: int) -> Config:
    """ROWS rows of ``block_d`` columns a tile, about TILE_ELEMS values (at most MAX_ROWS
    rows, and no more than M needs), ``elems`` values a thread."""
    rows = max(1, min(MAX_ROWS, TILE_ELEMS // block_d, next_power_of_2(max(M, 1))))
    num_warps = max(1, min(MAX_WARPS, rows * block_d // (32 * elems)))
    return Config(block_d, rows, num_warps, maxnreg_for(num_warps))


def maxnreg_for(num_warps: int) -> int:
    return min(MAX_REGISTERS, _H200["registers"] // (32 * num_warps))   # an SM's registers


# grids ------------------------------------------------------------------------------------------

def _persistent(kernel: str, M: int, cfg: Config, dev: Device, device_index, flags: dict,
                **counts) -> Plan:
    """Whole rows (S = 1) on a persistent grid: as many programs as the GPU holds at once
    (:func:`_resident` on each SM; CPU_PROGRAMS in the interpreter, any fixed number being
    deterministic), never more than the tiles, each ROWS rows a step of its loop. The count
    depends only on the device and the shapes, so two runs with the same shapes split the rows
    the same way and sum the backward's partials in the same order: bitwise equal.

    The loop is software-pipelined: NUM_STAGES is one more than the tiles (ROWS rows of each
    of the ``ahead`` row-sized tensors loaded) that fit in SMEM_PER_PROGRAM, whose loads are
    in flight ahead of the arithmetic, at most MAX_STAGES; 1 (no pipelining) when not even one
    does. (No rows kernel takes 32 warps, whose 64 registers a thread would leave none to
    pipeline with: MAX_FUSED_D_FWD keeps the forward at 16.)"""
    tile = cfg.ROWS * cfg.BLOCK_D * counts["elem_bytes"] * counts["ahead"]
    constexprs = dict(flags, ROWS=cfg.ROWS, BLOCK_D=cfg.BLOCK_D,
                      NUM_STAGES=min(MAX_STAGES, 1 + SMEM_PER_PROGRAM // tile))
    per_sm, measured = _resident(kernel, constexprs, cfg, dev, device_index)
    programs = per_sm * dev.sms if dev.sms else CPU_PROGRAMS
    groups = max(1, min(programs, -(-M // cfg.ROWS)))
    return _plan(kernel, groups, constexprs, cfg, per_sm=per_sm, measured=measured, **counts)


def _shared(kernel: str, M: int, D: int, cfg: Config, dev: Device, device_index, flags: dict,
            **counts) -> Optional[Plan]:
    """S > 1: groups of S = cdiv(D, BLOCK_D) programs, one per slice of a row, exchanging
    sums; None when S exceeds :func:`shared_capacity`. All of them resident at once: as many
    groups as fit, at most one a row. On a GPU the launch is cooperative (so that no wait runs
    out; see ``_backward.launch_shared`` for a refusal) and each wait at most EXCHANGE_POLLS
    reads of L2. The interpreter runs programs one by one: CPU_PROGRAMS groups, waits of
    CPU_POLLS reads and a ring that holds every row of a group (see ``_exchange._ring``)."""
    gpu = dev.sms > 0
    constexprs = dict(flags, BLOCK_D=cfg.BLOCK_D, SLICES=cfg.SLICES,
                      POLLS=EXCHANGE_POLLS if gpu else CPU_POLLS,
                      RING=RING + 2 * flags.get("LAG", 0))
    options = dict(cfg.launch(), launch_cooperative_grid=True) if gpu else cfg.launch()
    per_sm, measured = _resident(kernel, constexprs, cfg, dev, device_index, options)
    slices = -(-D // cfg.BLOCK_D)
    capacity = shared_capacity(cfg, dev, per_sm)
    if slices > capacity:
        return None
    groups = max(1, min(M, capacity // slices if gpu else CPU_PROGRAMS))
    if not gpu:
        constexprs["RING"] = max(constexprs["RING"], -(-M // groups))
    words = groups * (constexprs["RING"] * 2 * cfg.SLICES + slices)
    return _plan(kernel, groups * slices, constexprs, cfg, options, slices=slices, groups=groups,
                 per_sm=per_sm, measured=measured, slot_words=words, **counts)


def shared_capacity(cfg: Config, dev: Device, per_sm: int = 0) -> int:
    """Programs that share rows and can all run at once: what a GPU holds of them (all of a
    cooperative grid must be resident), or CPU_SLICES in the interpreter. ``per_sm``: the
    compiled kernel's programs per SM when measured, else :func:`resident_per_sm`."""
    return (per_sm or resident_per_sm(cfg)) * dev.sms if dev.sms else CPU_SLICES


def resident_per_sm(cfg: Config) -> int:
    """Programs of a block shape that one SM holds, as assumed before its kernel is compiled.

    At most 255 registers per thread (the launch's maxnreg) means a 4-warp program takes at
    most 32K of the 64K registers, so two fit; an 8-warp program or wider, one (two of the
    wide kernels', capped at COOP_MAXNREG). Pipelined tiles take at most SMEM_PER_PROGRAM of
    shared memory each. The compile report checks it against the registers and shared memory
    each kernel really needs; on a GPU, ``_launch.measure`` replaces it at the first launch.
    """
    return max(1, min(64 // cfg.num_warps, 65536 // (cfg.maxnreg * 32 * cfg.num_warps)))


# programs per SM of compiled kernels, measured at their first launch on a GPU
# (``_launch.measure``): (kernel name, its launch keywords, device index) -> programs per SM
measured_per_sm: dict = {}


def measure_key(kernel: str, flags: dict, device_index) -> tuple:
    return kernel, tuple(flags.items()), device_index


def _resident(kernel: str, constexprs: dict, cfg: Config, dev: Device, device_index,
              options: Optional[dict] = None) -> tuple:
    """(programs per SM, measured): the compiled kernel's on a GPU once it was measured, else
    :func:`resident_per_sm`'s assumption (always in the interpreter, which has nothing to
    measure). ``options``: the launch options, ``cfg.launch()`` unless given."""
    if not dev.sms:
        return resident_per_sm(cfg), True
    flags = dict(constexprs, **(cfg.launch() if options is None else options))
    per_sm = measured_per_sm.get(measure_key(kernel, flags, device_index))
    return (resident_per_sm(cfg), False) if per_sm is None else (per_sm, True)


def _plan(kernel: str, grid: int, constexprs: dict, cfg: Config, options: Optional[dict] = None,
          *, slices: int = 1, groups: int = 0, per_sm: int = 0, measured: bool = True,
          **counts) -> Plan:
    """A :class:`Plan` of ``grid`` programs of ``cfg``'s shape (``options``: its launch
    options, ``cfg.launch()`` unless given; ``groups``: the grid unless given; ``per_sm``:
    :func:`resident_per_sm` unless given)."""
    options = cfg.launch() if options is None else options
    flags = dict(constexprs, **options)
    return Plan(kernel, (grid,), constexprs, options, flags, slices=slices,
                groups=groups or grid, rows=cfg.ROWS, per_sm=per_sm or resident_per_sm(cfg),
                measured=measured, simple=slices == 1 and measured,
                key=_launch_id(kernel, flags), **counts)


_launch_ids: dict = {}
_launch_ids_lock = threading.Lock()


def _launch_id(kernel: str, flags: dict) -> int:
    """One int per distinct (kernel, flags): a launch key that hashes in no time (a tuple of
    the flags' items would be hashed again, item by item, at every launch). A new one is
    numbered under a lock: two threads planning new kernels at once both read the table's
    size before either added to it, and took one id for two kernels (whose launches then
    found each other's kept kernel under one key)."""
    key = (kernel, *flags.items())
    found = _launch_ids.get(key)
    if found is None:
        with _launch_ids_lock:
            found = _launch_ids.setdefault(key, len(_launch_ids))
    return found


def _rounding(round_xhat: bool, D: int, widest: int) -> dict:
    """The flag of ``round_xhat``, ROUND_XHAT=True, or none: xhat rounded to the input's dtype
    before the weight multiplies (``rms_norm``'s ``round_xhat``, Llama's order of operations
    in half precision); in the backward, dweight sums dy times that rounded xhat. A flag of the
    plan, so that the rounding kernels are planned, measured and kept as launches of their
    own. Only the rows kernels have it, which take rows of at most ``widest`` values
    (MAX_FUSED_D_FWD forward, MAX_FUSED_D_BWD backward): the front door fuses the mode for rows
    of at most MAX_FUSED_D_BWD values."""
    if not round_xhat:
        return {}
    if D > widest:
        raise ValueError(f"round_xhat: the rows kernels have it, rows of at most {widest} "
                         f"values, got D = {D}")
    return dict(ROUND_XHAT=True)


@functools.lru_cache(maxsize=2)
def weight_loads(has_dh: bool) -> int:
    """How the sharing backward loads its slice of the weight (its ``WEIGHT_LOADS``), the
    fewest loads in a row's chain of waits that the compiler fits in COOP_MAXNREG registers
    without spilling (sm_90 bf16, ``python -m normbook.kernels.report``): 0, once per
    program, on Triton :data:`WEIGHT_ONCE_FROM` and later without dh (chain 1.3 us); 1, once a
    row and held through the wait, before it (Triton 3.6 spills holding it longer: 1.8 us);
    2, before the sums and again after the wait, with dh, whose row is held through the wait
    instead (2.3 us, a step of 2.0)."""
    if has_dh:
        return 2
    import triton

    version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2])
    return 0 if version >= WEIGHT_ONCE_FROM else 1


# devices and alignment --------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def device(device_index) -> Device:
    """The :class:`Device` of Tensor.get_device() (-1: the interpreter, planned as the goal's
    GPU, compute capability 9.0); a Device is itself."""
    if isinstance(device_index, Device):
        return device_index
    if device_index < 0:
        return Device(90, 0)
    major, minor = torch.cuda.get_device_capability(device_index)
    return Device(10 * major + minor,
                  torch.cuda.get_device_properties(device_index).multi_processor_count)


def vec(D: int, itemsize: int, strides: int = 0) -> int:
    """The kernels' VEC: D and every row stride are multiples of it, and the kernels round them
    down to multiples of VEC (a no-op the compiler can see), so that VEC values, up to 16
    bytes, load as one instruction. ``strides``: the row strides ORed together (any bits past
    the lowest four do not matter).

    1 when D and the strides are multiples of 16: Triton's JIT specializes its integer
    arguments on that and knows it already (no second compiled variant). Otherwise the largest
    power of two dividing them all, at most 16 bytes of values: D = 760 or 3000 in bf16 (both
    multiples of 8) loads 128 bits at a time instead of 16.
    """
    common = (D | strides) & 15
    return 1 if common == 0 else min(common & -common, 16 // itemsize)


def narrow_loads(D: int, itemsize: int, strides: int = 0) -> bool:
    """Loads narrower than 16 bytes: D or a stride is not a multiple of 16 bytes of values."""
    return (D | strides) & 15 != 0 and vec(D, itemsize, strides) * itemsize < 16


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); plain Python, no Triton helper on the hot path."""
    return 1 << (n - 1).bit_length()
