"""Which rows the kernels take: every row of at most MAX_FUSED_D_BWD values; a wider one only
while NORMBOOK_SHARED_ROWS is on and the backward has a plan for it (its slices all run at
once on the device). The front door (:mod:`normbook.functional`) asks :func:`kernels_take`
and sends the rest to the torch-ops backend; the backward's launcher raises
:func:`refusal` for rows that reach it anyway. (The forward takes rows of any length.)
"""

from __future__ import annotations

import functools
import os

from normbook.kernels._config import (MAX_FUSED_D_BWD, backward_config, backward_plan, device,
                                      shared_capacity)

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
    NORMBOOK_SHARED_ROWS=0 (or off, false, no) turns the sharing off: rows wider than
    MAX_FUSED_D_BWD then have no plan and take the torch-ops backend, a way around a GPU or
    driver that misbehaves with cooperative launches. Read each time a plan is looked up, so
    that a change takes effect at once (the plans are cached with it); rows narrow enough for
    one program never share and do not read it, which keeps the environment off the hot path
    of small rows."""
    return D > MAX_FUSED_D_BWD and env_switch("NORMBOOK_SHARED_ROWS", True)


def kernels_take(D: int, itemsize: int, has_residual: bool, device_index: int) -> bool:
    """Whether the kernels take rows of D values (of ``itemsize`` bytes, with or without the
    fused residual add) on device ``device_index`` (-1: the interpreter), both directions:
    True for every D <= MAX_FUSED_D_BWD without reading anything; past it, only when
    NORMBOOK_SHARED_ROWS is on (read at every call, :func:`shared_rows`) and a row's slices
    all run at once (cached per shape and device).

    Why not run such rows on the sharing kernel without the cooperative attribute, which
    its bounded wait makes correct at any residency? Only R programs of the S > R of a row
    run at once; each publishes its slice, waits the full bound (EXCHANGE_POLLS reads,
    about 50 ms) and then computes every slice still missing itself, so a row is read
    :func:`normbook.bench.model.unshared_reads` (S, R) times, 1 + R (S - R) / S: at S = 2R
    on an H200 (R = 264 slices of 4096 bf16 values in the backward, rows of over a million
    values) that is 133 reads of each row, where torch ops take a few dozen passes at most
    (autograd through the composed LayerNorm: 12 forward, 33 backward, counted by
    :func:`normbook.bench.counting.count`). Such rows are rare; torch ops serve them faster.
    """
    if D <= MAX_FUSED_D_BWD:
        return True
    return shared_rows(D) and _fits(D, itemsize, has_residual, device_index)


@functools.lru_cache(maxsize=4096)
def _fits(D: int, itemsize: int, has_residual: bool, device_index) -> bool:
    """The backward has a plan for rows of D with contiguous rows (any M: one row is the
    hardest to fit, it needs one group)."""
    return backward_plan(1, D, device_index, itemsize, False, has_residual, True,
                         True) is not None


def widest_shared(itemsize: int, has_residual: bool, device_index, narrow: bool = False) -> int:
    """The widest row the backward has a plan for on the device, whole in one program or
    shared by slices that all run at once (for :func:`refusal`)."""
    dev = device(device_index)
    cfg = backward_config(1, 1 << 40, narrow, itemsize, dev.arch)
    return max(MAX_FUSED_D_BWD, shared_capacity(cfg, dev) * cfg.BLOCK_D)


def refusal(D: int, itemsize: int, has_residual: bool, device_index,
            narrow: bool = False) -> ValueError:
    """The backward launcher's error for rows that no plan takes, naming D and the limit."""
    if not shared_rows(D):
        return ValueError(f"norm_backward: rows of D = {D} values are wider than "
                          f"{MAX_FUSED_D_BWD}, the widest one program holds, and "
                          "NORMBOOK_SHARED_ROWS is off; use the torch-ops backend "
                          "(normbook.layer_norm / normbook.rms_norm route such rows there)")
    limit = widest_shared(itemsize, has_residual, device_index, narrow)
    odd = ", for rows whose loads are narrower than 16 bytes" if narrow else ""
    return ValueError(f"norm_backward: rows of D = {D} values need more programs sharing a row "
                      f"than the device runs at once (at most D = {limit} here{odd}); use the "
                      "torch-ops backend (normbook.layer_norm / normbook.rms_norm route such rows "
                      "there)")
