"""The norms in plain, differentiable torch ops, for production rather than for reading.

:mod:`normbook.reference` is the derivation written with the book's einsum strings: the oracle,
exact in float64. In fp32 on a CPU a two-operand einsum reduction (``"nd,nd->n"``) is a long
sequential chain whose error grows with D (a one-operand one, ``"nd->n"``, is torch's ``sum``);
this module computes the same equations with torch's vectorised reductions (``sum``/``mean``,
error growing like log D) and with a scale-safe variance, and it is what
the CPU path computes with. Every function is made of differentiable torch ops, so it also
serves double backward (when autograd builds a graph of the backward), the forward-mode
tangent (jvp) and batching (vmap) of both paths.

Shapes: x, dy (..., D); weight, bias (D,) or None; mean, rstd (..., 1).
"""

from __future__ import annotations

import itertools
import threading

import torch
import torch.autograd.forward_ad as _fwAD


def _rsqrt_ms(xc: torch.Tensor, eps) -> torch.Tensor:
    """1 / sqrt(mean(xc^2) + eps), (..., 1), finite where mean(xc^2) alone would overflow.

    fp32 values past about 1e19 square to inf, and the plain formula would then give rstd = 0
    and an output of zeros. Such rows are divided by their largest |value| a first (|u| <= 1,
    nothing overflows) and a is taken back out of the root, as the kernels do:
    1 / sqrt(a^2 mean(u^2) + eps) = (1/a) / sqrt(mean(u^2) + eps / a^2).
    Where the values are not at hand (see :func:`_has_values`) both forms are computed and
    selected per row, without a branch on the data; a is at least 1 there, so that neither
    form of a zero row is 0/0 (whose NaN a second derivative through the unselected form would
    pick up).
    """
    ms = (xc * xc).mean(-1, keepdim=True)
    if _has_values(xc) and not torch.isinf(ms).any():
        return torch.rsqrt(ms + eps)
    if hasattr(xc, "placements"):
        # a DTensor split over the features, whose ranks may hold none of them (9 over 4
        # ranks: 3, 3, 3, 0), and amax refuses an empty dim: a = mean |xc| instead, which
        # any split sums, with |u| <= D (D^3 far from overflowing), a rounding more
        a = (xc.abs() / xc.shape[-1]).sum(-1, keepdim=True).clamp_min(1.0)
    elif xc.shape[-1] == 0:     # D = 0: amax has no identity; an empty row's ms is NaN
        return torch.rsqrt(ms + eps)
    else:
        a = xc.abs().amax(-1, keepdim=True).clamp_min(1.0)   # (..., 1)
    u = xc / a                                           # |u| <= 1 (a DTensor's <= D)
    safe = torch.rsqrt((u * u).mean(-1, keepdim=True) + eps / (a * a)) / a
    # (a row holding an infinity keeps rstd = 0, as torch's: NaN where it is, 0 elsewhere)
    return torch.where(torch.isinf(ms) & torch.isfinite(a), safe, torch.rsqrt(ms + eps))


def _has_values(t: torch.Tensor) -> bool:
    """Whether Python may branch on ``t``'s values: a plain eager tensor that holds data. Not
    under torch.compile or torch.export (a branch would guard on data or break the graph), nor
    torch.func transforms, nor for meta or fake tensors (no values), nor a subclass, nor a
    tensor batched by the legacy vmap that autograd's batched gradients use."""
    return not (_traced() or not _plain(t))


def _traced() -> bool:
    """Whether a tracer or a torch.func transform sees the ops (see :func:`_has_values`)."""
    return (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch.jit.is_tracing())


def _plain(t: torch.Tensor) -> bool:
    """A plain tensor with data: a Tensor or a Parameter (a module's weight, in backward too:
    autograd hands a saved leaf back as itself), not another subclass, not meta, not
    legacy-batched."""
    return type(t) in _PLAIN_TYPES and not t.is_meta and not _is_legacy_batched(t)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


_is_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda t: False)


def _eager(*ts) -> bool:
    """Whether a call may take torch's fused kernels and work in place on its own temporaries:
    every tensor given has values at hand (:func:`_has_values`) and autograd records no graph
    of the call (double backward does, through these formulas), nor forward-mode AD, whose
    tangents the ``out=`` and in-place steps would not carry. Traced, transformed, recorded
    and dual calls keep the plain formulas. (The conditions that hold for the whole call are
    asked once, not per tensor: this runs on every call of the torch backend.)"""
    if _fwAD._current_level >= 0 or _traced():
        return False
    grad = torch.is_grad_enabled()
    return all(t is None or (_plain(t) and not (grad and t.requires_grad)) for t in ts)


def _all_positive(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is > 0; False where one is NaN (the smallest is then NaN).
    One reduction and one read: about 3 us less than ``(t > 0).all()`` per call."""
    return not t.numel() or t.amin().item() > 0


def _cast(t, dtype):
    """t in ``dtype``; t itself (or None) where it already is, as ``t.to(dtype)`` would return
    it, without the call (about a microsecond each, and a backward makes a dozen)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def stats(x: torch.Tensor, eps, is_rms: bool):
    """(mean, rstd) of each row, (..., 1) each; mean is None for RMSNorm.
    (ln-mean), (ln-var), (ln-rstd); (rms-ms) for RMSNorm."""
    if is_rms:
        return None, _rsqrt_ms(x, eps)
    mean = x.mean(-1, keepdim=True)
    # corrected once by the mean of what it leaves: a change within its rounding, except on a
    # row of equal values, whose plain mean can miss the value (float64: 3.7 three times).
    # What that mean leaves is then one small multiple of the value's last place throughout,
    # whose mean is exact, so the corrected mean is the value itself: x - mean is exactly 0
    # and y exactly the bias, as torch's fused kernel gives
    mean = mean + (x - mean).mean(-1, keepdim=True)
    return mean, _rsqrt_ms(x - mean, eps)


def xhat(x, mean, rstd):
    """(ln-xhat): (x - mean) * rstd; RMSNorm (mean None): x * rstd."""
    return (x if mean is None else x - mean) * rstd


def forward(x, weight, bias, eps, is_rms: bool):
    """y, mean, rstd: (ln-y) or (rms-y).

    An fp32 LayerNorm that no graph records (see :func:`_eager`) takes torch's fused kernel,
    ``torch.native_layer_norm``: the same (ln-mean), (ln-var) (biased, eps inside the root),
    (ln-rstd) and (ln-y), in one pass over memory instead of several. A call with a row it
    cannot finish (the variance overflows, rstd 0 or NaN; or var + eps < 0) is computed again
    by the formulas below, which rescue the overflowing rows. float64 keeps the formulas: it
    is the precision other code compares against, and its extra passes cost little there."""
    if (not is_rms and x.dtype == torch.float32 and x.shape[-1] and isinstance(eps, float)
            and _eager(x, weight, bias)
            and all(p is None or (p.dim() == 1 and p.dtype == x.dtype) for p in (weight, bias))):
        y, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        if _all_positive(rstd):                          # False for NaN: those rows fall back
            return y, mean, rstd
    mean, rstd = stats(x, eps, is_rms)
    y = xhat(x, mean, rstd)                              # (..., D), fresh
    in_place = (_eager(x, weight, bias)                  # only where no graph records
                and all(p is None or p.dtype == y.dtype for p in (weight, bias)))
    mul, add = (torch.Tensor.mul_, torch.Tensor.add_) if in_place else (torch.mul, torch.add)
    if weight is not None:
        y = mul(y, weight)
    if bias is not None:
        y = add(y, bias)
    return y, mean, rstd


def backward(dy, x, weight, mean, rstd, has_bias: bool):
    """dx, dweight, dbias: (ln-ghat), (ln-c), (ln-dx), (ln-dparams); RMSNorm when mean is None.

    dweight and dbias sum over every leading dim; dbias is None without a bias, dweight None
    without a weight. Where no graph records (the usual backward, see :func:`_eager`), in fp32,
    a LayerNorm takes the same terms in torch's fused kernel on the centred rows
    (:func:`_backward_fused`, unless a row's rstd is extreme), and otherwise a call of at
    least ``_BLOCKED_MIN`` values takes them in fewer passes over memory by
    :func:`_backward_eager` (a smaller one fits in cache anyway); float64, the precision other
    code compares against (the feature-sharded norms to 1e-12, say), keeps the formulas.
    """
    # float64 keeps the formulas, as forward
    if (mean is not None and dy.dtype == x.dtype == torch.float32
            and (weight is None or weight.dtype == torch.float32)
            and _takes_fused(dy, x, weight, mean, rstd)):
        return _backward_fused(dy, x, weight, mean, rstd, has_bias)
    if (weight is not None and dy.dtype == x.dtype == weight.dtype == torch.float32
            and _takes_blocks(dy, x, weight, mean, rstd)):
        return _backward_eager(dy, x, weight, mean, rstd, has_bias)
    xh = xhat(x, mean, rstd)                                   # (..., D)
    ghat = dy if weight is None else dy * weight               # (ln-ghat)
    c2 = (ghat * xh).mean(-1, keepdim=True)                    # component along xhat
    if mean is None:
        dx = (ghat - c2 * xh) * rstd                           # (rms-dx)
    else:
        c1 = ghat.mean(-1, keepdim=True)                       # component along 1
        dx = (ghat - c1 - c2 * xh) * rstd                      # (ln-dx)
    dweight = None if weight is None else _sum_tokens(dy * xh)   # (ln-dparams)
    dbias = _sum_tokens(dy) if has_bias else None
    return dx, dweight, dbias


# Values up to which :func:`_backward_fused` centres fp32 CPU rows all at once, into this
# thread's scratch buffer (:func:`_scratch_rows`), and hands back the kernel's dx as it is.
# Larger calls, and bf16/fp16 rows (which the kernel is to read in fp32), are centred a block
# at a time into a buffer that stays in cache, each block's dx copied into place (a pass more,
# and a few small ops per block). The bound is what the scratch may hold on to: 16 MiB.
_FUSED_MAX = 1 << 22

# rstd within which the fused kernel's rstd^3 (times a row sum of g * xc, of the size of
# D |g| / rstd) stays a normal fp32 number: x of any scale from 2^-24 to 2^24 per unit of
# standard deviation. A row outside it (rstd near 1e-20 for values near 1e20; NaN) sends the
# whole call to the other paths, which never form a power of rstd.
_FUSED_RSTD = (2.0 ** -24, 2.0 ** 24)


def _takes_fused(dy, x, weight, mean, rstd) -> bool:
    """Whether a LayerNorm backward of these tensors takes :func:`_backward_fused`: no graph
    records it (:func:`_eager`), it has a value (D > 0), and every row's rstd lies within
    ``_FUSED_RSTD``. The caller checks the dtypes."""
    if not (_eager(dy, x, weight, mean, rstd) and x.numel()):
        return False
    lo, hi = rstd.aminmax()
    return _FUSED_RSTD[0] <= lo.item() and hi.item() <= _FUSED_RSTD[1]   # False for NaN


_native_backward = torch.ops.aten.native_layer_norm_backward.default

_scratch = threading.local()


def _scratch_rows(n: int, D: int) -> torch.Tensor:
    """An (n, D) fp32 CPU buffer of this thread's, for :func:`_backward_fused`'s centred rows:
    kept from call to call (grown to at most ``_FUSED_MAX`` values), not allocated afresh.

    A fresh temporary as large as x, on top of the forward's y and the backward's dx, made the
    memory each call frees at the top of glibc's heap exceed its trim threshold (twice the
    largest block it has mapped and freed, 32 MiB for 16 MiB rows): the heap went back to the
    system, and the next call took its memory again in page faults, 4096-8192 at about a
    microsecond each, in about a third of the calls at 4096 x 1024 fp32 (and in every call of
    some runs: ``normbook-bench cpu`` gave 1.34-2.32x torch's forward + backward over ten
    runs). With the scratch, a call frees what torch's own frees, y and dx: 1.32-1.43x in
    five runs.
    The kernel reads the buffer and returns before the backward does, and each thread has its
    own, so no two calls share one. It is made outside inference mode, so that a backward run
    inside ``torch.inference_mode()`` and one run outside can use the same buffer."""
    buf = getattr(_scratch, "rows", None)
    if buf is None or buf.numel() < n * D:
        _scratch.rows = None                       # the old one freed before the new is made
        with torch.inference_mode(False):          # a normal tensor: see above
            buf = _scratch.rows = torch.empty(n * D, dtype=torch.float32, device="cpu")
    return buf[: n * D].view(n, D)


def _backward_fused(dy, x, weight, mean, rstd, has_bias: bool):
    """:func:`backward` of a LayerNorm, when nothing records a graph: the book's centred
    (ln-dx), evaluated by torch's fused backward kernel on the centred rows.

    Given rows x and their mean and rstd (= a), ``torch.ops.aten.native_layer_norm_backward``
    computes dx = a * ghat + b * x + c per row, with b = (mean * sum(ghat) - sum(ghat * x))
    * a^3 / D and c = -b * mean - a * sum(ghat) / D. On x itself, b is the difference of two
    row sums that nearly cancel where |mean| is many standard deviations: the loss of digits
    the book's form avoids by centring first. Handed xc = x - mean and a mean of 0, it sums
    ghat * xc directly, and its terms are those of (ln-dx): b * xc = -a * xhat * mean(ghat *
    xhat) and c = -a * mean(ghat); its dweight is sum(dy * xc * a) and its dbias sum(dy),
    (ln-dparams). That is one subtraction and one fused pass, where :func:`_backward_eager`
    takes some nine passes over each block. Measured against float64 at 4096 x 1024, with
    |mean| some 330 standard deviations: largest errors, relative to the largest value, dx
    1.0e-7, dweight 1.1e-6 and dbias 9.3e-7, the blocks' 0.9e-7, 1.3e-6 and 9.8e-7; torch's
    kernel on x itself gives 3.2e-6, 1.0e-5 and 9.3e-7.

    The kernel works in the dtype of the rows it is given, here the weight's (fp32): bf16 and
    fp16 rows are copied into fp32 a block at a time (as large calls are; see ``_FUSED_MAX``),
    so that dweight and dbias sum in fp32 (torch's kernel on bf16 rows sums them in bf16: 8e-2
    of dweight's largest value, measured at 4096 x 1024), and dx is written back in x's dtype.
    """
    D = x.shape[-1]
    ct = torch.float32 if weight is None else weight.dtype            # the compute dtype
    X, G = x.reshape(-1, D), dy.reshape(-1, D)                         # (N, D)
    R = _cast(rstd.reshape(-1, 1), ct).contiguous()                    # (N, 1), read flat
    Mu = _cast(mean.reshape(-1, 1), ct)                                # (N, 1)
    like = X.new_empty(D, dtype=ct) if weight is None else weight      # dbias's shape, dtype
    mask = [True, weight is not None, has_bias]
    if X.dtype == ct and X.numel() <= _FUSED_MAX:                      # all rows at once
        scratch = X.is_cpu and ct == torch.float32         # (a GPU's allocator keeps memory)
        xc = torch.sub(X, Mu, out=_scratch_rows(*X.shape)) if scratch else X - Mu
        dx, dweight, dbias = _native_backward(G, xc, (D,), torch.zeros_like(R), R, weight,
                                              like, mask)
        return dx.view(x.shape), dweight, dbias
    low = X.dtype != ct                                                # bf16/fp16 rows
    rows = max(_FUSED_MIN_ROWS, _BLOCK_PER_THREAD * torch.get_num_threads() // D)
    n0 = min(rows, X.shape[0])
    dx = torch.empty_like(X)                                           # (N, D), x's dtype
    xbuf = X.new_empty(n0, D, dtype=ct)                                # xc of a block
    gbuf = X.new_empty(n0, D, dtype=ct) if low else None               # dy of a block, fp32
    zero = X.new_zeros(n0, 1, dtype=ct)
    dweight = X.new_zeros(D, dtype=ct) if weight is not None else None
    dbias = X.new_zeros(D, dtype=ct) if has_bias else None
    for xb, gb, mb, rb, db in zip(X.split(rows), G.split(rows), Mu.split(rows), R.split(rows),
                                  dx.split(rows)):
        if xb.shape[0] != n0:                                          # the last, short block
            n0 = xb.shape[0]
            xbuf, zero = xbuf[:n0], zero[:n0]
            gbuf = gbuf[:n0] if low else None
        if low:          # copied first: a step that mixes dtypes is not vectorised
            xc, gb = xbuf.copy_(xb).sub_(mb), gbuf.copy_(gb)
        else:
            xc = torch.sub(xb, mb, out=xbuf)
        bdx, bdw, bdb = _native_backward(gb, xc, (D,), zero, rb, weight, like, mask)
        db.copy_(bdx)
        if dweight is not None:
            dweight += bdw
        if dbias is not None:
            dbias += bdb
    return dx.view(x.shape), dweight, dbias


# Rows per block of :func:`_backward_fused` at least: each block adds its (D,) dweight and
# dbias into the totals, work of the order of D however few its rows, so wide rows take blocks
# larger than the cache holds. Measured, LayerNorm 64 x 131072 bf16 forward + backward on 2
# threads: blocks of 2 rows 20.6 ms, of 8 rows 15.2 ms (torch's own 7.9-10.4 ms in those runs).
_FUSED_MIN_ROWS = 8

# Values per block of the eager backward, per intra-op thread: 2^17 (half a MiB in fp32), so
# that the buffers a pass touches (x, dy, x - mean, dy * (x - mean)) stay in a core's L2 cache
# between the passes, whichever share of each op's rows a thread takes. Measured on a 2-core
# machine with 2 MiB of L2 per core, 4096 x 1024 fp32: 2^17 per thread beats 2^16 and 2^18 on
# one thread and on two (op overhead below, cache misses above).
_BLOCK_PER_THREAD = 1 << 17

# Values below which the backward keeps the plain formulas: :func:`_backward_eager` makes some
# 35 small ops to the formulas' 14, and a call this small fits in cache either way. Measured,
# LayerNorm fp32, 1 and 2 threads: 4 x 64 takes 22 us by the formulas and 42 blocked, 64 x 256
# 39 and 53; 64 x 1024 (65536 values) 88-119 and 92; 256 x 1024 351-2204 and 257-416.
_BLOCKED_MIN = 1 << 15


def _takes_blocks(dy, x, *ts) -> bool:
    """Whether a backward of these tensors takes :func:`_backward_eager`: nothing records a
    graph of it (:func:`_eager`), it holds at least ``_BLOCKED_MIN`` values, and its rows are
    not of D = 0 (no blocks to take). The callers add what they require of the dtypes.
    (:func:`_eager` first: a traced call, whose sizes may be symbolic, reads none of them.)"""
    return _eager(dy, x, *ts) and x.numel() >= _BLOCKED_MIN and bool(x.shape[-1])


def _backward_eager(dy, x, weight, mean, rstd, has_bias: bool):
    """:func:`backward` with a weight, when nothing records a graph: the same terms, taken a
    block of rows at a time in as few passes over the block as torch's ops allow.

    With g = dy and xc = x - mean (x itself for RMSNorm), so that xhat = rstd * xc:

    - p = g * xc, formed once, serves twice: against the weight it is the row sum that gives
      c2 = mean(ghat * xhat) = rstd * mean(g * weight * xc) (a matrix-vector product), and
      scaled by rstd and summed over tokens it is dweight (ln-dparams). c1 = mean(g * weight)
      is a matrix-vector product of g, dbias its sum over tokens.
    - dx = rstd * ((g * weight - c1) - c2 * rstd * xc), (ln-dx), in three passes, the bracket
      formed in p's buffer (``addcmul`` with c1 and the weight, then with c2 * rstd and xc).

    Each elementwise step broadcasts at most one per-row column: torch vectorises those, and
    not a step that broadcasts two. Each block's passes run over data still in cache, and the
    only (..., D) allocation is dx (fp32 xc is formed in dx's block). x and dy may be bf16 or
    fp16 with the weight and the statistics in fp32: each block is then copied into fp32
    buffers first (a step that mixes dtypes is not vectorised) and its dx written back in x's
    dtype. The sums over tokens are torch's ``sum`` over a block's rows, which adds them
    pairwise, and the blocks in turn. (Matrix-vector products, ``addmv``, took them in a third
    of the time but added a block's rows one after another: with rows of a common sign,
    dweight's error grew with the rows, 10 to 40 times torch's own backward's in float32 from
    4096 x 1024 to 65536 x 8. The sums are within torch's; the backward takes 7 to 18% longer
    for them, measured on 2 CPU threads from 65536 x 8 to 4096 x 4096, bf16 and fp32.)
    """
    D = x.shape[-1]
    ct = weight.dtype                                                  # the compute dtype
    X, G = x.reshape(-1, D), dy.reshape(-1, D)                         # (N, D)
    R = _cast(rstd.reshape(-1, 1), ct)                                 # (N, 1)
    Mu = None if mean is None else _cast(mean.reshape(-1, 1), ct)      # (N, 1)
    w_d, nw_d = weight / D, weight / -D                                # (D,)
    nR = R.neg()                                                       # (N, 1)
    low = X.dtype != ct                                                # bf16/fp16 rows
    dx = torch.empty_like(X)                                           # (N, D), x's dtype
    rows = max(1, _BLOCK_PER_THREAD * torch.get_num_threads() // max(D, 1))
    n0 = min(rows, X.shape[0])
    # a block's buffers, and the views of them each pass takes, made once: a block takes a
    # dozen small ops besides its passes, and each op's overhead counts
    p = X.new_empty(n0, D, dtype=ct)                                   # g * xc, then the bracket
    xbuf = X.new_empty(n0, D, dtype=ct) if low else None               # x, then xc, in fp32
    gbuf = X.new_empty(n0, D, dtype=ct) if low else None               # dy in fp32
    coef, c1 = X.new_empty(n0, dtype=ct), X.new_empty(n0, dtype=ct)    # per row, (ln-c)
    dweight = X.new_zeros(D, dtype=ct)
    dbias = X.new_zeros(D, dtype=ct) if has_bias else None
    # the blocks as views made in one call each (slicing in the loop cost 2-8% of the
    # backward). Rows that make one block are taken whole: eight splits cost a small call
    # more than its passes.
    if X.shape[0] <= rows:
        blocks = ((X, G, R, nR, dx, Mu),)
    else:
        blocks = zip(X.split(rows), G.split(rows), R.split(rows), nR.split(rows),
                     dx.split(rows), Mu.split(rows) if Mu is not None else itertools.repeat(None))
    coef_c, c1_c = coef.unsqueeze(-1), c1.unsqueeze(-1)
    for xb, gb, rb, nb, db, mb in blocks:
        if xb.shape[0] != n0:                                          # the last, short block
            n = xb.shape[0]
            p, coef, c1 = p[:n], coef[:n], c1[:n]
            coef_c, c1_c = coef.unsqueeze(-1), c1.unsqueeze(-1)
            xbuf, gbuf = (xbuf[:n], gbuf[:n]) if low else (None, None)
        if low:
            xc, gb = xbuf.copy_(xb), gbuf.copy_(gb)
            if mb is not None:
                xc.sub_(mb)
        else:
            xc = xb if mb is None else torch.sub(xb, mb, out=db)       # in dx's block
        torch.mul(gb, xc, out=p)                                       # g * xc
        # -c2 * rstd, (ln-c), one factor rstd at a time (rstd^2 of a row near 1e20 would be
        # subnormal in fp32)
        torch.mv(p, w_d, out=coef)
        coef_c.mul_(rb).mul_(nb)
        dweight += p.mul_(rb).sum(0)                                   # (ln-dparams)
        if dbias is not None:
            dbias += gb.sum(0)                                         # (ln-dparams)
        if mb is None:
            torch.mul(gb, weight, out=p)                               # ghat
        else:
            torch.mv(gb, nw_d, out=c1)                                 # -c1 in (ln-c)
            torch.addcmul(c1_c, gb, weight, out=p)                     # ghat - c1
        p.addcmul_(xc, coef_c)                                         # ... - c2 * xhat
        if low:
            db.copy_(p.mul_(rb))                                       # times rstd: (ln-dx)
        else:
            torch.mul(p, rb, out=db)                                   # times rstd: (ln-dx)
    return dx.reshape(x.shape), dweight, dbias


def _sum_tokens(t):
    """(..., D) -> (D,): the sum over every leading dim ("nd->d"); a 1-D t is one token, whose
    sum is a copy of it: a gradient handed back must be a tensor of its own, not dy (which the
    caller holds, and which may be an expanded view no one can write to). (``sum(())`` would
    reduce over every dim, hence the special case.)"""
    if t.dim() > 1:
        return t.sum(tuple(range(t.dim() - 1)))
    return t.clone(memory_format=torch.contiguous_format)


def jvp(tx, tw, tb, x, weight, mean, rstd):
    """The forward-mode tangent of y: weight * J tx + tw * xhat + tb, with J the Jacobian
    (ln-jac) applied to tx: rstd * (tx - mean(tx) - xhat * mean(xhat * tx)); RMSNorm has no
    mean(tx) term. Any of the tangents may be None (zero)."""
    xh = xhat(x, mean, rstd)
    ty = None
    if tx is not None:
        c2 = (xh * tx).mean(-1, keepdim=True)
        jt = tx - c2 * xh if mean is None else tx - tx.mean(-1, keepdim=True) - c2 * xh
        ty = jt * rstd if weight is None else jt * rstd * weight
    if tw is not None:
        ty = xh * tw if ty is None else ty + xh * tw
    if tb is not None:
        ty = tb.expand_as(xh) if ty is None else ty + tb
    return ty if ty is not None else torch.zeros_like(xh)
