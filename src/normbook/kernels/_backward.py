"""Backward kernels, equations (ln-ghat), (ln-c), (ln-dx), (ln-dparams) of "The backward pass",
(rms-dx) of "RMSNorm" and (fork-rule) of "Residual connections and the fork rule".

Per row, with xhat recomputed from x, mean and rstd (never saved):
    ghat = dy * weight,   c1 = mean_d(ghat),   c2 = mean_d(ghat * xhat),
    dx = (ghat - c1 - c2 * xhat) * rstd          (RMSNorm: no c1)
and across rows dweight = sum_n dy * xhat, dbias = sum_n dy.

The parameter gradients are a reduction over M rows. Programs of a persistent grid (a fixed
number, see ``_config.persistent_programs``) each loop over their rows and keep fp32 partial
sums, write one (D,) partial each, and ``partials.sum(0)`` finishes: no atomics, no locks, the
same summation order every run, so the result is bitwise reproducible.

Kernels, chosen by row length:
- ``norm_bwd_rows_kernel``: ROWS whole rows at a time in registers, one read of x and dy.
- ``norm_bwd_stats_kernel`` then ``norm_bwd_chunked_kernel``: for wide rows, c1 and c2 are
  computed first chunk by chunk (two fp32 scalars per row), then a grid over (programs,
  column chunks) forms dx and the partials with each chunk's accumulators in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normbook.kernels._config import backward_config, persistent_programs


@triton.jit
def norm_bwd_rows_kernel(
    X,                       # (M, D) forward input (s when the residual add was fused)
    DY,                      # (M, D) gradient arriving at y, rows stride_dy apart
    DS,                      # (M, D) gradient arriving at s, rows stride_ds apart (if HAS_DS)
    DX,                      # (M, D) output dx, contiguous
    W,                       # (D,) weight gamma (if HAS_WEIGHT)
    Mean,                    # (M,) fp32 mean saved by the forward (LayerNorm only)
    Rstd,                    # (M,) fp32 rstd saved by the forward
    DW,                      # (programs, D) fp32 output: this program's partial dweight
    DB,                      # (programs, D) fp32 output: this program's partial dbias
    stride_x,                # row stride of X, in elements
    stride_dy,               # row stride of DY, in elements
    stride_ds,               # row stride of DS, in elements
    M,                       # number of rows
    D,                       # row length
    IS_RMS: tl.constexpr,    # RMSNorm: no c1, no dbias
    HAS_DS: tl.constexpr,    # fused residual: add the gradient arriving at s (fork rule)
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,      # rows per step of the loop
    BLOCK_D: tl.constexpr,   # next_power_of_2(D): the whole row in registers
):
    """(ln-dx) and (ln-dparams), or (rms-dx); with HAS_DS the (fork-rule). Persistent grid."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)                                  # (BLOCK_D,)
    col_mask = cols < D
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)              # partial sum_n dy * xhat
    db = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)              # partial sum_n dy
    for first in range(pid * ROWS, M, programs * ROWS):
        rows = first + tl.arange(0, ROWS)                         # (ROWS,)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]              # (ROWS, BLOCK_D)
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)[:, None]
        # xhat recomputed from two saved scalars per row (ln-xhat); padding stays zero
        if IS_RMS:
            xhat = x * rstd
        else:
            mean = tl.load(Mean + rows, mask=row_mask, other=0.0)[:, None]
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        ghat = dy * w if HAS_WEIGHT else dy                       # (ln-ghat)
        # c1: component of ghat along 1; c2: along xhat (ln-c). dx removes both (ln-dx).
        c2 = tl.sum(ghat * xhat, axis=1)[:, None] / D             # (ROWS, 1)
        if IS_RMS:
            dx = (ghat - c2 * xhat) * rstd                        # (rms-dx)
        else:
            c1 = tl.sum(ghat, axis=1)[:, None] / D                # (ROWS, 1)
            dx = (ghat - c1 - c2 * xhat) * rstd                   # (ln-dx)
        if HAS_DS:
            # fork rule: s feeds the norm and the next residual; the gradients add
            dx += tl.load(DS + rows64 * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows64 * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        # (ln-dparams), kept per program in fp32; one weight serves every row
        if HAS_WEIGHT:
            dw += dy * xhat
        if HAS_BIAS:
            db += dy
    if HAS_WEIGHT:
        tl.store(DW + pid * D + cols, tl.sum(dw, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB + pid * D + cols, tl.sum(db, axis=0), mask=col_mask)


@triton.jit
def norm_bwd_stats_kernel(
    X,                       # (M, D) forward input (s when the residual add was fused)
    DY,                      # (M, D) gradient arriving at y, rows stride_dy apart
    W,                       # (D,) weight gamma (if HAS_WEIGHT)
    Mean,                    # (M,) fp32 mean saved by the forward (LayerNorm only)
    Rstd,                    # (M,) fp32 rstd saved by the forward
    C1,                      # (M,) fp32 output: c1 = mean_d(ghat) (LayerNorm only)
    C2,                      # (M,) fp32 output: c2 = mean_d(ghat * xhat)
    stride_x,                # row stride of X, in elements
    stride_dy,               # row stride of DY, in elements
    D,                       # row length, any size
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_D: tl.constexpr,   # chunk width
):
    """(ln-c) for rows wider than the registers: c1 and c2 of one row per program, chunk by chunk."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    rstd = tl.load(Rstd + row)
    if not IS_RMS:
        mean = tl.load(Mean + row)
    sum_ghat = tl.zeros((BLOCK_D,), dtype=tl.float32)
    sum_ghat_xhat = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        c = start + cols
        mask = c < D
        x = tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        if HAS_WEIGHT:
            ghat = dy * tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
        else:
            ghat = dy
        sum_ghat += ghat
        sum_ghat_xhat += ghat * xhat
    if not IS_RMS:
        tl.store(C1 + row, tl.sum(sum_ghat, axis=0) / D)
    tl.store(C2 + row, tl.sum(sum_ghat_xhat, axis=0) / D)


@triton.jit
def norm_bwd_chunked_kernel(
    X,                       # (M, D) forward input (s when the residual add was fused)
    DY,                      # (M, D) gradient arriving at y, rows stride_dy apart
    DS,                      # (M, D) gradient arriving at s, rows stride_ds apart (if HAS_DS)
    DX,                      # (M, D) output dx, contiguous
    W,                       # (D,) weight gamma (if HAS_WEIGHT)
    Mean,                    # (M,) fp32 mean saved by the forward (LayerNorm only)
    Rstd,                    # (M,) fp32 rstd saved by the forward
    C1,                      # (M,) fp32 c1 from norm_bwd_stats_kernel (LayerNorm only)
    C2,                      # (M,) fp32 c2 from norm_bwd_stats_kernel
    DW,                      # (programs, D) fp32 output: partial dweight, row = program
    DB,                      # (programs, D) fp32 output: partial dbias, row = program
    stride_x,                # row stride of X, in elements
    stride_dy,               # row stride of DY, in elements
    stride_ds,               # row stride of DS, in elements
    M,                       # number of rows
    D,                       # row length, any size
    IS_RMS: tl.constexpr,
    HAS_DS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,   # chunk width
):
    """(ln-dx), (rms-dx), (ln-dparams) and (fork-rule) for wide rows: grid (programs, chunks)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)        # this program's columns
    mask = c < D
    if HAS_WEIGHT:
        w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    db = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for row in range(pid.to(tl.int64), M, programs):             # int64: M * D may pass 2^31
        x = tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        c2 = tl.load(C2 + row)
        if IS_RMS:
            xhat = x * rstd
            dx = ((dy * w if HAS_WEIGHT else dy) - c2 * xhat) * rstd          # (rms-dx)
        else:
            xhat = tl.where(mask, (x - tl.load(Mean + row)) * rstd, 0.0)
            c1 = tl.load(C1 + row)
            dx = ((dy * w if HAS_WEIGHT else dy) - c1 - c2 * xhat) * rstd     # (ln-dx)
        if HAS_DS:
            dx += tl.load(DS + row * stride_ds + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * D + c, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dw += dy * xhat
        if HAS_BIAS:
            db += dy
    if HAS_WEIGHT:
        tl.store(DW + pid * D + c, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB + pid * D + c, db, mask=mask)


def norm_backward(dy, ds, x, weight, mean, rstd, has_bias: bool, is_rms: bool):
    """(ln-dx), (rms-dx), (ln-dparams) and (fork-rule): launch the backward on (M, D) rows.

    ``x`` and ``dy`` have contiguous last dims; their row strides are honoured.

    Args:
        dy: (M, D) gradient at y; ds: (M, D) gradient at s, or None (no fused residual).
        x: (M, D) the forward's normalized input (s when the residual was fused).
        weight: (D,) or None; mean: (M,) fp32 (unused for RMSNorm); rstd: (M,) fp32.

    Returns:
        dx: (M, D) contiguous, x's dtype; dweight, dbias: (D,) fp32, or empty when there is no
        weight / no bias.
    """
    M, D = x.shape
    dev = x.device
    dx = torch.empty((M, D), dtype=x.dtype, device=dev)

    def zeros(present):  # a fresh tensor each: custom op outputs must not alias one another
        return torch.zeros((D,) if present else (0,), dtype=torch.float32, device=dev)

    if M == 0:
        return dx, zeros(weight is not None), zeros(has_bias)
    cfg = backward_config(M, D)
    programs = persistent_programs(dev, triton.cdiv(M, cfg.ROWS))
    part_w = torch.empty((programs, D) if weight is not None else (0,), dtype=torch.float32, device=dev)
    part_b = torch.empty((programs, D) if has_bias else (0,), dtype=torch.float32, device=dev)
    w = weight if weight is not None else x             # placeholders: never read when absent
    dsp = ds if ds is not None else dy
    mean_p = mean if not is_rms else rstd
    pw = part_w if weight is not None else rstd
    pb = part_b if has_bias else rstd
    flags = dict(IS_RMS=is_rms, HAS_DS=ds is not None, HAS_WEIGHT=weight is not None,
                 HAS_BIAS=has_bias)
    if not cfg.chunked:
        norm_bwd_rows_kernel[(programs,)](
            x, dy, dsp, dx, w, mean_p, rstd, pw, pb, x.stride(0), dy.stride(0), dsp.stride(0),
            M, D, **flags, ROWS=cfg.ROWS, BLOCK_D=cfg.BLOCK_D, **cfg.launch())
    else:
        c1 = torch.empty((0,) if is_rms else (M,), dtype=torch.float32, device=dev)
        c2 = torch.empty((M,), dtype=torch.float32, device=dev)
        c1_p = c1 if not is_rms else c2
        norm_bwd_stats_kernel[(M,)](
            x, dy, w, mean_p, rstd, c1_p, c2, x.stride(0), dy.stride(0), D,
            IS_RMS=is_rms, HAS_WEIGHT=weight is not None, BLOCK_D=cfg.BLOCK_D,
            **cfg.launch())
        grid = (programs, triton.cdiv(D, cfg.BLOCK_D))
        norm_bwd_chunked_kernel[grid](
            x, dy, dsp, dx, w, mean_p, rstd, c1_p, c2, pw, pb, x.stride(0), dy.stride(0),
            dsp.stride(0), M, D, **flags, BLOCK_D=cfg.BLOCK_D, **cfg.launch())
    # the one small reduction, (programs, D) -> (D,), fixed order: deterministic
    dweight = part_w.sum(0) if weight is not None else zeros(False)
    dbias = part_b.sum(0) if has_bias else zeros(False)
    return dx, dweight, dbias
