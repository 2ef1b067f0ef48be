"""Launch configuration: how a (M, D) problem maps onto Triton programs.

D and the row strides are runtime arguments, so a new D does not recompile. Only the block
shape is constexpr, and it is bucketed: BLOCK_D = next_power_of_2(D), so every D in
(2^(k-1), 2^k] shares one compiled kernel. (Triton's JIT does specialize on D % 16 == 0 and
on 16-byte-aligned pointers and strides: that is what lets the loads be 128 bits wide.)

- D <= MAX_FUSED_D_FWD (forward) or MAX_FUSED_D_BWD (backward): the whole row lives in
  registers; statistics take two passes over those registers and HBM is read once. When D is
  small a program takes several rows (ROWS), so each program still moves a useful number of bytes.
- wider rows (never refused): each row is split into S slices, one program per slice holding
  it in registers (``SLICES``: COOP_FWD_BYTES of loads in the forward, COOP_BYTES of x in the
  backward), and the S programs of a row exchange their partial sums (forward: mean and M2;
  backward: the shares of c1, c2) through 64-bit slots, launched cooperatively so that all are
  resident: the row is read once. Rows with more slices than the GPU holds programs (and all
  wide rows with NORMBOOK_SHARED_ROWS=0, see :func:`shared_rows`) go to
  kernels that read a row twice: the forward holds its first HOLD columns
  (:func:`chunked_forward_config`) and reads the rest twice; the backward reads x and dy once
  for c1, c2 and again for dx.
- The backward's cap is a quarter of the forward's because it keeps four row-sized fp32 tensors live
  (x, dy and the dweight, dbias partials): at D = 16384 that is about 160 registers per thread
  at 16 warps, over the 128 available, and ptxas spills (see ``python -m normbook.kernels.report``).
- Backward: a persistent grid of a fixed number of programs, each looping over its rows with
  fp32 partial sums of dweight and dbias, so the final reduction is small and deterministic.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import NamedTuple

import torch

MAX_FUSED_D_FWD = 32768   # widest row the forward holds in registers: 32 values per thread, 32 warps
MAX_FUSED_D_ADD_FP32 = 16384   # fp32 with the residual add: x and r, 64 fp32 values, would spill
MAX_FUSED_D_BWD = 8192    # backward holds x, dy, dweight and dbias partials: 32 per thread
ELEMS_FWD = 32            # values per thread: four 128-bit loads of bf16; 4 warps up to a
                          # 4096-value tile, so three programs share an SM
MAX_STAGES = 4            # rows kernels: up to three tiles' loads in flight ahead
CHUNK_STAGES = 3          # chunk loops of wide rows: two chunks' loads in flight ahead
SMEM_PER_PROGRAM = 64 * 1024   # shared memory for pipelined tiles: two programs fit on sm_80 too
ELEMS_BWD = 32            # values per thread in the backward: 4 warps (8 at D = 8192), so two
                          # programs (one) share an SM and each pipelines its loads

MAX_WARPS = 32            # 1024 threads, the most a program can have
CHUNK_D = 4096            # chunk width of the wide-row backward (rows too wide to share)
COOP_BYTES = 8192         # slice of x per program of the wide-row backward: 4096 bf16 or 2048
                          # fp32 values; its x and dy for the next row (16 KB) are in flight
                          # while it waits for the row's sums, two programs per SM: 32 KB
COOP_FWD_BYTES = 16384    # the wide forward's loads per program and row: 8192 bf16 values of
                          # x, or 4096 of x and of the residual; next row's in flight: two
                          # programs per SM keep 32 KB in flight
COOP_WARPS = 8            # 256 threads, 16 values each (bf16 on sm_90): about 123 registers
COOP_MAXNREG = 128        # half the register file, so that two programs are resident
COOP_VALUES_SM80 = 8      # before Hopper, values a thread of it holds: ptxas for sm_80 needs
                          # more registers for 16 and would spill (python -m normbook.kernels.report)
FWD_CHUNK_BYTES = 16384   # chunk of the wide-row forward past its held head: 8192 bf16 or
                          # 4096 fp32 values, two chunks (32 KB) in flight ahead
CHUNK_WARPS = 8
TILE_ELEMS = 4096         # target elements per tile when several small rows share one
MAX_ROWS = 32             # at most this many rows per tile
MIN_BLOCK_D = 16          # narrower blocks only waste the 128-bit loads
CPU_PROGRAMS = 4          # persistent grid size in the interpreter (any fixed number is deterministic)
EXCHANGE_POLLS = 1 << 16  # bound of a wait for the other slices of a row: about 50 ms of
                          # L2 reads, far past the programs' skew under a cooperative launch
CPU_SLICES = 64           # the interpreter's wide backward exchanges sums up to this many slices
                          # a row (a GPU: as many as it holds programs), past it reads x twice


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def env_switch(name: str, default: bool) -> bool:
    """An on/off environment variable, in any of the usual spellings (1/0, true/false, yes/no,
    on/off, any case); unset or empty means ``default``. Anything else is an error that names
    the variable, rather than a silent guess."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(f"{name}: expected one of {', '.join(_ON)} (on) or {', '.join(_OFF)} (off), "
                     f"got {raw!r}")


def shared_rows(D: int) -> bool:
    """Whether rows of D values may be shared among programs that exchange sums.
    NORMBOOK_SHARED_ROWS=0 (or off, false, no) turns the sharing off: wide rows then take the
    kernels that read a row twice, a way around a GPU or driver that refuses cooperative
    launches. Read each time a plan is looked up, so that a change takes effect at once (the
    plans are cached with it); rows narrow enough for one program never share and do not
    read it, which keeps the environment off the hot path of small rows."""
    return D > MAX_FUSED_D_BWD and env_switch("NORMBOOK_SHARED_ROWS", True)


def other_device(device_index: int) -> bool:
    """Whether CUDA device ``device_index`` is not the current one. Triton launches a kernel
    on the current device and its current stream, whatever device the arguments are on, so
    a launcher for tensors on another device (cuda:1 while cuda:0 is current) makes theirs
    current first. False for the CPU (-1)."""
    return device_index >= 0 and device_index != torch.cuda.current_device()


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); plain Python, no Triton helper on the hot path."""
    return 1 << (n - 1).bit_length()


class Config(NamedTuple):
    """One launch shape. BLOCK_D and ROWS are constexpr; everything else is a runtime argument.
    (A NamedTuple: it hashes in C, and the launch caches below hash it on every call.)"""

    chunked: bool   # D too wide for registers: loop over chunks instead of holding the row
    BLOCK_D: int    # columns per block: next_power_of_2(D), or CHUNK_D when chunked
    ROWS: int       # rows per tile, one step of a program's row loop (1 when chunked)
    num_warps: int
    maxnreg: int    # register cap: the whole register file for one program (see below)
    HOLD: int = 0   # chunked forward: the row's first HOLD columns stay in registers
    SLICES: int = 0  # wide backward: next_power_of_2(slices per row), 0 without the exchange

    def launch(self) -> dict:
        """Launch options. ``maxnreg`` stops ptxas from squeezing a kernel that needs, say,
        34 registers into 32 for occupancy by spilling: it takes what it needs up to the cap."""
        return dict(num_warps=self.num_warps, maxnreg=self.maxnreg)

    def flags(self, stages: int = 1, **constexprs) -> dict:
        """Keyword arguments of one launch: the flags given, the block shape, the options, and
        for the rows kernels ROWS and their loop's pipeline stages."""
        out = dict(constexprs, BLOCK_D=self.BLOCK_D, **self.launch())
        if self.HOLD:
            out["HOLD"] = self.HOLD
        if self.SLICES:
            out["SLICES"] = self.SLICES
        if not self.chunked:
            out.update(ROWS=self.ROWS, NUM_STAGES=stages)
        return out


def _config(M: int, D: int, max_fused: int, elems: int) -> Config:
    if D > max_fused:
        return Config(True, CHUNK_D, 1, CHUNK_WARPS, maxnreg_for(CHUNK_WARPS))
    block_d = max(MIN_BLOCK_D, next_power_of_2(D))
    rows = max(1, min(MAX_ROWS, TILE_ELEMS // block_d, next_power_of_2(max(M, 1))))
    num_warps = max(1, min(MAX_WARPS, rows * block_d // (32 * elems)))
    return Config(False, block_d, rows, num_warps, maxnreg_for(num_warps))


def maxnreg_for(num_warps: int) -> int:
    return min(255, 65536 // (32 * num_warps))   # 64K registers per SM


@functools.lru_cache(maxsize=4096)
def forward_config(M: int, D: int, has_residual: bool = False, itemsize: int = 2,
                   arch: int = 90) -> Config:
    """Block shape of the forward for M rows of length D (cached: called on every launch).
    With the fused residual add a thread loads two values per element of its share; in fp32
    those are 64 registers, all a 32-warp thread has, so fp32 rows with the add are held in
    registers only up to MAX_FUSED_D_ADD_FP32. Wider rows: slices whose loads are
    COOP_FWD_BYTES (x, and the residual) that exchange their statistics (``SLICES``);
    :func:`forward_plan` falls back to :func:`chunked_forward_config` when a row has more
    slices than the GPU holds programs. ``arch``: the compute capability (see :func:`arch`)."""
    wide_add = has_residual and itemsize > 2
    max_fused = MAX_FUSED_D_ADD_FP32 if wide_add else MAX_FUSED_D_FWD
    if D > max_fused:
        return _shared_config(D, COOP_FWD_BYTES // itemsize // (2 if has_residual else 1), arch)
    return _config(M, D, max_fused, ELEMS_FWD)


def _shared_config(D: int, block: int, arch: int) -> Config:
    """Slices of ``block`` columns (fewer values a thread before Hopper, see COOP_VALUES_SM80)
    for the kernels that share a row among S programs."""
    if arch < 90:
        block = min(block, COOP_VALUES_SM80 * 32 * COOP_WARPS)
    return Config(True, block, 1, COOP_WARPS, COOP_MAXNREG, SLICES=next_power_of_2(-(-D // block)))


def chunked_forward_config(has_residual: bool, itemsize: int) -> Config:
    """The one-program-per-row forward for rows too wide to share: it holds as much of the row
    as one program can without spills (HOLD columns) and streams the rest twice."""
    hold = MAX_FUSED_D_FWD if itemsize <= 2 and not has_residual else MAX_FUSED_D_FWD // 2
    return Config(True, FWD_CHUNK_BYTES // itemsize, 1, MAX_WARPS, maxnreg_for(MAX_WARPS),
                  HOLD=hold)


def chunked_backward_config() -> Config:
    """The two-read backward for rows too wide to share: c1, c2 chunk by chunk, then dx on a
    grid of (programs, chunks of CHUNK_D)."""
    return Config(True, CHUNK_D, 1, CHUNK_WARPS, maxnreg_for(CHUNK_WARPS))


def coop_groups(M: int, D: int, cfg: Config, device_index: int, shared: bool = True) -> int:
    """Groups of S = cdiv(D, BLOCK_D) programs that a wide kernel exchanging sums launches
    (grid: groups x S), or 0 when a row has more slices than can run at once: every program
    of a GPU's grid must be resident (the interpreter, which runs them one by one, takes up to
    CPU_SLICES slices and CPU_PROGRAMS groups). 0 as well when ``shared`` is off
    (:func:`shared_rows`)."""
    if not shared:
        return 0
    if device_index < 0:
        return min(M, CPU_PROGRAMS) if -(-D // cfg.BLOCK_D) <= CPU_SLICES else 0
    return shared_groups(M, D, cfg, persistent_programs(1 << 62, device_index, resident_per_sm(cfg)))


def shared_groups(M: int, D: int, cfg: Config, resident: int) -> int:
    """Groups of S = cdiv(D, BLOCK_D) programs when ``resident`` programs run at once (all of
    a cooperative grid must): as many as fit, at most one per row; 0 when S > resident."""
    slices = -(-D // cfg.BLOCK_D)
    return max(1, min(M, resident // slices)) if slices <= resident else 0


def coop_flags(device_index: int) -> dict:
    """How a kernel exchanging sums is launched: on a GPU cooperatively (all programs resident
    at once, so that no wait runs out; see :func:`launch_shared` for a refusal) and with waits
    of at most EXCHANGE_POLLS reads; in the interpreter, which runs programs one by one, with
    waits of 0 reads (a program computes and publishes a slot still empty itself)."""
    if device_index < 0:
        return dict(POLLS=0)
    return dict(POLLS=EXCHANGE_POLLS, launch_cooperative_grid=True)


_cooperation_refused = False


def launch_shared(kernel, grid, args, flags: dict) -> None:
    """Launch a kernel that exchanges sums (:func:`coop_flags`). Cooperatively first; should
    the driver refuse (``too many blocks in cooperative launch``: a partitioned GPU under MPS
    or green contexts, a sanitizer adding registers, a compiler change), plainly, now and for
    every later launch, with one warning: the bounded wait and the computation of late slices
    give the same answer, only more slowly where programs are not all resident."""
    global _cooperation_refused
    if _cooperation_refused and "launch_cooperative_grid" in flags:
        flags = {k: v for k, v in flags.items() if k != "launch_cooperative_grid"}
    try:
        kernel[grid](*args, **flags)
    except RuntimeError as e:
        if "cooperative" not in str(e).lower() or "launch_cooperative_grid" not in flags:
            raise
        _cooperation_refused = True
        warnings.warn(f"normbook: the GPU refused a cooperative launch ({e}); wide rows are "
                      "launched without it from now on (same results; slower if not every "
                      "program is resident)", RuntimeWarning, stacklevel=3)
        launch_shared(kernel, grid, args, flags)


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


@functools.lru_cache(maxsize=4096)
def forward_plan(M: int, D: int, device_index: int, itemsize: int, is_rms: bool,
                 has_residual: bool, has_weight: bool, has_bias: bool,
                 strides: int = 0, shared: bool = True) -> tuple[Config, tuple, dict]:
    """(config, grid, launch keywords) of the forward on a device (Tensor.get_device(): -1 for
    the CPU), cached: a launch computes and builds nothing. Rows in registers: a persistent
    grid of what the GPU holds, with the row loop's pipeline stages. ``strides``: the low four
    bits of the row strides ORed (see :func:`vec`); ``shared``: :func:`shared_rows`."""
    cfg = forward_config(M, D, has_residual, itemsize, arch(device_index))
    flags = dict(IS_RMS=is_rms, HAS_RESIDUAL=has_residual, HAS_WEIGHT=has_weight,
                 HAS_BIAS=has_bias, VEC=vec(D, itemsize, strides))
    if cfg.SLICES:
        groups = coop_groups(M, D, cfg, device_index, shared)
        if groups:
            return cfg, (groups * -(-D // cfg.BLOCK_D),), cfg.flags(**flags,
                                                                   **coop_flags(device_index))
        cfg = chunked_forward_config(has_residual, itemsize)
    if cfg.chunked:
        grid = (M,)
    else:
        grid = (persistent_programs(-(-M // cfg.ROWS), device_index, resident_per_sm(cfg)),)
    return cfg, grid, cfg.flags(num_stages(cfg, itemsize, 2 if has_residual else 1), **flags)


@functools.lru_cache(maxsize=4096)
def backward_plan(M: int, D: int, device_index: int, itemsize: int, is_rms: bool, has_dh: bool,
                  has_weight: bool, has_bias: bool, strides: int = 0,
                  shared: bool = True) -> tuple[Config, int, dict]:
    """(config, persistent programs, launch keywords) of the backward on a device, cached as
    :func:`forward_plan`. With ``cfg.SLICES`` the programs are groups of S cooperating
    programs (the grid is programs x S, launched cooperatively: all resident at once, or the
    launch fails instead of waiting forever), each group one row of partial sums."""
    cfg = backward_config(M, D, narrow_loads(D, itemsize, strides), itemsize, arch(device_index))
    flags = dict(IS_RMS=is_rms, HAS_DH=has_dh, HAS_WEIGHT=has_weight, HAS_BIAS=has_bias,
                 VEC=vec(D, itemsize, strides))
    if cfg.SLICES:      # programs = groups of S programs, one group per row at a time
        groups = coop_groups(M, D, cfg, device_index, shared)
        if groups:
            return cfg, groups, cfg.flags(**flags, **coop_flags(device_index))
        cfg = chunked_backward_config()
    programs = persistent_programs(-(-M // cfg.ROWS), device_index, resident_per_sm(cfg))
    return cfg, programs, cfg.flags(num_stages(cfg, itemsize, 3 if has_dh else 2), **flags)


def resident_per_sm(cfg: Config) -> int:
    """Programs of a persistent rows kernel that one SM holds, which sizes its grid.

    At most 255 registers per thread (the launch's maxnreg) means a 4-warp program takes at
    most 32K of the 64K registers, so two fit; an 8-warp program or wider, one (two of the
    wide backward's, capped at COOP_MAXNREG). Pipelined
    tiles take at most SMEM_PER_PROGRAM of shared memory each. The compile report checks it
    against the registers and shared memory each kernel really needs.
    """
    return max(1, min(64 // cfg.num_warps, 65536 // (cfg.maxnreg * 32 * cfg.num_warps)))


@functools.lru_cache(maxsize=4096)
def num_stages(cfg: Config, itemsize: int, inputs: int) -> int:
    """Stages of a rows kernel's software pipeline: one more than the tiles that fit in
    SMEM_PER_PROGRAM (their loads are in flight ahead of the arithmetic), at most MAX_STAGES;
    1 (no pipelining) when not even one does. A tile is ROWS rows of each of the ``inputs``
    row-sized tensors loaded.

    A 32-warp program is never pipelined: its threads have 64 registers each, room for their
    32 values of the row but not for the weight and bias that a pipelined loop holds (ptxas
    would spill), and reloaded inside the loop those would be pipelined into shared memory too.
    Its whole row is in flight at once instead (half the time, NON_PIPELINED_DUTY in the model).
    """
    if cfg.num_warps >= MAX_WARPS:
        return 1
    tile = cfg.ROWS * cfg.BLOCK_D * itemsize * inputs
    return min(MAX_STAGES, 1 + SMEM_PER_PROGRAM // tile)


@functools.lru_cache(maxsize=64)
def arch(device_index: int) -> int:
    """Compute capability of CUDA device ``device_index`` as 80, 90, ...; 90 for the
    interpreter (-1), whose launch shapes are those of the goal's GPU."""
    if device_index < 0:
        return 90
    major, minor = torch.cuda.get_device_capability(device_index)
    return 10 * major + minor


@functools.lru_cache(maxsize=4096)
def backward_config(M: int, D: int, narrow: bool = False, itemsize: int = 2,
                    arch: int = 90) -> Config:
    """Block shape of the backward for M rows of length D (cached: called on every launch).
    ``narrow``: loads narrower than 16 bytes (:func:`narrow_loads`), which take more registers
    per value: half as many values per thread, twice the warps, then. Wider rows than
    MAX_FUSED_D_BWD: slices of COOP_BYTES (half that with narrow loads) that exchange their
    sums (``SLICES``); :func:`backward_plan` falls back to the two-read kernels when a row has
    more slices than the GPU holds programs. ``arch``: the compute capability (see :func:`arch`)."""
    if D > MAX_FUSED_D_BWD:
        return _shared_config(D, COOP_BYTES // itemsize // (2 if narrow else 1), arch)
    return _config(M, D, MAX_FUSED_D_BWD, ELEMS_BWD // 2 if narrow else ELEMS_BWD)


@functools.lru_cache(maxsize=4096)
def persistent_programs(tiles: int, device_index: int, per_sm: int) -> int:
    """Grid size of a persistent kernel: as many programs as the GPU holds
    at once (``per_sm`` on each SM of CUDA device ``device_index``; -1,
    Tensor.get_device() of a CPU tensor, means the interpreter), never more
    than the tiles.

    The count depends only on the device and the shapes, so two runs with
    the same shapes split the rows the same way and sum the backward's
    partials in the same order: bitwise equal.
    """
    if device_index >= 0:
        programs = per_sm * torch.cuda.get_device_properties(
            device_index
        ).multi_processor_count
    else:
        # the interpreter: any fixed number is deterministic
        programs = CPU_PROGRAMS
    return max(1, min(programs, tiles))
