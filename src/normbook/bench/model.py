"""The H200's numbers the plans and the compile report count with, and the arithmetic of
occupancy: how many programs of a compiled kernel an SM holds.

Until 2026-12-05 this module also turned the compile report into a predicted fraction of copy
bandwidth: traffic, bytes in flight by Little's law (an assumed 1 us latency: 32 KB per SM),
and a row step's chain of waits (an assumed 1 us exchange). The first GPU run
(``benchmarks/results/2026-12-04-h200``: ``summary.txt`` and ``report.json`` hold what it
predicted, ``results.json`` what was measured) put it off by up to 0.41 of copy: it predicted
1.00 for every forward, which measured 0.59-0.93. Nor do its ingredients meet the check it
was asked to pass (every bf16 row that is not host-bound within MODEL_TOLERANCE) when fitted:
:func:`fit` adds four terms built from them, each with a constant of its own fitted by least
squares to the very rows it is judged on, and on that run more than a third of the rows still
miss by more than MODEL_TOLERANCE, the worst by more than three times it (the appendix
computes the figures from the recorded files and asserts these bounds). So the
predictions went, and the report keeps
what it counts: registers, spills, load widths, bytes moved, programs per SM and the bytes
they have in flight. ``normbook-bench --model-check`` still reads the recorded predictions
beside the recorded measurements.
"""

from __future__ import annotations

import math

__all__ = ["H200", "SHARED_SM86", "MODEL_TOLERANCE", "FIT_TERMS", "fit", "programs_per_sm",
           "unshared_reads"]

# an H200's SMs, registers, shared memory, warp slots and programs per SM, and the HBM
# bandwidth of its datasheet (the measured copy is in each run's results.json)
H200 = dict(sms=132, registers=65536, shared=228 * 1024, warps=64, blocks=32,
            bandwidth=4.8e12, thread_registers=255)

# the most shared memory a program may have on sm_86 and sm_89 (and sm_120): 99 KB of their 100
# KB an SM (CUDA's programming guide, its table of compute capabilities), where sm_80 allows 163
# KB and sm_90 227 KB. The plans do not depend on it, and Triton compiles the same cp.async
# pipelines for sm_80, sm_86 and sm_89 (the rows kernels' shared memory, compiled here for
# sm_80 and sm_89: 67840 bytes at most on both), so a plan past it would not launch on an RTX
# 30 or 40, an A10 or an L4: the compile report refuses it for sm_80
SHARED_SM86 = 99 * 1024

# The retired model's assumed prices, not measurements (normbook.kernels.sass prices a chain's
# steps with them; kept here, where no Triton is needed to read them)
HBM_LATENCY_S = 1e-6       # a load from HBM: a round figure, never measured (a loaded H200
                           # took longer: the rows kernels had these bytes in flight, and more)
EXCHANGE_S = 1e-6          # the exchange of a shared row's sums: a store to L2, polls

# the check the retired speed model was asked to pass: its predicted fraction of copy bandwidth
# within this of the measured one, for every bf16 row of a GPU run that is not host-bound
MODEL_TOLERANCE = 0.05


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int, hw=H200) -> int:
    """Programs resident on one SM: registers are allocated per warp in units of 256 (8 per
    thread), shared memory per program, and an SM holds at most 64 warps and 32 programs."""
    regs = max(8, math.ceil(registers / 8) * 8)
    by_regs = hw["registers"] // (regs * 32 * num_warps)
    by_smem = hw["shared"] // shared_bytes if shared_bytes else hw["blocks"]
    by_warps = hw["warps"] // num_warps
    return max(0, min(by_regs, by_smem, by_warps, hw["blocks"]))


def inflight_bytes(k: dict, hw=H200) -> dict:
    """For one compiled kernel ``k`` (registers, num_warps, shared_bytes, grid, tile_bytes,
    pipelined, num_stages): its programs resident per SM (no more than its grid fills) and the
    bytes of loads they have issued ahead of their arithmetic, per SM: a pipelined loop's
    num_stages - 1 tiles each (or the next row's, issued before a wait), else the one tile a
    program waits for. A count, not a speed: how many bytes a GPU needs in flight is what the
    H200's run showed the old model to underestimate."""
    resident = programs_per_sm(k["registers"], k["num_warps"], k["shared_bytes"], hw)
    resident = min(resident, math.ceil(k["grid"] / hw["sms"]))
    ahead = max(1, k["num_stages"] - 1) if k["pipelined"] else 1
    return dict(programs_per_sm=resident, inflight_bytes_per_sm=resident * k["tile_bytes"] * ahead)


def unshared_reads(slices: int, resident: int) -> float:
    """Reads of a row, in rows, by the kernel that shares it among ``slices`` programs when
    only ``resident`` of them run at once (a launch without the cooperative guarantee): each
    resident program publishes its slice, waits out its bound, and then computes every slice
    still missing itself (first writer wins, but all of them are racing), so the S - R missing
    slices are read R times over: 1 + R (S - R) / S rows. 1 when all are resident."""
    if slices <= resident:
        return 1.0
    return 1 + resident * (slices - resident) / slices


# terms built from the retired model's ingredients, in seconds for M rows, added, each given a
# constant of its own by fit() (the retired model took the slowest of its bounds instead)
FIT_TERMS = ("the row's HBM bytes at the copy's bandwidth",
             "the row's bytes over the bytes in flight per SM (Little's law), in us",
             "the row step's chain of waits over the resident programs",
             "the kernels launched, in us")


def fit(result: dict, report: dict, arch: str = "sm_90") -> dict:
    """The retired model's ingredients given a chance: four terms (``FIT_TERMS``, counted by
    the compile ``report`` recorded with ``result``), added, each scaled by a constant fitted to
    the very rows it is then judged on: normbook's bf16 rows at the report's M whose time is
    the kernel's (a host time recorded, and not ``normbook.bench.goal.host_set``).
    Predicted time t = sum_k theta_k term_k (theta_k >= 0), predicted fraction = measured
    fraction * measured time / t; the constants minimize the squared misses of the fractions
    (L-BFGS in float64 from theta = 1: deterministic). A least-squares fit is not a minimax
    one and bounds nothing by itself, but terms that miss a third of the rows they were fitted
    to by more than ``MODEL_TOLERANCE`` do not describe them.

    Returns a dict: ``constants`` (one per term), ``rows`` (op, mode, D, measured, predicted),
    ``worst`` (the largest miss), ``over`` (rows missed by more than MODEL_TOLERANCE).
    """
    import torch

    from normbook.bench.plot import _OP_PATH
    from normbook.bench.goal import host_set

    M, sms = report["m"], H200["sms"]
    paths = {(p["norm"], p["residual"], p["direction"], p["D"]): p for p in report["paths"]
             if p["arch"] == arch and p["dtype"] == "bf16" and "error" not in p}
    copy = result["copy_bandwidth_gbps"] * 1e9
    rows, terms = [], []
    for r in result["rows"]:
        p = paths.get((*_OP_PATH.get(r["op"], ()), r["mode"], r["D"]))
        if (p is None or r["provider"] != "normbook" or r["dtype"] != "bf16" or r["M"] != M
                or r.get("host_bound") is None or host_set(r)):
            continue
        rows.append(r)
        terms.append([M * p["hbm_bytes_per_row"] / copy,
                      M * p["hbm_bytes_per_row"] / (p["inflight_bytes_per_sm"] * sms) * 1e-6,
                      M * p["chain_us"] * 1e-6 / (p["programs_per_sm"] * sms),
                      len(p["kernels"]) * 1e-6])
    if not rows:
        raise ValueError("fit: no normbook bf16 row of the report's M that is not host-bound")
    T = torch.tensor(terms, dtype=torch.float64)                        # (rows, terms)
    frac = torch.tensor([r["frac_copy"] for r in rows], dtype=torch.float64)
    at_copy = frac * torch.tensor([r["ms"] * 1e-3 for r in rows], dtype=torch.float64)
    log_theta = torch.zeros(T.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_theta], max_iter=1000, tolerance_grad=1e-12,
                            tolerance_change=1e-15, line_search_fn="strong_wolfe")

    def loss():
        opt.zero_grad()
        value = ((at_copy / (T @ log_theta.exp()) - frac) ** 2).sum()
        value.backward()
        return value

    for _ in range(10):
        opt.step(loss)
    theta = log_theta.detach().exp()
    predicted = at_copy / (T @ theta)
    miss = (predicted - frac).abs()
    return dict(constants=theta.tolist(),
                rows=[dict(op=r["op"], mode=r["mode"], D=r["D"], measured=r["frac_copy"],
                           predicted=float(q)) for r, q in zip(rows, predicted)],
                worst=float(miss.max()), over=int((miss > MODEL_TOLERANCE).sum()))
