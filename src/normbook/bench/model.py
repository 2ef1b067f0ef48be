"""The performance model: from a compiled kernel to a predicted fraction of copy bandwidth.

A norm is memory-bound, so a path (the kernels one forward or one backward launches) can reach
at most the copy bandwidth, and falls short of it for three reasons the model counts:

1. **Traffic.** It moves more bytes than the byte model's minimum (a second pass over a row,
   the partial sums of dweight/dbias). Fraction lost: min / actual.
2. **Latency.** HBM answers a load after about a microsecond; to keep 4.3 TB/s flowing, each of
   the 132 SMs must keep ``LITTLE_BYTES`` = 4.3 TB/s x 1 us / 132, about 32 KB, of loads in
   flight (Little's law). An SM holds as many programs as its registers (64K), shared memory
   (228 KB) and warp slots (64) allow, and the grid provides; each program has in flight the
   loads of its current tile, all of the time when its loop is pipelined (async copies in the
   compiled code, num_stages - 1 tiles ahead; or the next row's loads issued into registers
   before the program waits, one tile ahead), about half of the time when it is not (load,
   then reduce and store, then load again). Efficiency: min(1, in flight / LITTLE_BYTES).
3. **Serial chain.** A program's row step cannot end sooner than its chain of waits: the
   loads whose values it needs before it can go on, the block reductions, and in the kernels
   that share a row the exchange of partial sums (a 64-bit store to L2, polls that read it
   back: ``exchange``, assumed 1 us, plus the other programs' skew). The compile report counts
   the chain in the SASS that runs (:mod:`normbook.kernels.sass`: HBM and L2 load rounds,
   block reductions, shuffle levels, the exchange) and gives its latency, ``serial_s``. Loads
   issued before the chain (the next row's, or a pipelined loop's async copies) are in
   flight during it; a loop that is not pipelined waits for its own step's loads as well, and
   those take at least their bytes at the SM's share of the bandwidth on top of their latency.
   With R programs resident on an SM, each running its own chain, the SM completes R steps
   per chain at most: its throughput is at most R x (bytes of a step) / (chain + own
   transfer). Efficiency: min(1, R x step bytes at the SM's share of the bandwidth /
   (serial_s + own transfer)). Latency hidden by other resident programs costs nothing; the
   chain shows only when R programs' steps move their bytes faster than one chain runs.

A kernel's efficiency is the smaller of the in-flight and the chain bounds (each caps the
throughput by itself; the two describe the same waiting from two sides, so they are not
multiplied). A path of several kernels takes the time of each: predicted fraction
= min bytes / sum over kernels (bytes of the kernel / its efficiency). Assumptions, stated so
that a GPU run can correct them: every pass over a row is an HBM pass (no L2 reuse between the
passes of a wide row), weights and biases come from L2 after the first read, the exchange's
slots cost one HBM write back, and compute is never the limit. The numbers are for an H200 (``H200``).
"""

from __future__ import annotations

import math

__all__ = ["H200", "LITTLE_BYTES", "programs_per_sm", "predict", "unshared_reads"]

H200 = dict(sms=132, registers=65536, shared=228 * 1024, warps=64, blocks=32,
            bandwidth=4.3e12, latency=1e-6, exchange=1e-6)
LITTLE_BYTES = H200["bandwidth"] * H200["latency"] / H200["sms"]   # about 32.6 KB per SM
NON_PIPELINED_DUTY = 0.5    # a loop without async copies has loads in flight half of the time


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int, hw=H200) -> int:
    """Programs resident on one SM: registers are allocated per warp in units of 256 (8 per
    thread), shared memory per program, and an SM holds at most 64 warps and 32 programs."""
    regs = max(8, math.ceil(registers / 8) * 8)
    by_regs = hw["registers"] // (regs * 32 * num_warps)
    by_smem = hw["shared"] // shared_bytes if shared_bytes else hw["blocks"]
    by_warps = hw["warps"] // num_warps
    return max(0, min(by_regs, by_smem, by_warps, hw["blocks"]))


def kernel_efficiency(k: dict, hw=H200) -> dict:
    """For one launched kernel ``k`` (registers, num_warps, shared_bytes, grid, tile_bytes,
    pipelined, num_stages; with ``serial_s`` and ``step_bytes``, a program's chain of waits
    and the bytes a program moves per row step): resident programs per SM, bytes in flight
    per SM, efficiency (and the chain with its own transfer, ``chain_s``, against the R
    resident programs' steps at the SM's share of the bandwidth, ``step_s``)."""
    resident = programs_per_sm(k["registers"], k["num_warps"], k["shared_bytes"], hw)
    resident = min(resident, math.ceil(k["grid"] / hw["sms"]))     # a small grid fills less
    ahead = max(1, k["num_stages"] - 1) if k["pipelined"] else NON_PIPELINED_DUTY
    inflight = resident * k["tile_bytes"] * ahead
    efficiency = min(1.0, inflight / LITTLE_BYTES)
    out = dict(programs_per_sm=resident, inflight_bytes_per_sm=inflight)
    if "serial_s" in k and "step_bytes" in k:   # the chain of waits of a row step (3.)
        share = hw["bandwidth"] / hw["sms"]                           # bytes/s of one SM
        at_bandwidth = resident * k["step_bytes"] / share               # R steps, one after another
        chain = k["serial_s"] + (0.0 if k["pipelined"] else k["tile_bytes"] / share)
        if chain > 0:
            efficiency = min(efficiency, 1.0, at_bandwidth / chain)
        out.update(serial_s=k["serial_s"], chain_s=chain, step_s=at_bandwidth)
    return dict(out, efficiency=efficiency)


def predict(kernels: list[dict], min_bytes_per_row: float, hw=H200) -> dict:
    """The path's prediction from its kernels (each with ``bytes_per_row`` and what
    :func:`kernel_efficiency` needs): HBM bytes per row, the main kernel's (the one that moves
    most) residency, in-flight bytes and, when counted, its chain and its R steps at
    bandwidth (``chain_us``, ``step_us``), and the predicted fraction of copy bandwidth."""
    actual = sum(k["bytes_per_row"] for k in kernels)
    time = 0.0
    for k in kernels:
        k.update(kernel_efficiency(k, hw))
        time += k["bytes_per_row"] / max(k["efficiency"], 1e-9)
    main = max(kernels, key=lambda k: k["bytes_per_row"])          # the kernel that moves most
    chain = {f"{key[:-2]}_us": round(main[key] * 1e6, 2) for key in ("chain_s", "step_s") if key in main}
    return dict(hbm_bytes_per_row=round(actual, 1), min_bytes_per_row=round(min_bytes_per_row, 1),
                programs_per_sm=main["programs_per_sm"],
                inflight_bytes_per_sm=round(main["inflight_bytes_per_sm"]), **chain,
                predicted_fraction=round(min_bytes_per_row / time, 3) if time else 0.0)


def unshared_reads(slices: int, resident: int) -> float:
    """Reads of a row, in rows, by the kernel that shares it among ``slices`` programs when
    only ``resident`` of them run at once (a launch without the cooperative guarantee): each
    resident program publishes its slice, waits out its bound, and then computes every slice
    still missing itself (first writer wins, but all of them are racing), so the S - R missing
    slices are read R times over: 1 + R (S - R) / S rows. 1 when all are resident."""
    if slices <= resident:
        return 1.0
    return 1 + resident * (slices - resident) / slices
