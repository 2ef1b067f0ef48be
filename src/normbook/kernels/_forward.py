"""Forward kernels, equations (ln-mean) to (ln-y) and (rms-ms), (rms-y) of "One token's vector".

One kernel family serves both norms: ``IS_RMS`` drops the mean, and that is the whole
difference between LayerNorm and RMSNorm. ``HAS_RESIDUAL`` fuses h = x + residual in front of
the norm, so x and the residual are each read once and h is written once.

Kernels, chosen by row length (see ``_config``):
- ``norm_fwd_rows_kernel``: rows held in registers, ROWS at a time, on a persistent grid whose
  row loop is software-pipelined (the next tiles' loads in flight while one is normalized).
- ``norm_fwd_loop_kernel``: rows too wide for one program's registers, one program a row,
  swept twice in chunks: the statistics (the chunks merged by Chan's formula, (kern-chan) of
  "Kernels"), then the normalization, the row re-read from L2. It replaced a kernel that
  shared a row among programs exchanging their statistics, which measured 0.59-0.79 of copy
  bandwidth on an H200 where this design measured 0.66-0.89 (benchmarks/results/2026-12-04-h200,
  README.md).

Which one, with what grid and flags, is a plan (``_config.forward_plan``): the launcher runs
it, the compile report compiles it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from normbook.kernels._config import forward_plan
from normbook.kernels._launch import launch, measure, other_device

FP32_MIN_NORMAL = tl.constexpr(1.1754943508222875e-38)   # torch.finfo(torch.float32).tiny
FP32_MAX = tl.constexpr(3.4028234663852886e38)           # torch.finfo(torch.float32).max
# rows whose var + eps is below TINY_VAR (2^-100; eps = 0 and values below about 1e-15) take
# their sum of squares again on values scaled by SCALE_UP (2^64, exact): squares below fp32's
# smallest normal keep fewer bits, and a GPU's rsqrt flushes a subnormal argument to 0
TINY_VAR = tl.constexpr(7.888609052210118e-31)
SCALE_UP = tl.constexpr(18446744073709551616.0)


@triton.jit
def _clamp_tiny(v):
    """v, with values in (0, smallest normal float) raised to it: rsqrt of a subnormal stays
    finite (a GPU's rsqrt flushes it to 0, giving inf). Only a row whose values are themselves
    near fp32's smallest reaches it, after the rescaling of TINY_VAR rows. 0 stays 0: a
    constant row at eps = 0 has rstd = inf and y = 0 * inf = NaN, torch's answer, on every
    backend."""
    return tl.where(v > 0, tl.maximum(v, FP32_MIN_NORMAL), v)


@triton.jit
def multiple(n, VEC: tl.constexpr):
    """n, which the launcher guarantees is a multiple of VEC, written so that the compiler knows
    it too (n // VEC * VEC): offsets built from it stay VEC-aligned and VEC values load as one
    instruction. A hint on an argument (tl.multiple_of) has no operation to attach to."""
    if VEC > 1:
        n = n // VEC * VEC
    return n


@triton.jit
def norm_fwd_rows_kernel(
    X,                       # (M, D) input, rows stride_x apart
    R,                       # (M, D) residual, rows stride_r apart
                             # (read if HAS_RESIDUAL)
    H,                       # (M, D) output h = x + residual, contiguous
                             # (if HAS_RESIDUAL)
    Y,                       # (M, D) output y, contiguous
    W,                       # (D,) weight gamma (if HAS_WEIGHT)
    B,                       # (D,) bias beta (if HAS_BIAS)
    Stats,                   # (2, M) fp32 output: mean [0], rstd [1];
                             # RMSNorm (1, M): rstd
    stride_x,                # row stride of X, in elements
    stride_r,                # row stride of R, in elements
    M,                       # number of rows
    D,                       # row length (runtime: a new D does not
                             # recompile)
    eps,                     # fp32, added inside the square root
    IS_RMS: tl.constexpr,    # RMSNorm: no mean, no bias
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,      # rows per step of the loop
    BLOCK_D: tl.constexpr,   # next_power_of_2(D): the whole row in
                             # registers
    NUM_STAGES: tl.constexpr,  # tiles in the software pipeline of the
                               # row loop
    VEC: tl.constexpr,       # D and the strides are multiples of VEC
                             # (see _config.vec)
    ROUND_XHAT: tl.constexpr = False,  # xhat rounded to Y's dtype before
                                       # the weight (_config._rounding)
):
    """(ln-mean), (ln-var), (ln-rstd), (ln-xhat), (ln-y); with IS_RMS,
    (rms-ms) and (rms-y). Persistent: program pid takes the tiles of ROWS
    rows numbered pid, pid + programs, ..."""
    D = multiple(D, VEC)
    stride_x = multiple(stride_x, VEC)
    stride_r = multiple(stride_r, VEC)
    cols = tl.arange(0, BLOCK_D)                        # (BLOCK_D,)
    # weight and bias: loaded once per program and held in registers,
    # except for the widest tiles (not pipelined: registers are short
    # there), where each step reloads them from L2
    HOLD: tl.constexpr = NUM_STAGES > 1
    if HAS_WEIGHT and HOLD:
        w_held = tl.load(
            W + cols, mask=cols < D, other=0.0
        ).to(tl.float32)[None, :]
    if HAS_BIAS and HOLD:
        b_held = tl.load(
            B + cols, mask=cols < D, other=0.0
        ).to(tl.float32)[None, :]
    # a software-pipelined loop: the next NUM_STAGES - 1 tiles' loads are
    # in flight (async copies into shared memory) while this one is
    # normalized and stored
    for first in tl.range(
        tl.program_id(0) * ROWS, M, tl.num_programs(0) * ROWS,
        num_stages=NUM_STAGES,
    ):
        rows = first + tl.arange(0, ROWS)               # (ROWS,)
        row_mask = rows < M
        mask = row_mask[:, None] & (cols[None, :] < D)  # (ROWS, BLOCK_D)
        # M * D may pass 2^31
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(
            X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(R + rows64 * stride_r + cols[None, :], mask=mask,
                        other=0.0)
            # h in the input dtype ...
            h = (x + r.to(tl.float32)).to(H.dtype.element_ty)
            tl.store(H + rows64 * D + cols[None, :], h, mask=mask)
            # ... the norm sees that h
            x = h.to(tl.float32)

        # mean = (1/D) sum_d x_d (ln-mean); RMSNorm does not centre.
        # var = (1/D) sum_d (x_d - mean)^2 (ln-var): a second pass over
        # registers, so no E[x^2] - E[x]^2 cancellation. RMSNorm's ms
        # (rms-ms) is the same sum without the mean.
        if IS_RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / D                # (ROWS,)
            # padding must not count
            xc = tl.where(mask, x - mean[:, None], 0.0)
            # the sum's rounding (an ulp of a mean large against the
            # spread) would shift every xhat: take it back from xc
            fix = tl.sum(xc, axis=1) / D
            mean += fix
            xc = tl.where(mask, xc - fix[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / D               # (ROWS,)
        # (ln-rstd). (A negative var + eps, possible with a negative eps,
        # stays negative: NaN, as in torch.)
        rstd = tl.math.rsqrt(_clamp_tiny(var + eps))
        # var + eps below TINY_VAR (eps = 0, values below about 1e-15):
        # the sum again on xc * 2^64, exact, and 2^64 back out of the root
        # (a negative eps with var < -eps stays as it is: NaN)
        small = (var < TINY_VAR) & (var + eps < TINY_VAR)   # (ROWS,)
        if tl.max(small.to(tl.int32), axis=0) > 0:
            u = xc * SCALE_UP
            q = tl.sum(u * u, axis=1) / D + eps * SCALE_UP * SCALE_UP
            rescued = tl.math.rsqrt(_clamp_tiny(q)) * SCALE_UP
            rstd = tl.where(small, rescued, rstd)
        # fp32 values past about 1e19 square to inf: var = inf, rstd = 0
        # and an output of zeros. Such rows take the sum again on
        # xc / amax, which cannot overflow, and amax comes back out of the
        # root. One more reduction over registers, only when a row
        # overflowed. (A row holding an infinity keeps rstd = 0, as
        # torch's: NaN where the infinity is, 0 elsewhere.)
        big = var > FP32_MAX                            # (ROWS,)
        if tl.max(big.to(tl.int32), axis=0) > 0:
            # (ROWS,)
            amax = tl.where(big, tl.max(tl.abs(xc), axis=1), 1.0)
            u = xc / amax[:, None]
            rstd = tl.where(
                big & (amax <= FP32_MAX),
                tl.math.rsqrt(tl.sum(u * u, axis=1) / D) / amax, rstd
            )
        xhat = xc * rstd[:, None]                       # (ln-xhat)

        # y = weight * xhat + bias (ln-y)
        y = xhat
        if ROUND_XHAT:
            # Llama's order in half precision: xhat rounded to the
            # output's dtype, then the weight multiplies (the product
            # rounded below)
            y = y.to(Y.dtype.element_ty).to(tl.float32)
        if HAS_WEIGHT:
            if HOLD:
                y = y * w_held
            else:
                y = y * tl.load(
                    W + cols, mask=cols < D, other=0.0
                ).to(tl.float32)[None, :]
        if HAS_BIAS:
            if HOLD:
                y = y + b_held
            else:
                y = y + tl.load(
                    B + cols, mask=cols < D, other=0.0
                ).to(tl.float32)[None, :]
        tl.store(
            Y + rows64 * D + cols[None, :], y.to(Y.dtype.element_ty),
            mask=mask,
        )
        # two fp32 scalars per row for backward, not D values of xhat
        if IS_RMS:
            tl.store(Stats + rows, rstd, mask=row_mask)
        else:
            tl.store(Stats + rows, mean, mask=row_mask)
            tl.store(Stats + M + rows, rstd, mask=row_mask)


@triton.jit
def _sweep_load(X, R, H, row, stride_x, stride_r, D, c, mask, HAS_RESIDUAL: tl.constexpr):
    """Columns c of one row of the norm's input, fp32, in the first sweep: x, or h = x +
    residual, stored to H in its dtype and used as stored. x is loaded with ``evict_last`` (the
    second sweep reads it again, from L2); the residual, read once, with ``evict_first``."""
    if HAS_RESIDUAL:
        x = tl.load(X + row * stride_x + c, mask=mask, other=0.0,
                    eviction_policy="evict_first")
        r = tl.load(R + row * stride_r + c, mask=mask, other=0.0,
                    eviction_policy="evict_first")
        h = (x.to(tl.float32) + r.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + row * D + c, h, mask=mask)
        return h.to(tl.float32)
    return tl.load(X + row * stride_x + c, mask=mask, other=0.0,
                   eviction_policy="evict_last").to(tl.float32)


@triton.jit
def _sweep_again(X, H, row, stride_x, D, c, mask, HAS_RESIDUAL: tl.constexpr):
    """The same columns in a later sweep, fp32: x, or the h stored in the first; the last
    use of them, so ``evict_first``."""
    if HAS_RESIDUAL:
        v = tl.load(H + row * D + c, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        v = tl.load(X + row * stride_x + c, mask=mask, other=0.0,
                    eviction_policy="evict_first")
    return v.to(tl.float32)


@triton.jit
def _centred(X, H, row, stride_x, D, c, mean, lo, IS_RMS: tl.constexpr,
             HAS_RESIDUAL: tl.constexpr):
    """Columns c of the row again (:func:`_sweep_again`), fp32, less the row's mean, mean + lo
    (RMSNorm: as they are); 0 past D."""
    mask = c < D
    x = _sweep_again(X, H, row, stride_x, D, c, mask, HAS_RESIDUAL)
    return x if IS_RMS else tl.where(mask, (x - mean) - lo, 0.0)


@triton.jit
def norm_fwd_loop_kernel(
    X,                       # (M, D) input, rows stride_x apart
    R,                       # (M, D) residual, rows stride_r apart
                             # (read if HAS_RESIDUAL)
    H,                       # (M, D) output h = x + residual, contiguous
                             # (if HAS_RESIDUAL)
    Y,                       # (M, D) output y, contiguous
    W,                       # (D,) weight gamma (if HAS_WEIGHT)
    B,                       # (D,) bias beta (if HAS_BIAS)
    Stats,                   # (2, M) fp32 output: mean [0], rstd [1];
                             # RMSNorm (1, M): rstd
    stride_x,                # row stride of X, in elements
    stride_r,                # row stride of R, in elements
    M,                       # number of rows
    D,                       # row length, any size
    eps,                     # fp32, added inside the square root
    IS_RMS: tl.constexpr,    # RMSNorm: no mean, no bias
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,   # the chunk: columns of one step of a sweep
    VEC: tl.constexpr,       # D and the strides are multiples of VEC
                             # (see _config.vec)
    STAGES: tl.constexpr = 1,  # chunks of a sweep in flight (1: one)
):
    """(ln-mean) to (ln-y), (rms-ms), (rms-y) for rows too wide for one
    program's registers: one program a row (program pid takes rows pid,
    pid + programs, ...), which sweeps it twice in chunks of BLOCK_D. The
    first sweep's chunks each give their mean and M2, merged as they come
    by Chan's formula (kern-chan), never E[x^2] - E[x]^2; the second
    normalizes. The row stays in L2 between the sweeps (the first loads
    with evict_last, the second with evict_first): HBM reads it once."""
    D = multiple(D, VEC)
    stride_x = multiple(stride_x, VEC)
    stride_r = multiple(stride_r, VEC)
    cols = tl.arange(0, BLOCK_D)
    first = tl.program_id(0).to(tl.int64)           # M * D may pass 2^31
    for row in range(first, M, tl.num_programs(0)):
        # sweep 1: the statistics, chunk by chunk (kern-chan)
        n = tl.full((), 0.0, tl.float32)       # columns merged so far
        mean = tl.full((), 0.0, tl.float32)
        lo = tl.full((), 0.0, tl.float32)      # the mean is mean + lo
        m2 = tl.full((), 0.0, tl.float32)      # RMSNorm: sum of squares
        for start in tl.range(0, D, BLOCK_D, num_stages=STAGES):
            c = start + cols
            mask = c < D
            x = _sweep_load(X, R, H, row, stride_x, stride_r, D, c, mask,
                            HAS_RESIDUAL)
            if IS_RMS:
                m2 += tl.sum(x * x, axis=0)                # (rms-ms)
            else:
                nc = tl.minimum(D - start, BLOCK_D).to(tl.float32)
                mc = tl.sum(x, axis=0) / nc
                xc = tl.where(mask, x - mc, 0.0)
                cc = tl.sum(xc, axis=0) / nc   # mc's rounding, back
                xc = tl.where(mask, xc - cc, 0.0)
                total = n + nc
                delta = (mc - mean) + (cc - lo)
                # the merged mean as mean + lo, a sum and its rounding
                # error (TwoSum): an ulp of a large mean would shift
                # every xhat of the row
                step = (mc - mean) * (nc / total)
                s = mean + step
                back = s - mean
                lo += ((cc - lo) * (nc / total)
                       + ((mean - (s - back)) + (step - back)))
                mean = s
                # (the first chunk adds no term: 0 * delta^2, NaN where
                # delta^2 overflows, is not computed)
                spread = delta * delta * (n * nc / total)
                spread = tl.where(n > 0, spread, 0.0)
                m2 += tl.sum(xc * xc, axis=0) + spread
                n = total
        var = m2 / D                                   # (ln-var)
        # (ln-rstd); a tiny var + eps takes the sum again scaled (see
        # the rows kernel): one more sweep, for such rows only
        rstd = tl.math.rsqrt(_clamp_tiny(var + eps))
        if (var < TINY_VAR) & (var + eps < TINY_VAR):
            q = tl.full((), 0.0, tl.float32)
            for start in range(0, D, BLOCK_D):
                u = _centred(X, H, row, stride_x, D, start + cols, mean,
                             lo, IS_RMS, HAS_RESIDUAL) * SCALE_UP
                q += tl.sum(u * u, axis=0)
            q = q / D + eps * SCALE_UP * SCALE_UP
            rstd = tl.math.rsqrt(_clamp_tiny(q)) * SCALE_UP
        if var > FP32_MAX:
            # squares past fp32 (values past about 1e19): two more sweeps,
            # for such rows only, take the sum on (x - mean) / amax, which
            # cannot overflow, and amax comes back out of the root
            amax = tl.full((), 0.0, tl.float32)
            for start in range(0, D, BLOCK_D):
                xc = _centred(X, H, row, stride_x, D, start + cols, mean,
                              lo, IS_RMS, HAS_RESIDUAL)
                amax = tl.maximum(amax, tl.max(tl.abs(xc), axis=0))
            q = tl.full((), 0.0, tl.float32)
            for start in range(0, D, BLOCK_D):
                u = _centred(X, H, row, stride_x, D, start + cols, mean,
                             lo, IS_RMS, HAS_RESIDUAL) / amax
                q += tl.sum(u * u, axis=0)
            # (a row holding an infinity keeps rstd = 0, as torch's)
            rstd = tl.where(amax <= FP32_MAX,
                            tl.math.rsqrt(q / D) / amax, rstd)
        if IS_RMS:
            tl.store(Stats + row, rstd)
        else:
            tl.store(Stats + row, mean + lo)
            tl.store(Stats + M + row, rstd)
        # sweep 2: y = weight * xhat + bias (ln-xhat), (ln-y)
        for start in tl.range(0, D, BLOCK_D, num_stages=STAGES):
            c = start + cols
            mask = c < D
            x = _sweep_again(X, H, row, stride_x, D, c, mask,
                             HAS_RESIDUAL)
            y = x * rstd if IS_RMS else ((x - mean) - lo) * rstd
            if HAS_WEIGHT:
                w = tl.load(W + c, mask=mask, other=0.0)
                y = y * w.to(tl.float32)
            if HAS_BIAS:
                b = tl.load(B + c, mask=mask, other=0.0)
                y = y + b.to(tl.float32)
            tl.store(Y + row * D + c, y.to(Y.dtype.element_ty), mask=mask)


# the launchers look their kernels up by a plan's name here: the module's own namespace
_KERNELS = globals()


def launch_key(plan, x, r, w, b, stride_x: int, stride_r: int, M: int, D: int) -> tuple:
    """What a forward launch's compiled kernel is specialized on besides its pointers' 16-byte
    alignment (:func:`normbook.kernels._launch.launch`): the plan's launch, the tensors' dtypes
    (``r``, ``w``, ``b``: the residual, weight and bias or their placeholders), the integers."""
    return plan.key, x.dtype, r.dtype, w.dtype, b.dtype, stride_x, stride_r, M, D


def norm_forward(x, residual, weight, bias, eps: float, is_rms: bool, round_xhat: bool = False):
    """(ln-y) and (rms-y), with the residual add: launch the forward on (M, D) rows, last dim contiguous.
    ``round_xhat``: xhat rounded to x's dtype before the weight (rows of at most
    ``MAX_FUSED_D_BWD`` values; see :func:`normbook.kernels._config._rounding`).

    Returns:
        y: (M, D) contiguous, x's dtype; h: (M, D) x + residual, or None without a residual;
            stats: fp32, what backward needs, (2, M) for LayerNorm (mean, rstd) and (1, M) for
            RMSNorm (rstd): ``stats[-1]`` is rstd either way.
    """
    M, D = x.shape
    device = x.get_device()
    if device >= 0 and other_device(device):
        with torch.cuda.device(device):
            return norm_forward(x, residual, weight, bias, eps, is_rms, round_xhat)
    # empty_like: cheapest on the host; contiguous, since x's rows are dense or x is not dense
    y = torch.empty_like(x)
    # two fp32 scalars per row (one for RMSNorm) for backward, in one allocation
    # (sizes as separate arguments: half a microsecond less than a tuple, measured)
    stats = x.new_empty(1 if is_rms else 2, M, dtype=torch.float32)
    stride_x = x.stride()[0]             # stride() then [0]: faster than stride(0)
    if residual is None:   # placeholders for the residual and h: never touched when absent
        h, r, hy, stride_r = None, x, y, stride_x
    else:
        h = hy = torch.empty_like(x)
        r, stride_r = residual, residual.stride()[0]
    if not M or not D:   # nothing to launch; rows of no values: torch's mean 0, rstd NaN
        if M:
            stats[-1].fill_(math.nan)
            if not is_rms:
                stats[0].zero_()
        return y, h, stats
    call = (M, D, device, x.element_size(), is_rms, h is not None, weight is not None,
            bias is not None, (stride_x | stride_r) & 15, round_xhat)
    plan = forward_plan(*call)[0]
    w = x if weight is None else weight  # placeholders: never read when absent
    b = x if bias is None else bias
    args = (x, r, hy, y, w, b, stats, stride_x, stride_r, M, D, eps)
    # every pointer must be 16-byte aligned for the kept kernel (else Triton's path, key None)
    aligned = not (x.data_ptr() | r.data_ptr() | hy.data_ptr() | y.data_ptr() | w.data_ptr()
                   | b.data_ptr() | stats.data_ptr()) & 15
    key = launch_key(plan, x, r, w, b, stride_x, stride_r, M, D) if aligned else None
    kernel = _KERNELS[plan.kernel]
    if not plan.measured and measure(kernel, plan, args, device):
        # a GPU, the rows kernel's first launch, whose programs per SM were not the assumed:
        # the plan again, its grid sized by what the compiled kernel needs (same flags and key)
        plan = forward_plan(*call)[0]
    launch(kernel, plan.grid, args, plan.flags, key, device)
    return y, h, stats
