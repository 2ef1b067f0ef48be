"""The exchange of the kernels that share a row among S programs (``norm_bwd_coop_kernel``):
each program publishes its slice's sums into 64-bit slots, tagged with the row, and waits, for
a bounded number of reads, until its partners' sums are there. The pieces, in the order a row
uses them: where the row's slots are (:func:`_ring`), a value and its tag as one word
(:func:`_pack`), publishing (:func:`_publish`), the bounded wait (:func:`_exchange`), and, for
a wait that ran out, the agreement of the program's warps (:func:`_agreed_start`,
:func:`_agreed`) and the first writer's word (:func:`_claim`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ring(Slots, first, tag, SLICES: tl.constexpr, RING: tl.constexpr):
    """Where the slots of the row tagged ``tag`` are. A group's slots
    are a ring of RING rows (2 on a GPU; 4 one row behind, LAG = 1: see
    the kernel): its i-th row (first + i *
    groups) is tagged epoch + i + 1 and uses the place of that tag
    modulo RING, so a program can publish row i + 1 while its partners
    still read row i, and row i + 2 only once they all have (while no
    wait runs out: after one, a late program's words may land on a later
    row's place, and the tags keep them from being taken for that
    row's). A place is SLICES words a, then SLICES words b (a constexpr
    apart: no register holds the offset). The slots are not zeroed per
    launch: every word an earlier launch left holds a tag of at most
    this launch's epoch, and so counts as empty (the launcher's
    ``_backward._slots``). The interpreter, which runs a group's
    programs one after another, keeps every row of a group, so that the
    slots the first program computes stay for the others."""
    place = first * RING + (tag - 1) % RING   # (tag >= 1: no overflow)
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
def _agreed_start(Slots, pid, groups, deferred, M, lanes, epoch, SLICES: tl.constexpr,
                  RING: tl.constexpr):
    """The first row any warp of the program left for after its loop (``deferred``, M for
    none), the same in every thread: each warp reads the slots at its own moment, so one may
    find a wait run out that another found ended, while the loop after it synchronises the
    program. The warps that left a row raise the program's word past the groups' rings to
    M - their row, tagged epoch + 1 in the high half as a slot's word is (a word of an
    earlier launch has a lower tag: 0 for none) and, after a barrier, every thread reads it
    back. Under a cooperative launch no wait runs out, and nothing is written. (An atomic
    and a barrier rather than a block reduction: the reduction here costs the backward 12
    bytes of spill, in its loop.)"""
    own = Slots + groups * (RING * 2 * SLICES) + pid
    mark = (epoch + 1).to(tl.int64) << 32
    gap = (M - deferred).to(tl.int64)              # > 0: this thread left a row
    tl.atomic_max(own + lanes * 0, mark | gap, mask=lanes * 0 < gap, sem="relaxed")
    tl.debug_barrier()
    word = tl.load(own, volatile=True)
    return M - tl.where((word >> 32) == epoch + 1, word & 0xFFFFFFFF, 0)


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
    that was this row's word already or a later row's (a partner has gone on; a lower tag is
    an earlier row's or an earlier launch's, empty for this row):
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
