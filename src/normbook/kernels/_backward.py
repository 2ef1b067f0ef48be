"""Backward kernels, equations (ln-ghat), (ln-c), (ln-dx), (ln-dparams) of "The backward pass",
(rms-dx) of "RMSNorm" and (fork-rule) of "Residual connections and the fork rule".

Per row, with xhat recomputed from x, mean and rstd (never saved):
    ghat = dy * weight,   c1 = mean_d(ghat),   c2 = mean_d(ghat * xhat),
    dx = (ghat - c1 - c2 * xhat) * rstd          (RMSNorm: no c1)
and across rows dweight = sum_n dy * xhat, dbias = sum_n dy.

The parameter gradients are a reduction over M rows. Programs of a persistent grid (a fixed
number, see ``_config._persistent``) each loop over their rows and keep fp32 partial
sums, write one (D,) partial each, and ``norm_bwd_finish_kernel`` sums them (a grid of one
program writes dweight and dbias itself): no atomics, no locks, the
same summation order every run, so the result is bitwise reproducible.

Kernels, chosen by row length:
- ``norm_bwd_rows_kernel``: ROWS whole rows at a time in registers, one read of x and dy.
- ``norm_bwd_coop_kernel``: wide rows, one read of x and dy. S programs share each row, one
  column slice each, and exchange their slices' partial sums of c1 and c2 through a small
  buffer of 64-bit slots, kept per stream and tagged by launch (``_slots``: no zeroing
  launch per call); each keeps its slice's partials of dweight and dbias.
- ``norm_bwd_finish_kernel``: sums the partials and writes dweight, dbias in the
  parameters' dtypes, one launch for both.

Which ones, with what grids and flags, are plans (``_config.backward_plan``): the launcher
runs them, the compile report compiles them. Rows with more slices than the device runs at
once have no plan (``_take.kernels_take``).
"""

from __future__ import annotations

import os
import threading
import warnings

import torch
import triton
import triton.language as tl
from triton.runtime import driver as _drivers

from normbook.kernels._config import MAX_FUSED_D_BWD, backward_plan, narrow_loads
from normbook.kernels._launch import launch, measure, other_device
from normbook.kernels._take import refusal, shared_rows
from normbook.kernels._exchange import (_agreed_start, _claim_words, _exchange, _pack, _publish,
                                        _ring, _slot_words, _unpack)
from normbook.kernels._forward import multiple


@triton.jit
def norm_bwd_rows_kernel(
    X,                       # (M, D) forward input (h when the residual
                             # add was fused)
    DY,                      # (M, D) gradient arriving at y, rows
                             # stride_dy apart
    DH,                      # (M, D) gradient arriving at h, rows
                             # stride_dh apart (if HAS_DH)
    DX,                      # (M, D) output dx, contiguous
    W,                       # (D,) weight gamma (if HAS_WEIGHT)
    Stats,                   # (2, M) fp32 mean [0], rstd [1] saved by the
                             # forward; RMSNorm (1, M)
    DW,                      # (programs, D) fp32 partial dweight, one row
                             # per program; with one program, the (D,)
                             # dweight itself, in the weight's dtype
    DB,                      # (programs, D) fp32 partial dbias, or the
                             # (D,) dbias (as DW)
    stride_x,                # row stride of X, in elements
    stride_dy,               # row stride of DY, in elements
    stride_dh,               # row stride of DH, in elements
    M,                       # number of rows
    D,                       # row length
    IS_RMS: tl.constexpr,    # RMSNorm: no c1, no dbias
    HAS_DH: tl.constexpr,    # fused residual: add the gradient arriving
                             # at h (fork rule)
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,      # rows per step of the loop
    BLOCK_D: tl.constexpr,   # next_power_of_2(D): the whole row in
                             # registers
    NUM_STAGES: tl.constexpr,  # tiles in the software pipeline of the
                               # row loop
    VEC: tl.constexpr,       # D and the strides are multiples of VEC
                             # (see _config.vec)
    ROUND_XHAT: tl.constexpr = False,  # the forward rounded xhat to x's
                                       # dtype before the weight
):
    """(ln-dx) and (ln-dparams), or (rms-dx); with HAS_DH the (fork-rule).
    Persistent grid."""
    D = multiple(D, VEC)
    stride_x = multiple(stride_x, VEC)
    stride_dy = multiple(stride_dy, VEC)
    stride_dh = multiple(stride_dh, VEC)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)                          # (BLOCK_D,)
    col_mask = cols < D
    if HAS_WEIGHT:
        w = tl.load(
            W + cols, mask=col_mask, other=0.0
        ).to(tl.float32)[None, :]
    # partial sum_n dy * xhat
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    # partial sum_n dy
    db = tl.zeros((BLOCK_D,), dtype=tl.float32)
    # a software-pipelined loop: the loads of the next NUM_STAGES - 1
    # tiles are issued (as async copies into shared memory) while this
    # one is reduced, so HBM always has work in flight
    for first in tl.range(
        pid * ROWS, M, programs * ROWS, num_stages=NUM_STAGES
    ):
        rows = first + tl.arange(0, ROWS)                 # (ROWS,)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]    # (ROWS, BLOCK_D)
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(
            X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        dy = tl.load(
            DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        rstd = tl.load(
            Stats + (0 if IS_RMS else M) + rows, mask=row_mask, other=0.0
        )[:, None]
        # xhat recomputed from two saved scalars per row (ln-xhat);
        # padding stays zero
        if IS_RMS:
            xhat = x * rstd
        else:
            mean = tl.load(Stats + rows, mask=row_mask, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd, 0.0)
        ghat = dy * w if HAS_WEIGHT else dy               # (ln-ghat)
        # c1: component of ghat along 1; c2: along xhat (ln-c). dx removes
        # both (ln-dx).
        c2 = tl.sum(ghat * xhat, axis=1)[:, None] / D     # (ROWS, 1)
        if IS_RMS:
            dx = (ghat - c2 * xhat) * rstd                # (rms-dx)
        else:
            c1 = tl.sum(ghat, axis=1)[:, None] / D        # (ROWS, 1)
            dx = (ghat - c1 - c2 * xhat) * rstd           # (ln-dx)
        if HAS_DH:
            # fork rule: h feeds the norm and the next residual; the
            # gradients add
            dx += tl.load(
                DH + rows64 * stride_dh + cols[None, :],
                mask=mask, other=0.0,
            ).to(tl.float32)
        tl.store(
            DX + rows64 * D + cols[None, :], dx.to(DX.dtype.element_ty),
            mask=mask,
        )
        # (ln-dparams), kept per program in fp32; one weight serves every
        # row
        if HAS_WEIGHT:
            if ROUND_XHAT:   # the weight multiplied the rounded xhat
                xhat = xhat.to(DX.dtype.element_ty).to(tl.float32)
            dw += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
    # this program's partial row (int64: programs x D may pass 2^31)
    part = pid.to(tl.int64) * D
    if HAS_WEIGHT:
        tl.store(DW + part + cols, dw.to(DW.dtype.element_ty),
                 mask=col_mask)
    if HAS_BIAS:
        tl.store(DB + part + cols, db.to(DB.dtype.element_ty),
                 mask=col_mask)


@triton.jit
def _slice_terms(x, dy, w, mask, mean, rstd,
                 IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """xhat (ln-xhat) and ghat (ln-ghat) of one row's columns, fp32, from
    the columns' x, dy and weight ``w`` as loaded."""
    x = x.to(tl.float32)
    dy = dy.to(tl.float32)
    if IS_RMS:
        xhat = x * rstd
    else:
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
    if HAS_WEIGHT:
        dy = dy * w.to(tl.float32)
    return xhat, dy


# Triton's interpreter runs a reduction with a combine function element by element in Python
# (tl.reduce over 4096 values is about 3x slower than two tl.sum there); it sums the pair
# with tl.sum, the compiled kernels in one tl.reduce.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def _add_pairs(a, b, c, d):
    return a + c, b + d


@triton.jit
def _sum_pair(a, b):
    """(sum a, sum b) of two vectors, compiled as one reduction of the pair: a single round
    through shared memory and one barrier, where two tl.sum take two."""
    if INTERPRETED:
        return tl.sum(a, axis=0), tl.sum(b, axis=0)
    return tl.reduce((a, b), 0, _add_pairs)


@triton.jit
def _slice_sums(xhat, ghat, tag):
    """A slice's share of (ln-c): sum ghat and sum ghat * xhat, packed with ``tag``, from
    one reduction."""
    s1, s2 = _sum_pair(ghat, ghat * xhat)
    return _pack(s1, s2, tag)


@triton.jit
def _slice_dx(sa, sb, valid, D, x, dy, dh, w, DX, row, c, mask, mean, rstd,
              IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
              HAS_DH: tl.constexpr):
    """dx (ln-dx), (rms-dx), (fork-rule) of one row's slice c, stored, from
    the words ``sa``, ``sb`` of the row's S slots (``valid``: t < S): c1 and c2 summed in slice
    order, the same bits in every program."""
    # both sums first (one reduction), so the slots die before xhat and
    # ghat are formed
    c1, c2 = _sum_pair(tl.where(valid, _unpack(sa), 0.0),
                       tl.where(valid, _unpack(sb), 0.0))
    c1 = c1 / D
    c2 = c2 / D
    # xhat and ghat again, from the row as loaded: fewer registers are held
    # through the wait
    xhat, ghat = _slice_terms(x, dy, w, mask, mean, rstd, IS_RMS,
                              HAS_WEIGHT)
    if IS_RMS:
        dx = (ghat - c2 * xhat) * rstd                          # (rms-dx)
    else:
        dx = (ghat - c1 - c2 * xhat) * rstd                     # (ln-dx)
    if HAS_DH:
        dx += dh.to(tl.float32)                              # (fork-rule)
    tl.store(DX + row * D + c, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _one_row_behind(Xj, DYj, DHj, DXj, Wj, Stats, Slots, first, groups, j, tag, M, D,
                    stride_x, stride_dy, stride_dh, cols, mask, t, valid, w, dw, db,
                    deferred, x_next, dy_next, rstd_next, mean_next, dh,
                    IS_RMS: tl.constexpr, HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SLICES: tl.constexpr, POLLS: tl.constexpr,
                    RING: tl.constexpr, WEIGHT_LOADS: tl.constexpr):
    """The row loop of :func:`norm_bwd_coop_kernel` with LAG = 1 (its arguments as the kernel
    has them before its loop; returns dw, db and deferred as that loop leaves them)."""
    # LAG = 1: one row behind. A step publishes its row's sums, then waits for the row
    # before, whose sums its partners published a step ago, and finishes that one: the
    # exchange's latency overlaps a step of loads and sums. The row's x and dy are read
    # again for its dx (from L2: loaded with evict_last a step before), so no more is held
    # through the wait than with LAG = 0; one step past the last row finishes it. A ring of
    # 2 + 2 LAG rows (_config._shared): a partner may still read row i - 1 - 2 LAG while
    # this program publishes row i. (Measured in Triton's interpreter, the programs of one
    # group in processes of their own over 8 rows, one of them 0-0.6 s late: with a ring
    # of 4 no wait ran out in 3 runs; of 3, in 1 of 3; of 2, in all 3; dx right in all.)
    mean_prev = mean_next
    rstd_prev = rstd_next
    for step in range(first, M + groups, groups):
        here = step < M            # a row to publish (not the step past the end)
        x = x_next
        dy = dy_next
        rstd = rstd_next
        mean = mean_next
        w_row = w
        if WEIGHT_LOADS != 0 and HAS_WEIGHT:
            w_row = tl.load(Wj + cols, mask=mask, other=0.0)
        xhat, ghat = _slice_terms(x, dy, w_row, mask, mean, rstd,
                                  IS_RMS, HAS_WEIGHT)
        tag += 1
        ring = _ring(Slots, first, tag, SLICES, RING)
        sums = _slice_sums(xhat, ghat, tag)
        _publish(ring, SLICES, j, sums, here & (step < deferred), IS_RMS)
        if HAS_WEIGHT:
            dw += tl.where(here, dy.to(tl.float32) * xhat, 0.0)
        if HAS_BIAS:
            db += tl.where(here, dy.to(tl.float32), 0.0)
        nxt = tl.minimum(step + groups, M - 1)
        x_next = tl.load(Xj + nxt * stride_x + cols, mask=mask, other=0.0,
                         eviction_policy="evict_last")
        dy_next = tl.load(DYj + nxt * stride_dy + cols, mask=mask,
                          other=0.0, eviction_policy="evict_last")
        rstd_next = tl.load(Stats + (0 if IS_RMS else M) + nxt)
        if not IS_RMS:
            mean_next = tl.load(Stats + nxt)
        prev = step - groups
        if prev >= first:
            xp = tl.load(Xj + prev * stride_x + cols, mask=mask, other=0.0,
                         eviction_policy="evict_first")
            dyp = tl.load(DYj + prev * stride_dy + cols, mask=mask,
                          other=0.0, eviction_policy="evict_first")
            if HAS_DH:
                dh = tl.load(DHj + prev * stride_dh + cols, mask=mask,
                             other=0.0)
            ptag = tag - 1
            pring = _ring(Slots, first, ptag, SLICES, RING)
            sa, sb, deferred = _exchange(pring, SLICES, t, valid, ptag, prev,
                                         deferred, M, POLLS, IS_RMS)
            if prev < deferred:
                wp = w             # (loaded after the wait: none held through it)
                if WEIGHT_LOADS != 0 and HAS_WEIGHT:
                    wp = tl.load(Wj + cols, mask=mask, other=0.0)
                _slice_dx(sa, sb, valid, D, xp, dyp, dh, wp, DXj, prev, cols,
                          mask, mean_prev, rstd_prev, IS_RMS, HAS_WEIGHT,
                          HAS_DH)
        mean_prev = mean
        rstd_prev = rstd
    return dw, db, deferred


@triton.jit(do_not_specialize=["epoch"])
def norm_bwd_coop_kernel(
    X,                       # (M, D) forward input (h when the residual
                             # add was fused)
    DY,                      # (M, D) gradient arriving at y, rows
                             # stride_dy apart
    DH,                      # (M, D) gradient arriving at h, rows
                             # stride_dh apart (if HAS_DH)
    DX,                      # (M, D) output dx, contiguous
    W,                       # (D,) weight gamma (if HAS_WEIGHT)
    Stats,                   # (2, M) fp32 mean [0], rstd [1] saved by the
                             # forward; RMSNorm (1, M)
    Slots,                   # (groups * RING * 2 * SLICES + programs,)
                             # int64: per group a ring of RING rows' S
                             # slots, two words each (_ring, _pack); no
                             # word tagged above epoch (_slots)
    epoch,                   # the tag before this launch's first row:
                             # row i of a group is tagged epoch + i + 1
    DW,                      # (groups, D) fp32 partial dweight, a row
                             # per group; with one group, dweight itself
    DB,                      # (groups, D) fp32 partial dbias (as DW)
    stride_x,                # row stride of X, in elements
    stride_dy,               # row stride of DY, in elements
    stride_dh,               # row stride of DH, in elements
    M,                       # number of rows
    D,                       # row length, any size
    IS_RMS: tl.constexpr,
    HAS_DH: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,   # slice width: the columns a program owns
    SLICES: tl.constexpr,    # next_power_of_2(S), S = cdiv(D, BLOCK_D)
    VEC: tl.constexpr,       # D and the strides are multiples of VEC
                             # (see _config.vec)
    POLLS: tl.constexpr,     # bound of the wait for the other slices
                             # (0 in the interpreter; see _exchange)
    RING: tl.constexpr,      # rows of a group kept in slots (_ring)
    WEIGHT_LOADS: tl.constexpr,  # loads of the weight's slice: 0 once per
                             # program, held through the loop; 1 once a
                             # row, held through the wait; 2 twice a row,
                             # before the sums and after the wait, none
                             # held (see _config.weight_loads)
    LAG: tl.constexpr = 0,   # rows published ahead of the one waited
                             # for: 0 or 1 (see _config.EXCHANGE_LAG)
):
    """(ln-c), (ln-dx), (rms-dx), (ln-dparams) and (fork-rule) for wide
    rows, reading x and dy once: S programs share each row, a slice of
    columns each, and exchange their shares of c1 and c2.

    Program (g, j) owns slice j of rows g, g + G, ... (G groups of S).
    Per row it publishes its two sums in its slot of the group's ring
    (_ring): two 64-bit words, each a sum and the row's tag, each written
    by one atomic at L2, so the data is its own "ready" flag. It reads
    the other S - 1 slots until all hold the row's tag and sums them in
    slice order: the same bits every run. The next row's x and dy are
    loaded before the wait, so HBM stays busy meanwhile. Every program
    publishes before it waits, so the waits end once all are resident,
    which the cooperative launch guarantees. The wait is bounded all the
    same (POLLS reads): once one runs out, the program publishes no more
    in its loop, and finishes that row and its later ones after it, in
    order, where each slot without the row's sums is computed from x and
    dy by the same code and published, first writer wins (_claim): a
    launch that is not all resident gives the same answer, only slower.
    The interpreter runs programs one by one with POLLS = 0: the first
    program of a row computes and publishes the others' slots, the later
    ones find them.

    With LAG = 1 a program publishes row i before it waits for row i - 1
    and finishes that one (see the loop); the same sums, summed in the
    same order, so the same bits as LAG = 0.
    """
    D = multiple(D, VEC)
    stride_x = multiple(stride_x, VEC)
    stride_dy = multiple(stride_dy, VEC)
    stride_dh = multiple(stride_dh, VEC)
    S = tl.cdiv(D, BLOCK_D)
    pid = tl.program_id(0)
    j = pid % S                                   # this program's slice
    groups = tl.num_programs(0) // S
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D - j * BLOCK_D
    # the slice's columns of each row-sized tensor: a pointer per program
    # and the same per-thread offsets (cols) for all, fewer registers than
    # per-thread columns j * BLOCK_D + cols held through the loop
    Xj = X + j * BLOCK_D
    DYj = DY + j * BLOCK_D
    DHj = DH + j * BLOCK_D
    DXj = DX + j * BLOCK_D
    t = tl.arange(0, SLICES)                      # (SLICES,) slice index
    valid = t < S
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)   # partial sum_n dy*xhat
    db = tl.zeros((BLOCK_D,), dtype=tl.float32)   # partial sum_n dy
    first = (pid // S).to(tl.int64)               # < M: groups <= M
    # clamped all the same: without it Triton 3.6 spills 16 bytes
    # (LayerNorm with dh, sm_90), although the clamp changes no value
    start = tl.minimum(first, M - 1)
    deferred = pid * 0 + M         # first row left for the end (M: none);
                                   # int32 (a register fewer than int64)
    tag = pid * 0 + epoch          # the last row's tag (int32; epoch:
                                   # none yet)
    x_next = tl.load(Xj + start * stride_x + cols, mask=mask, other=0.0)
    dy_next = tl.load(DYj + start * stride_dy + cols, mask=mask,
                      other=0.0)
    rstd_next = tl.load(Stats + (0 if IS_RMS else M) + start)
    mean_next = 0.0 if IS_RMS else tl.load(Stats + start)
    # the program's columns of the weight, the same in every row, as
    # stored (16-bit: compact); with WEIGHT_LOADS = 0 loaded here, so that
    # no row waits for it (the plan chooses where the compiler holds it
    # without spilling)
    Wj = W + j * BLOCK_D
    w = tl.load(Wj + cols, mask=mask, other=0.0) if (
        WEIGHT_LOADS == 0 and HAS_WEIGHT) else 0.0
    dh = dy_next                   # (a value for calls without DH)
    if LAG == 1:   # one row behind: _one_row_behind's loop, not this one
        dw, db, deferred = _one_row_behind(
            Xj, DYj, DHj, DXj, Wj, Stats, Slots, first, groups, j, tag,
            M, D, stride_x, stride_dy, stride_dh, cols, mask, t, valid, w,
            dw, db, deferred, x_next, dy_next, rstd_next, mean_next, dh,
            IS_RMS, HAS_DH, HAS_WEIGHT, HAS_BIAS, SLICES, POLLS, RING,
            WEIGHT_LOADS)
    for row in range(first, M if LAG == 0 else first, groups):
        x = x_next                 # this row as loaded (16-bit: compact)
        dy = dy_next
        rstd = rstd_next           # its statistics, loaded with it
        mean = mean_next
        w_row = w
        if WEIGHT_LOADS != 0 and HAS_WEIGHT:
            w_row = tl.load(Wj + cols, mask=mask, other=0.0)
        xhat, ghat = _slice_terms(x, dy, w_row, mask, mean, rstd,
                                  IS_RMS, HAS_WEIGHT)
        # publish: the owner's sums, the bits a program computing them for
        # a late owner also writes (same code, see the end of the loop)
        tag += 1                   # this row's: epoch + 1 + its place in
                                   # the group
        ring = _ring(Slots, first, tag, SLICES, RING)
        sums = _slice_sums(xhat, ghat, tag)
        # (none after a wait ran out: see the end; a branch for RMSNorm
        # with dh, where the mask alone costs Triton 3.6 8 bytes of spill)
        if not (IS_RMS and HAS_DH) or row < deferred:
            _publish(ring, SLICES, j, sums, row < deferred, IS_RMS)
        # (ln-dparams) before the wait, so dy's fp32 copy can go
        if HAS_WEIGHT:
            dw += dy.to(tl.float32) * xhat
        if HAS_BIAS:
            db += dy.to(tl.float32)
        # the next row and its statistics, in flight while we wait (past
        # the end: the last), so no load from HBM waits in its chain
        nxt = tl.minimum(row + groups, M - 1)
        x_next = tl.load(Xj + nxt * stride_x + cols, mask=mask, other=0.0)
        dy_next = tl.load(DYj + nxt * stride_dy + cols, mask=mask,
                          other=0.0)
        rstd_next = tl.load(Stats + (0 if IS_RMS else M) + nxt)
        if not IS_RMS:
            mean_next = tl.load(Stats + nxt)
        if HAS_DH:                 # in flight through the wait
            dh = tl.load(DHj + row * stride_dh + cols, mask=mask,
                         other=0.0)
        # wait for the row's sums; a row whose wait runs out, and every
        # later one, are finished after the loop, where registers are free
        sa, sb, deferred = _exchange(ring, SLICES, t, valid, tag, row,
                                     deferred, M, POLLS, IS_RMS)
        if row < deferred:
            if WEIGHT_LOADS == 2:  # again (from L2), rather than held
                w_row = tl.load(Wj + cols, mask=mask, other=0.0) if (
                    HAS_WEIGHT) else 0.0
            _slice_dx(sa, sb, valid, D, x, dy, dh, w_row, DXj, row, cols,
                      mask, mean, rstd, IS_RMS, HAS_WEIGHT, HAS_DH)

    # this group's partial row (int64: groups x D may pass 2^31)
    c = j * BLOCK_D + cols
    part = first * D
    if HAS_WEIGHT:
        tl.store(DW + part + c, dw.to(DW.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(DB + part + c, db.to(DB.dtype.element_ty), mask=mask)
    # The rows whose wait ran out (none under a cooperative launch), in
    # order: each slot without the row's sums, this program's own first,
    # is computed from x and dy by the code its owner runs and published,
    # first writer wins; then dx as in the loop. The warps start at the
    # earliest row any of them left (each reads the slots at its own
    # moment, and this loop synchronises them: _agreed_start): a warp's dx
    # of a row it finished in the loop is computed again, the same way
    # (dweight and dbias took every row above, once)
    deferred = _agreed_start(Slots, pid, groups, deferred, M, cols, epoch,
                             SLICES, RING).to(tl.int32)
    for r in range(deferred, M, groups):
        row = first * 0 + r            # int64: offsets may pass 2^31
        rstd = tl.load(Stats + (0 if IS_RMS else M) + row)
        mean = 0.0
        if not IS_RMS:
            mean = tl.load(Stats + row)
        tag = ((row - first) // groups + 1 + epoch).to(tl.int32)
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
                xu = tl.load(X + row * stride_x + cu, mask=mu, other=0.0)
                dyu = tl.load(DY + row * stride_dy + cu, mask=mu,
                              other=0.0)
                wu = 0.0
                if HAS_WEIGHT:
                    wu = tl.load(W + cu, mask=mu, other=0.0)
                xhat_u, ghat_u = _slice_terms(xu, dyu, wu, mu, mean,
                                              rstd, IS_RMS, HAS_WEIGHT)
                packed = _slice_sums(xhat_u, ghat_u, tag)
                wa, wb = _claim_words(ring, SLICES, u, wa, wb, packed,
                                      tag, IS_RMS)
            sa = tl.where(t == u, wa, sa)
            sb = tl.where(t == u, wb, sb)
        x = tl.load(X + row * stride_x + c, mask=mask, other=0.0)
        dy = tl.load(DY + row * stride_dy + c, mask=mask, other=0.0)
        if HAS_DH:
            dh = tl.load(DH + row * stride_dh + c, mask=mask, other=0.0)
        wc = w if WEIGHT_LOADS == 0 else (
            tl.load(W + c, mask=mask, other=0.0) if HAS_WEIGHT else 0.0)
        _slice_dx(sa, sb, valid, D, x, dy, dh, wc, DX, row, c, mask, mean,
                  rstd, IS_RMS, HAS_WEIGHT, HAS_DH)


@triton.jit
def norm_bwd_finish_kernel(
    PW,                      # (programs, D) fp32 partial dweight
    PB,                      # (programs, D) fp32 partial dbias
    DW,                      # (D,) dweight, weight's dtype (HAS_WEIGHT)
    DB,                      # (D,) dbias, bias's dtype (HAS_BIAS)
    programs,                # rows of PW and PB
    D,                       # row length
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr,   # partials summed per step
    BLOCK_D: tl.constexpr,   # columns per program
    VEC: tl.constexpr,       # D is a multiple of VEC (see _config.vec)
):
    """(ln-dparams), the last step: sum the per-program fp32 partials in
    a fixed order, cast once."""
    D = multiple(D, VEC)
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    dw = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
    db = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
    for first in range(0, programs, BLOCK_P):
        p = first + tl.arange(0, BLOCK_P)                # (BLOCK_P,)
        mask = (p < programs)[:, None] & col_mask[None, :]
        offs = p.to(tl.int64)[:, None] * D + cols[None, :]
        if HAS_WEIGHT:
            dw += tl.load(PW + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            db += tl.load(PB + offs, mask=mask, other=0.0)
    if HAS_WEIGHT:
        dweight = tl.sum(dw, axis=0).to(DW.dtype.element_ty)
        tl.store(DW + cols, dweight, mask=col_mask)
    if HAS_BIAS:
        dbias = tl.sum(db, axis=0).to(DB.dtype.element_ty)
        tl.store(DB + cols, dbias, mask=col_mask)


_cooperation_refused = False


def launch_shared(kernel, plan, args: tuple, key=None, device: int = 0) -> None:
    """Launch a kernel that exchanges sums (``_config._shared``) by ``plan``. Cooperatively
    first; should the driver refuse (``too many blocks in cooperative launch``: a partitioned
    GPU under MPS or green contexts, a sanitizer adding registers, a compiler change), plainly,
    now and for every later launch, with one warning: the bounded wait and the computation of
    late slices give the same answer, only more slowly where programs are not all resident.
    ``key`` and ``device``: :func:`normbook.kernels._launch.launch`'s."""
    global _cooperation_refused
    flags = plan.flags
    if _cooperation_refused and "launch_cooperative_grid" in flags:
        flags = {k: v for k, v in flags.items() if k != "launch_cooperative_grid"}
        key = None      # (Triton's own path: not the plan's kept cooperative kernel)
    try:
        launch(kernel, plan.grid, args, flags, key, device)
    except RuntimeError as e:
        if "cooperative" not in str(e).lower() or "launch_cooperative_grid" not in flags:
            raise
        _cooperation_refused = True
        warnings.warn(f"normbook: the GPU refused a cooperative launch ({e}); wide rows are "
                      "launched without it from now on (same results; slower if not every "
                      "program is resident)", RuntimeWarning, stacklevel=3)
        launch_shared(kernel, plan, args, key, device)


# the launchers look their kernels up by a plan's name here: the module's own namespace
_KERNELS = globals()

TAG_LIMIT = (1 << 31) - 1      # the highest tag a slot's word holds (int32; words stay >= 0)
MAX_SLOT_BUFFERS = 64          # (device, stream) buffers kept before the table starts again
# (device, stream) -> [its slot buffer, the highest tag launched into it]
_slot_buffers: dict = {}
# held from a sharing launch's epoch to its launch (norm_backward): reentrant, since a launch
# measured on its first call plans and launches again inside
_slot_lock = threading.RLock()


def _slots(plan, M: int, x: torch.Tensor, device: int, kept: bool = True) -> tuple:
    """The slot buffer and epoch of a sharing launch of ``plan`` over M rows of x, on CUDA
    device ``device`` (-1: the interpreter), without zeroing the buffer per launch (with
    ``kept`` False, new zeroed slots and epoch 0, as under capture: see below).

    The buffer belongs to the current stream: launches on one stream run one after another,
    so each finds every word of the previous ones written. Row i of a group is tagged
    epoch + i + 1, and the epoch is the highest tag that any earlier launch into the buffer
    used (the buffer was zeroed when made), so no word left by an earlier launch, whatever its
    layout, has this launch's tag, and the kernel reads such words as empty. That needs the
    launches to reach the stream in the order of their epochs: :func:`norm_backward` holds
    ``_slot_lock`` from this call to its launch (two threads on one stream took their epochs
    and then launched, in either order; a program of the earlier epoch, launched second, read
    the later one's mark in its own word as "no row left", and skipped the rows whose wait
    had run out, their dx never written). A launch into a
    CUDA graph being captured gets a new buffer, zeroed in the graph, and epoch 0: replays
    launch with the epoch they captured, so they must start from zeros each time. So does a
    launch of the custom op (``kept`` False: torch.compile's graphs, whose CUDA graph trees
    warm up in a memory pool of their own that they may later reclaim, which a kept buffer
    must never be in). When the tags would pass TAG_LIMIT (after 2^31 rows per group) the
    buffer is zeroed, once, on its stream."""
    words = plan.slot_words
    rows = -(-M // plan.groups)                           # at most, per group
    if not kept or (device >= 0 and torch.cuda.is_current_stream_capturing()):
        return torch.zeros(words, dtype=torch.int64, device=x.device), 0
    key = device, (_drivers.active.get_current_stream(device) if device >= 0 else 0)
    # (threads launching on one stream take epochs one after another; the launcher holds the
    # lock on to its launch, so that they also reach the stream in the order of their epochs)
    with _slot_lock:
        kept = _slot_buffers.get(key)
        if kept is None or kept[0].numel() < words:
            if len(_slot_buffers) >= MAX_SLOT_BUFFERS:
                _slot_buffers.clear()
            kept = _slot_buffers[key] = [torch.zeros(words, dtype=torch.int64,
                                                     device=x.device), 0]
        elif kept[1] + rows > TAG_LIMIT:
            kept[0].zero_()
            kept[1] = 0
        epoch = kept[1]
        kept[1] = epoch + rows    # (the program's own word is tagged epoch + 1 <= epoch + rows)
        return kept[0], epoch


def launch_keys(plans, x, dy, dhp, w, ow, ob, stride_x: int, stride_dy: int, stride_dh: int,
                M: int, D: int) -> tuple:
    """What the backward's compiled kernels are specialized on besides their pointers' 16-byte
    alignment (:func:`normbook.kernels._launch.launch`), for the main launch and the finish
    (None without one): the plans' launches, the tensors' dtypes (``dhp``, ``w``, ``ow``,
    ``ob``: dh, the weight, dweight and dbias or their placeholders; the partials are fp32),
    the integers."""
    main = (plans[0].key, x.dtype, dy.dtype, dhp.dtype, w.dtype, ow.dtype, ob.dtype, stride_x,
            stride_dy, stride_dh, M, D)
    if len(plans) == 1:
        return main, None
    return (*main, torch.float32), (plans[1].key, ow.dtype, ob.dtype, plans[0].groups, D)


def norm_backward(dy, dh, x, weight, stats, bias_dtype, is_rms: bool, round_xhat: bool = False,
                  kept_slots: bool = True):
    """(ln-dx), (rms-dx), (ln-dparams) and (fork-rule): launch the backward on (M, D) rows.
    ``round_xhat``: the forward's (:func:`normbook.kernels._forward.norm_forward`).
    ``kept_slots``: rows shared among programs exchange sums through slots kept per stream
    (:func:`_slots`); False for new zeroed slots each call (the custom op's).

    ``x`` has a contiguous last dim; its row stride, and dy's and dh's, are honoured (dy or dh
    with other steps along D, an expanded gradient say, is copied first).

    Args:
        dy: (M, D) gradient at y; dh: (M, D) gradient at h, or None (no fused residual).
        x: (M, D) the forward's normalized input (h when the residual was fused).
        weight: (D,) or None; stats: the forward's fp32 (2, M) mean and rstd, or (1, M) rstd
        for RMSNorm.
        bias_dtype: the bias's dtype, or None when there is no bias.

    Returns:
        dx: (M, D) contiguous, x's dtype; dweight: (D,) in weight's dtype, or None without a
            weight; dbias: (D,) in ``bias_dtype``, or None without a bias.

    Raises:
        ValueError: rows that no plan takes (:func:`normbook.kernels._take.kernels_take`).
    """
    M, D = x.shape
    device = x.get_device()
    if device >= 0 and other_device(device):
        with torch.cuda.device(device):
            return norm_backward(dy, dh, x, weight, stats, bias_dtype, is_rms, round_xhat,
                                 kept_slots)
    # empty_like: cheapest on the host; contiguous, since x's rows are dense or x is not dense
    dx = torch.empty_like(x)
    if weight is None:
        dweight = None
        dbias = None if bias_dtype is None else x.new_empty(D, dtype=bias_dtype)
    else:
        dweight = torch.empty_like(weight)
        dbias = None if bias_dtype is None else (
            torch.empty_like(weight) if bias_dtype == weight.dtype
            else torch.empty_like(weight, dtype=bias_dtype))
    if not M or not D:   # no rows: the sums over rows are zero (no columns: empty)
        return (dx, None if dweight is None else dweight.zero_(),
                None if dbias is None else dbias.zero_())
    stride_x = x.stride()[0]                       # stride() then [i]: faster than stride(i)
    stride_dy, step = dy.stride()
    if step != 1 and D > 1:    # a gradient may be any view (an expand): make D's steps unit
        dy = dy.contiguous()
        stride_dy = dy.stride()[0]
    if dh is None:
        dhp, stride_dh = dy, stride_dy
    else:
        dhp = dh if dh.stride()[1] == 1 or D == 1 else dh.contiguous()
        stride_dh = dhp.stride()[0]
    e = x.element_size()
    call = (M, D, device, e, is_rms, dh is not None, dweight is not None, dbias is not None)
    shared = D > MAX_FUSED_D_BWD and shared_rows(D)      # (no call for narrow rows)
    odd = (stride_x | stride_dy | stride_dh) & 15
    plans = backward_plan(*call, odd, shared, round_xhat)
    if plans is None:
        if narrow_loads(D, e, odd) and not narrow_loads(D, e):
            # a wide row whose odd strides halve the slices: dense copies load 16 bytes at a
            # time and take the plan that kernels_take promised (it plans for dense rows)
            x, dy = x.contiguous(), dy.contiguous()
            dhp = dy if dh is None else dh.contiguous()
            stride_x = stride_dy = stride_dh = D
            odd = D & 15
            plans = backward_plan(*call, odd, shared, round_xhat)
        if plans is None:
            raise refusal(D, e, dh is not None, device, narrow_loads(D, e))
    plan = plans[0]
    # placeholders where a tensor is absent: never read or written then
    w = x if weight is None else weight
    ow = stats if dweight is None else dweight
    ob = stats if dbias is None else dbias
    # every pointer must be 16-byte aligned for the kept kernels (else Triton's path, keys None;
    # the partials' and the slots' alignment follows from the keys: allocated by D and groups)
    aligned = not (x.data_ptr() | dy.data_ptr() | dhp.data_ptr() | dx.data_ptr() | w.data_ptr()
                   | stats.data_ptr() | ow.data_ptr() | ob.data_ptr()) & 15
    main_key, finish_key = launch_keys(plans, x, dy, dhp, w, ow, ob, stride_x, stride_dy,
                                       stride_dh, M, D) if aligned else (None, None)
    if plan.simple:     # the common case: one launch of whole rows, no finish
        launch(_KERNELS[plan.kernel], plan.grid, (x, dy, dhp, dx, w, stats, ow, ob, stride_x,
                                                  stride_dy, stride_dh, M, D), plan.flags,
               main_key, device)
        return dx, dweight, dbias
    if len(plans) == 1:   # one group writes the sums over rows itself
        pw, pb = ow, ob
    else:                                   # fp32 partial sums, one (D,) row per group
        pw, pb = x.new_empty(2, plan.groups, D, dtype=torch.float32)
    kernel = _KERNELS[plan.kernel]
    args = (x, dy, dhp, dx, w, stats, pw, pb, stride_x, stride_dy, stride_dh, M, D)
    sharing = plan.slices > 1
    if sharing:   # groups of S programs, one per slice of a row, exchanging sums
        # the slots' epoch taken and the launch put on the stream under one lock (see _slots)
        _slot_lock.acquire()
    try:
        if sharing:
            args = (*args[:6], *_slots(plan, M, x, device, kept_slots), *args[6:])
        if not plan.measured:   # a GPU, the kernel's first launch: size the grid by what it needs
            if measure(kernel, plan, args, device) and (
                    backward_plan(*call, odd, shared, round_xhat) or (plan,))[0].measured:
                # the plan again, with the grid the compiled kernel's programs per SM give (no
                # plan left, or none measured: this one, launched as it is)
                return norm_backward(dy, dh, x, weight, stats, bias_dtype, is_rms,
                                     round_xhat, kept_slots)  # measured
        if sharing:
            launch_shared(kernel, plan, args, main_key, device)
        else:
            launch(kernel, plan.grid, args, plan.flags, main_key, device)
    finally:
        if sharing:
            _slot_lock.release()
    if len(plans) > 1:
        # the one small reduction, (groups, D) -> (D,), in a fixed order: deterministic
        finish = plans[1]
        launch(_KERNELS[finish.kernel], finish.grid, (pw, pb, ow, ob, plan.groups, D),
               finish.flags, finish_key, device)
    return dx, dweight, dbias
