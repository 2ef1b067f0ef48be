"""Forward kernels, equations (ln-mean) to (ln-y) and (rms-ms), (rms-y) of "One token's vector".

One kernel family serves both norms: ``IS_RMS`` drops the mean, and that is the whole
difference between LayerNorm and RMSNorm. ``HAS_RESIDUAL`` fuses h = x + residual in front of
the norm, so x and the residual are each read once and h is written once.

Kernels, chosen by row length (see ``_config``):
- ``norm_fwd_rows_kernel``: rows held in registers, ROWS at a time, on a persistent grid whose
  row loop is software-pipelined (the next tiles' loads in flight while one is normalized).
- ``norm_fwd_coop_kernel``: rows too wide for one program's registers, shared by S programs, a
  column slice each, held in registers; the slices' means and M2 are exchanged through 64-bit
  slots and merged by Chan's formula, (kern-chan-all) of "Kernels" (never the cancelling
  E[x^2] - E[x]^2 of (kern-naive-var)), so the row is read once.

Which one, with what grid and flags, is a plan (``_config.forward_plan``): the launcher runs
it, the compile report compiles it. Rows with more slices than the device runs at once have
no plan (``_config.kernels_take``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normbook.kernels._config import (MAX_FUSED_D_BWD, forward_plan, launch_shared, other_device,
                                      refusal, shared_rows, slot_words)
from normbook.kernels._launch import launch

FP32_MIN_NORMAL = tl.constexpr(1.1754943508222875e-38)   # torch.finfo(torch.float32).tiny
FP32_MAX = tl.constexpr(3.4028234663852886e38)           # torch.finfo(torch.float32).max


@triton.jit
def _clamp_tiny(v):
    """v, with values in [0, smallest normal float) raised to it: rsqrt stays finite."""
    return tl.where(v >= 0, tl.maximum(v, FP32_MIN_NORMAL), v)


@triton.jit
def multiple(n, VEC: tl.constexpr):
    """n, which the launcher guarantees is a multiple of VEC, written so that the compiler knows
    it too (n // VEC * VEC): offsets built from it stay VEC-aligned and VEC values load as one
    instruction. A hint on an argument (tl.multiple_of) has no operation to attach to."""
    if VEC > 1:
        n = n // VEC * VEC
    return n


@triton.jit
def _ring(Slots, first, tag, SLICES: tl.constexpr, RING: tl.constexpr):
    """Where the slots of the row tagged ``tag`` are. A group's slots
    are a ring of RING rows (2 on a GPU): its i-th row (first + i *
    groups) is tagged i + 1 and uses place i % RING, so a program can
    publish row i + 1 while its partners still read row i, and row i + 2
    only once they all have (while no wait runs out: after one, a late
    program's words may land on a later row's place, and the tags keep
    them from being taken for that row's). A place is SLICES words a,
    then SLICES words b (a constexpr apart: no register holds the
    offset). The slots are zeroed per launch: tag 0 is "empty". The
    interpreter, which runs a group's programs one after another, keeps
    every row of a group, so that the slots the first program computes
    stay for the others."""
    place = first * RING + (tag + RING - 1) % RING
    return Slots + place * (2 * SLICES)


@triton.jit
def _pack(a, b, tag):
    """Two fp32 values as two int64 words, each its value's bits in the
    low half and ``tag`` in the high half: a word is written by one
    atomic, so a reader that finds its row's tag in a word finds the
    value beside it (the data is its own ready flag)."""
    ai = a.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    bi = b.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    tag = tag.to(tl.int64) << 32
    return tag | ai, tag | bi


@triton.jit
def _unpack(v):
    """The fp32 value of a word of :func:`_pack`."""
    return (v & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _publish(ring, SLICES: tl.constexpr, j, packed, live, ONE: tl.constexpr):
    """This slice's two words into its slot (word a at ``ring + j``, b SLICES words on; with
    ``ONE``, RMSNorm's, only b: a holds 0, unused), if ``live``: once a wait of the program
    has run out, it publishes no more in its loop, so that its slots keep the rows its
    partners finish after theirs."""
    a, b = packed
    if not ONE:
        tl.atomic_xchg(ring + j, a, mask=live, sem="relaxed")
    tl.atomic_xchg(ring + SLICES + j, b, mask=live, sem="relaxed")


@triton.jit
def _missing(a, b, which, tag):
    """Whether any slot of ``which`` (a mask over the slots) lacks a value of the row tagged
    ``tag`` in its words ``a`` or ``b``, as read."""
    stale = ((a >> 32) != tag) | ((b >> 32) != tag)
    return tl.sum((which & stale).to(tl.int32), axis=0) > 0


@triton.jit
def _read_slots(ring, SLICES: tl.constexpr, t, valid, ONE: tl.constexpr):
    """The two words of each of the row's S slots (``t``: slot index; past S: 0, empty);
    with ``ONE``, word b twice."""
    b = tl.load(ring + SLICES + t, mask=valid, other=0, volatile=True)
    a = b if ONE else tl.load(ring + t, mask=valid, other=0, volatile=True)
    return a, b


@triton.jit
def _exchange(ring, SLICES: tl.constexpr, t, valid, tag, row, deferred, M,
              POLLS: tl.constexpr, ONE: tl.constexpr):
    """The row's S slots, this program's own among them (read back, so that its share needs
    no registers through the wait), once all hold the row's tag or the wait has run out: at
    most POLLS more reads, none once a wait of this program has run out (``deferred`` < M).
    Under a cooperative launch every program is resident and publishes before it waits, so
    the wait ends within the programs' skew, far inside the bound; the bound is for a launch
    that is not all resident (refused cooperation, a launcher that drops it), where a slot may
    stay empty until its program runs. The interpreter, which runs programs one by one, polls
    0 times. Returns the words and ``deferred``: the first row left for the end of the
    program's loop, ``row`` if this wait ran out, else as it was.

    With S <= 32 each warp holds all the slots and reads them at its own moment, so warps
    may disagree on whether this wait ran out (a partner writes between their reads). In the
    loop that is harmless: what a branch on ``row < deferred`` holds (the row's statistics
    from the slots, its y or dx) does not synchronise the program, and a warp that took the
    row finds it again after the loop, which starts at the earliest row any warp left
    (:func:`_agreed_start`). Nothing that synchronises may go into that branch. With S > 32 the
    slots span warps, their sum is one for the program, and so is the answer."""
    a, b = _read_slots(ring, SLICES, t, valid, ONE)
    polls = tl.where(deferred == M, POLLS, 0)
    while _missing(a, b, valid, tag) & (polls > 0):
        a, b = _read_slots(ring, SLICES, t, valid, ONE)
        polls -= 1
    if _missing(a, b, valid, tag):
        deferred = tl.minimum(deferred, row).to(deferred.dtype)
    return a, b, deferred


@triton.jit
def _agreed(v, lanes, M):
    """The greatest of the int32 ``v`` over every thread of the program, the same in all of
    them. A value read from a slot differs between the program's warps when a partner writes
    between their reads, and so would what the program does with it; a branch that
    synchronises the program inside (a block reduction, the broadcast of a scalar atomic's
    result) must go one way in every warp, so its condition goes through this first. The
    reduction runs over ``lanes``, the slice's columns, laid out across every warp, where
    ``lanes >= -M`` is always true but not known to the compiler (M is an argument), so that
    each thread brings the v it holds."""
    return tl.max(tl.where(lanes >= -M, v, 0), axis=0)


@triton.jit
def _agreed_start(Slots, pid, groups, deferred, M, lanes, SLICES: tl.constexpr,
                  RING: tl.constexpr):
    """The first row any warp of the program left for after its loop (``deferred``, M for
    none), the same in every thread: each warp reads the slots at its own moment, so one may
    find a wait run out that another found ended, while the loop after it synchronises the
    program. The warps that left a row raise the program's word past the groups' rings (M -
    their row; zeroed with the slots, so 0 for none) and, after a barrier, every thread reads
    it back. Under a cooperative launch no wait runs out, and nothing is written. (An atomic
    and a barrier rather than a block reduction: the reduction here costs the backward 12
    bytes of spill, in its loop.)"""
    own = Slots + groups * (RING * 2 * SLICES) + pid
    gap = (M - deferred).to(tl.int64)              # > 0: this thread left a row
    tl.atomic_max(own + lanes * 0, gap, mask=lanes * 0 < gap, sem="relaxed")
    tl.debug_barrier()
    return M - tl.load(own, volatile=True)


@triton.jit
def _slot_words(ring, SLICES: tl.constexpr, u, tag, ONE: tl.constexpr, lanes, M):
    """Slot u's two words (with ``ONE``, word b twice), read now, and whether either lacks
    the row's ``tag`` in any thread of the program (:func:`_agreed`): the same answer in every
    thread, so that the program branches on it as one."""
    wb = tl.load(ring + SLICES + u, volatile=True)
    wa = wb if ONE else tl.load(ring + u, volatile=True)
    stale = (((wa >> 32) != tag) | ((wb >> 32) != tag)).to(tl.int32)
    return wa, wb, _agreed(stale, lanes, M) > 0


@triton.jit
def _claim_words(ring, SLICES: tl.constexpr, u, wa, wb, packed, tag, ONE: tl.constexpr):
    """:func:`_claim` for both words of slot u (read as ``wa``, ``wb``) with ``packed``, this
    program's computation of its slice: the words the row's programs use."""
    pa, pb = packed
    wb = _claim(ring + SLICES + u, wb, pb, tag)
    wa = wb if ONE else _claim(ring + u, wa, pa, tag)
    return wa, wb


@triton.jit
def _claim(slot, seen, value, tag):
    """Publish ``value`` (a word of :func:`_pack`) in ``slot``, which held ``seen``, unless
    that was this row's word already or a later row's (a partner has gone on):
    compare-and-swap, so that the first writer wins; the compare value of a slot not to be
    written matches no word (words are >= 0). Returns the word the row's programs use: the
    slot's if it holds one of this row, else ``value``. The owner of a slice and a program that
    computed it for a late owner write the same sums; taking the winner's bits keeps the
    programs of the row in exact agreement all the same. No branch: the scalar atomic's
    result reaches every thread through a barrier, which all of them must meet, while
    ``seen``, read by each thread at its own moment, may differ between them."""
    expect = tl.where((seen >> 32) < tag, seen, -1)
    got = tl.atomic_cas(slot, expect, value, sem="relaxed")
    return tl.where((got >> 32) == tag, got, value)


@triton.jit
def _load_add(X, R, H, row, stride_x, stride_r, D, c, mask, HAS_RESIDUAL: tl.constexpr):
    """Columns c of one row of the norm's input, fp32: x, or h = x + residual, stored to H in
    its dtype and used as stored (the sharing kernel computing a late program's slice)."""
    x = tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + c, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(H.dtype.element_ty)
        tl.store(H + row * D + c, h, mask=mask)
        x = h.to(tl.float32)
    return x


@triton.jit
def _reload(X, H, row, stride_x, D, c, mask, HAS_RESIDUAL: tl.constexpr):
    """The same columns again, after the row's slots are complete: x, or the h stored before
    (one tensor where x and the residual were two)."""
    if HAS_RESIDUAL:
        return tl.load(H + row * D + c, mask=mask, other=0.0).to(tl.float32)
    return tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _normalize_store(Y, w, b, row, D, c, mask, x, mean, rstd, IS_RMS: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y = weight * xhat + bias (ln-xhat), (ln-y) for columns c of one row, stored, from
    the columns' x (any float dtype) and weight ``w`` and bias ``b`` as loaded."""
    x = x.to(tl.float32)
    y = x * rstd if IS_RMS else (x - mean) * rstd
    if HAS_WEIGHT:
        y = y * w.to(tl.float32)
    if HAS_BIAS:
        y = y + b.to(tl.float32)
    tl.store(Y + row * D + c, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _load_params(W, B, c, mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Columns c of the weight and the bias, as stored (0.0 for an absent one)."""
    w = tl.load(W + c, mask=mask, other=0.0) if HAS_WEIGHT else 0.0
    b = tl.load(B + c, mask=mask, other=0.0) if HAS_BIAS else 0.0
    return w, b


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
        var = tl.sum(xc * xc, axis=1) / D               # (ROWS,)
        # (ln-rstd). On a GPU rsqrt flushes a subnormal argument (eps =
        # 0, a near-constant row) to zero and returns inf; the smallest
        # normal float keeps rstd finite. (A negative var + eps, possible
        # with a negative eps, stays negative: NaN, as in torch.)
        rstd = tl.math.rsqrt(_clamp_tiny(var + eps))
        # fp32 values past about 1e19 square to inf: var = inf, rstd = 0
        # and an output of zeros. Such rows take the sum again on
        # xc / amax, which cannot overflow, and amax comes back out of the
        # root. One more reduction over registers, only when a row
        # overflowed.
        big = var > FP32_MAX                            # (ROWS,)
        if tl.max(big.to(tl.int32), axis=0) > 0:
            # (ROWS,)
            amax = tl.where(big, tl.max(tl.abs(xc), axis=1), 1.0)
            u = xc / amax[:, None]
            rstd = tl.where(
                big, tl.math.rsqrt(tl.sum(u * u, axis=1) / D) / amax, rstd
            )
        xhat = xc * rstd[:, None]                       # (ln-xhat)

        # y = weight * xhat + bias (ln-y)
        y = xhat
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
def _slice_count(D, u, BLOCK_D: tl.constexpr):
    """Columns of a row in slice(s) u of BLOCK_D (the last may be ragged; none past D), fp32."""
    return tl.maximum(tl.minimum(D - u * BLOCK_D, BLOCK_D), 0).to(tl.float32)


@triton.jit
def _slice_moments(x, mask, n, IS_RMS: tl.constexpr, tag):
    """One slice's share of the statistics, packed with ``tag``: its mean and M2 (the
    sum of squared deviations from that mean; RMSNorm: 0 and the sum of
    squares). An M2 that overflows (values past about 1e19) is sent as
    minus its square root, taken on the slice scaled by its max |x|."""
    if IS_RMS:
        m = tl.full((), 0.0, tl.float32)
        xc = x
    else:
        m = tl.sum(x, axis=0) / n
        xc = tl.where(mask, x - m, 0.0)
    m2 = tl.sum(xc * xc, axis=0)
    if m2 > FP32_MAX:
        amax = tl.max(tl.abs(xc), axis=0)
        u = xc / amax
        m2 = -tl.sqrt(tl.sum(u * u, axis=0)) * amax
    return _pack(m, m2, tag)


@triton.jit
def _row_statistics(sa, sb, t, S, D, BLOCK_D: tl.constexpr, eps,
                    IS_RMS: tl.constexpr):
    """mean and rstd of a row from its S slices' (mean, M2), in slice
    order (kern-chan, all blocks at once):
    mean = sum_j n_j m_j / D,  M2 = sum_j M2_j + sum_j n_j (m_j - mean)^2.
    Every term is non-negative: no cancellation. If a slice overflowed,
    or the sum does, the same sums are taken scaled by their largest root,
    which comes back out of the square root."""
    valid = t < S
    n = _slice_count(D, t, BLOCK_D)
    m = 0.0 if IS_RMS else tl.where(valid, _unpack(sa), 0.0)
    m2 = tl.where(valid, _unpack(sb), 0.0)
    if IS_RMS:
        mean = 0.0
    else:
        mean = tl.sum(m * (n / D), axis=0)                  # (ln-mean)
    dev = tl.where(valid, m - mean, 0.0)
    var = tl.sum(m2 + n * dev * dev, axis=0) / D           # (ln-var)
    rstd = tl.math.rsqrt(_clamp_tiny(var + eps))           # (ln-rstd)
    if (tl.min(m2, axis=0) < 0) | (var > FP32_MAX):
        s = tl.where(m2 >= 0, tl.sqrt(m2), -m2)
        u = tl.sqrt(n) * tl.abs(dev)
        a = tl.maximum(tl.max(s, axis=0), tl.max(u, axis=0))
        q = tl.sum((s / a) * (s / a) + (u / a) * (u / a), axis=0)
        rstd = tl.math.rsqrt(q / D) / a
    return mean, rstd


@triton.jit
def _slice_normalize(sa, sb, valid, t, S, D, BLOCK_D: tl.constexpr, eps, x, Y, w, b,
                     Stats, M, row, j, c, mask, IS_RMS: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The row's mean and rstd from its S slots' words ``sa``, ``sb`` (``valid``: t < S),
    merged in slice order (the same bits in every program; slice 0 stores
    them), then y for this program's columns c (weight ``w`` and bias ``b``
    as loaded)."""
    mean, rstd = _row_statistics(sa, sb, t, S, D, BLOCK_D, eps, IS_RMS)
    if j == 0:
        if IS_RMS:
            tl.store(Stats + row, rstd)
        else:
            tl.store(Stats + row, mean)
            tl.store(Stats + M + row, rstd)
    _normalize_store(Y, w, b, row, D, c, mask, x, mean, rstd, IS_RMS,
                     HAS_WEIGHT, HAS_BIAS)


@triton.jit
def norm_fwd_coop_kernel(
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
    Slots,                   # (groups * RING * 2 * SLICES,) int64,
                             # zeroed: per group a ring of RING rows'
                             # S slots, two words each (_ring, _pack)
    stride_x,                # row stride of X, in elements
    stride_r,                # row stride of R, in elements
    M,                       # number of rows
    D,                       # row length, any size
    eps,                     # fp32, added inside the square root
    IS_RMS: tl.constexpr,    # RMSNorm: no mean, no bias
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,   # slice width: the columns a program owns
    SLICES: tl.constexpr,    # next_power_of_2(S), S = cdiv(D, BLOCK_D)
    VEC: tl.constexpr,       # D and the strides are multiples of VEC
                             # (see _config.vec)
    POLLS: tl.constexpr,     # bound of the wait for the other slices
                             # (0 in the interpreter; see _exchange)
    RING: tl.constexpr,      # rows of a group kept in slots (_ring)
):
    """(ln-mean) to (ln-y), (rms-ms), (rms-y) for wide rows, each read
    once: S programs share each row, a slice of columns each, and
    exchange their slices' mean and M2 (kern-chan), as the wide backward
    exchanges its sums (see norm_bwd_coop_kernel). Each program holds its
    slice in registers from the statistics to the normalization."""
    D = multiple(D, VEC)
    stride_x = multiple(stride_x, VEC)
    stride_r = multiple(stride_r, VEC)
    S = tl.cdiv(D, BLOCK_D)
    pid = tl.program_id(0)
    j = pid % S                                   # this program's slice
    groups = tl.num_programs(0) // S
    cols = tl.arange(0, BLOCK_D)
    c = j * BLOCK_D + cols
    mask = c < D
    n_j = _slice_count(D, j, BLOCK_D)
    t = tl.arange(0, SLICES)                      # (SLICES,) slice index
    valid = t < S
    first = (pid // S).to(tl.int64)               # < M: groups <= M
    deferred = first * 0 + M       # first row left for the end (M: none)
    tag = pid * 0                  # the last row's tag (int32; 0: none)
    x_next = tl.load(X + first * stride_x + c, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_next = tl.load(R + first * stride_r + c, mask=mask, other=0.0)
    for row in range(first, M, groups):
        # this row as loaded (16-bit: compact through the wait)
        x = x_next
        if HAS_RESIDUAL:
            # h in the input dtype, stored; the norm sees that h
            x = x.to(tl.float32) + r_next.to(tl.float32)
            x = x.to(H.dtype.element_ty)
            tl.store(H + row * D + c, x, mask=mask)
        # publish: the owner's moments, the bits a program computing them
        # for a late owner also writes (same code, see the end)
        tag += 1                   # this row: 1 + its place in the group
        ring = _ring(Slots, first, tag, SLICES, RING)
        moments = _slice_moments(x.to(tl.float32), mask, n_j, IS_RMS, tag)
        _publish(ring, SLICES, j, moments, row < deferred, IS_RMS)
        # the next row, in flight while we wait (past the end: the last);
        # and the weight and bias, from L2, so that no load waits after it
        nxt = tl.minimum(row + groups, M - 1)
        x_next = tl.load(X + nxt * stride_x + c, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r_next = tl.load(R + nxt * stride_r + c, mask=mask, other=0.0)
        w, b = _load_params(W, B, c, mask, HAS_WEIGHT, HAS_BIAS)
        # wait for the row's moments; a row whose wait runs out, and every
        # later one, are finished after the loop, where registers are free
        sa, sb, deferred = _exchange(ring, SLICES, t, valid, tag, row,
                                     deferred, M, POLLS, IS_RMS)
        if row < deferred:
            _slice_normalize(sa, sb, valid, t, S, D, BLOCK_D, eps, x, Y,
                             w, b, Stats, M, row, j, c, mask, IS_RMS,
                             HAS_WEIGHT, HAS_BIAS)
    # The rows whose wait ran out (none under a cooperative launch), in
    # order: each slot without the row's values, this program's own first,
    # is computed from x (and the residual) by the code its owner runs and
    # published, first writer wins; then as in the loop. The warps start
    # at the earliest row any of them left (each reads the slots at its
    # own moment, and this loop synchronises them: _agreed_start): rows a
    # warp finished in the loop are computed again, the same way
    deferred = _agreed_start(Slots, pid, groups, deferred, M, cols,
                             SLICES, RING)
    for row in range(deferred, M, groups):
        tag = ((row - first) // groups + 1).to(tl.int32)
        ring = _ring(Slots, first, tag, SLICES, RING)
        sa = tl.zeros((SLICES,), dtype=tl.int64)
        sb = sa
        for k in range(0, S):
            u = (j + k) % S
            wa, wb, stale = _slot_words(ring, SLICES, u, tag, IS_RMS,
                                        cols, M)
            if stale:
                cu = c + (u - j) * BLOCK_D     # slice u's columns
                mu = cu < D
                # (h stored again: the bits its owner stores)
                xu = _load_add(X, R, H, row, stride_x, stride_r, D, cu,
                               mu, HAS_RESIDUAL)
                n_u = _slice_count(D, u, BLOCK_D)
                packed = _slice_moments(xu, mu, n_u, IS_RMS, tag)
                wa, wb = _claim_words(ring, SLICES, u, wa, wb, packed,
                                      tag, IS_RMS)
            sa = tl.where(t == u, wa, sa)
            sb = tl.where(t == u, wb, sb)
        x = _reload(X, H, row, stride_x, D, c, mask, HAS_RESIDUAL)
        w, b = _load_params(W, B, c, mask, HAS_WEIGHT, HAS_BIAS)
        _slice_normalize(sa, sb, valid, t, S, D, BLOCK_D, eps, x, Y, w, b,
                         Stats, M, row, j, c, mask, IS_RMS, HAS_WEIGHT,
                         HAS_BIAS)


# the launchers look their kernels up by a plan's name here: the module's own namespace
_KERNELS = globals()


def launch_key(plan, x, r, w, b, stride_x: int, stride_r: int, M: int, D: int) -> tuple:
    """What a forward launch's compiled kernel is specialized on besides its pointers' 16-byte
    alignment (:func:`normbook.kernels._launch.launch`): the plan's launch, the tensors' dtypes
    (``r``, ``w``, ``b``: the residual, weight and bias or their placeholders), the integers."""
    return plan.key, x.dtype, r.dtype, w.dtype, b.dtype, stride_x, stride_r, M, D


def norm_forward(x, residual, weight, bias, eps: float, is_rms: bool):
    """(ln-y) and (rms-y), with the residual add: launch the forward on (M, D) rows, last dim contiguous.

    Returns:
        y: (M, D) contiguous, x's dtype; h: (M, D) x + residual, or None without a residual;
        stats: fp32, what backward needs, (2, M) for LayerNorm (mean, rstd) and (1, M) for
        RMSNorm (rstd): ``stats[-1]`` is rstd either way.

    Raises:
        ValueError: rows that no plan takes (:func:`normbook.kernels._config.kernels_take`).
    """
    M, D = x.shape
    device = x.get_device()
    if device >= 0 and other_device(device):
        with torch.cuda.device(device):
            return norm_forward(x, residual, weight, bias, eps, is_rms)
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
    if not M:
        return y, h, stats
    plans = forward_plan(M, D, device, x.element_size(), is_rms, h is not None,
                         weight is not None, bias is not None, (stride_x | stride_r) & 15,
                         D > MAX_FUSED_D_BWD and shared_rows(D))   # (no call for narrow rows)
    if plans is None:
        raise refusal("fwd", D, x.element_size(), residual is not None, device)
    plan = plans[0]
    w = x if weight is None else weight  # placeholders: never read when absent
    b = x if bias is None else bias
    args = (x, r, hy, y, w, b, stats, stride_x, stride_r, M, D, eps)
    # every pointer must be 16-byte aligned for the kept kernel (else Triton's path, key None)
    aligned = not (x.data_ptr() | r.data_ptr() | hy.data_ptr() | y.data_ptr() | w.data_ptr()
                   | b.data_ptr() | stats.data_ptr()) & 15
    key = launch_key(plan, x, r, w, b, stride_x, stride_r, M, D) if aligned else None
    if plan.simple:     # the common case: one launch of whole rows
        launch(_KERNELS[plan.kernel], plan.grid, args, plan.flags, key, device)
        return y, h, stats
    kernel = _KERNELS[plan.kernel]
    if plan.slices > 1:     # groups of S programs, one per slice of a row, exchanging sums
        slots = torch.zeros(slot_words(plan), dtype=torch.int64, device=x.device)
        args = (*args[:7], slots, *args[7:])
    if not plan.measured:   # a GPU, the kernel's first launch: size the grid by what it needs
        from normbook.kernels._config import measure
        if measure(kernel, plan, args, device) and forward_plan(
                M, D, device, x.element_size(), is_rms, residual is not None, weight is not None,
                bias is not None, (stride_x | stride_r) & 15, shared_rows(D)) is not None:
            return norm_forward(x, residual, weight, bias, eps, is_rms)   # the measured plan
    if plan.slices > 1:
        launch_shared(kernel, plan, args, key, device)
    else:
        launch(kernel, plan.grid, args, plan.flags, key, device)
    return y, h, stats
