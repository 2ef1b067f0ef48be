"""Ready calls: a call signature whose launches are kept, launched again with nothing planned.

The front door's fast path (:func:`normbook.functional._norm`) validates a call in a few
attribute reads and looks its signature up in :data:`normbook.kernels._launch.READY`. A hit is
a :class:`Ready`: the forward's kept kernel and grid, the backward's once it has run, and the
sizes. Its :meth:`~Ready.forward` and :meth:`~Ready.backward` allocate the outputs and call
the kept kernels' launchers, exactly as :func:`normbook.kernels._forward.norm_forward` and
:func:`normbook.kernels._backward.norm_backward` do after their planning (the tests compare
the two, argument for argument, under a stub driver).

A signature is made ready by :func:`ready`, after a call through the checks and the launchers
has run it, when everything the launchers decided for it is fixed by the signature: dense
rows of at most MAX_FUSED_D_BWD values (no sharing, so no environment switch), 16-byte
aligned (the door checks the input's and the parameters' pointers on every call; outputs
are fresh), whole-row plans (measured on a GPU), and a kept forward kernel.
"""

from __future__ import annotations

import torch
from triton.runtime import driver as _drivers

from normbook.kernels import _launch
from normbook.kernels._backward import launch_keys
from normbook.kernels._config import MAX_FUSED_D_BWD, backward_plan, forward_plan
from normbook.kernels._forward import launch_key

__all__ = ["Ready", "ready"]

_FP32 = torch.float32


class Ready:
    """The launches of one call signature (shape, dtypes, device, options), kept: see the
    module docstring. ``bwd[has_dh]`` is filled at the first backward without (False) or with
    (True) a gradient at h that finds its kernels kept."""

    __slots__ = ("device", "M", "D", "k", "fwd", "plan_args", "likes", "bwd", "groups", "stream",
                 "empties", "live")

    def forward(self, x, residual, weight, bias, eps: float):
        """(y, h, stats) as ``norm_forward``'s, for x (..., D) and the residual (or None) of
        this signature: y and h in x's shape, stats (k, M) fp32."""
        M, D = self.M, self.D
        y = torch.empty_like(x)
        stats = torch.empty_like(self.empties[0])
        if residual is None:         # placeholders, never touched (see norm_forward)
            h, r, hy = None, x, y
        else:
            h = hy = torch.empty_like(x)
            r = residual
        run, function, metadata, consts, grid = self.fwd
        run(grid, 1, 1, self.stream(self.device), function, metadata,
            None, None, None, x, r, hy, y, x if weight is None else weight,
            x if bias is None else bias, stats, D, D, M, D, eps, *consts)
        return y, h, stats

    def backward(self, dy, dh, x, weight, stats, bias_dtype):
        """(dx, dweight, dbias) as ``norm_backward``'s, or None where this signature's backward
        is not kept yet, or dy or dh (x's shape and dtype, as autograd hands them) are not
        dense and 16-byte aligned: the caller then takes ``norm_backward``."""
        dtype = x.dtype
        if not (dy.dtype is dtype and dy.is_contiguous() and (
                dh is None or (dh.dtype is dtype and dh.is_contiguous()))) or (
                dy.data_ptr() | (0 if dh is None else dh.data_ptr())) & 15:
            return None
        has_dh = dh is not None
        bwd = self.bwd[has_dh] or self._backward_kept(has_dh)
        if bwd is None:
            return None
        groups = self.groups[has_dh]
        M, D = self.M, self.D
        dx = torch.empty_like(x)
        dweight = None if weight is None else torch.empty_like(weight)
        dbias = None if bias_dtype is None else torch.empty_like(self.empties[1])
        ow = stats if dweight is None else dweight     # placeholders, as norm_backward's
        ob = stats if dbias is None else dbias
        pw, pb = (ow, ob) if groups == 1 else torch.empty_like(self.empties[2 + has_dh])
        stream = self.stream(self.device)
        run, function, metadata, consts, grid = bwd[0]
        run(grid, 1, 1, stream, function, metadata, None, None, None, x, dy,
            dy if dh is None else dh, dx, x if weight is None else weight, stats, pw, pb, D, D,
            D, M, D, *consts)
        if groups > 1:         # the finish: the partials summed in a fixed order
            run, function, metadata, consts, grid = bwd[1]
            run(grid, 1, 1, stream, function, metadata, None, None, None, pw, pb, ow, ob,
                groups, D, *consts)
        return dx, dweight, dbias

    def _backward_kept(self, has_dh: bool):
        """The kept kernels of the backward with a gradient at h (``has_dh``: the residual was
        fused and h was used) or without, looked up once they are (the plan measured on a GPU,
        its kernels launched by ``norm_backward``), with the partials' row count; or None."""
        M, D, device, e, is_rms, has_w, has_b, odd, round_xhat = self.plan_args
        plans = backward_plan(M, D, device, e, is_rms, has_dh, has_w, has_b, odd, False,
                              round_xhat)
        if plans is None or not plans[0].measured or plans[0].slices != 1:
            return None
        x, w, dweight, dbias = self.likes
        keys = launch_keys(plans, x, x, x, w, dweight, dbias, self.D, self.D, self.D, self.M,
                           self.D)
        bwd = tuple(_kept(key, plan.grid[0], self.device) for key, plan in zip(keys, plans))
        if None in bwd:
            return None
        self.groups[has_dh] = groups = plans[0].groups if len(plans) > 1 else 1
        self.empties[2 + has_dh] = _empty_like_this(self.empties[0], _FP32, 2, groups, self.D)
        self.bwd[has_dh] = bwd
        return bwd


def _kept(key, programs: int, device: int):
    """(launcher, function, metadata, constexprs, programs) of a kept kernel, or None."""
    kept = _launch.kept(key, device)
    return None if kept is None else (*kept, programs)


def _empty_like_this(x, dtype, *shape):
    """A tensor of ``shape`` and ``dtype`` on x's device that holds one element (its strides
    are 0), for ``torch.empty_like`` to allocate a dense tensor of that shape from."""
    return x.new_empty(1, dtype=dtype).expand(shape)


def ready(x, residual, weight, bias, is_rms: bool, D: int, round_xhat: bool = False):
    """A :class:`Ready` for calls of this one's signature, which has just run through the
    launchers (x (..., D) normalized over its last dim D, not several; residual, weight, bias
    tensors or None, as the door had them; ``round_xhat``: the launchers' flag, xhat rounded
    to x's dtype before the weight, see ``_config._rounding``); None
    when this call's layout or launch cannot make it ready but another's may (rows or
    parameters not dense or aligned, a kernel not kept), False when the signature fixes that
    the launchers must decide each call (see the module docstring)."""
    M = x.numel() // D if D else 0
    if not (M and x.shape[-1] == D and D <= MAX_FUSED_D_BWD):
        return False
    device = x.get_device()
    if not (x.is_contiguous() and all(t is None or t.is_contiguous()
                                      for t in (residual, weight, bias))) or (
            x.data_ptr() | (0 if weight is None else weight.data_ptr())
            | (0 if bias is None else bias.data_ptr())
            | (0 if residual is None else residual.data_ptr())) & 15:
        return None
    e = x.element_size()
    has_h = residual is not None
    fplans = forward_plan(M, D, device, e, is_rms, has_h, weight is not None, bias is not None,
                          D & 15, round_xhat)
    bplans = backward_plan(M, D, device, e, is_rms, has_h, weight is not None, bias is not None,
                           D & 15, False, round_xhat)
    if bplans is None or not (fplans[0].simple and bplans[0].slices == 1):
        return False
    r = x if residual is None else residual
    w = x if weight is None else weight
    b = x if bias is None else bias
    fwd = _kept(launch_key(fplans[0], x, r, w, b, D, D, M, D), fplans[0].grid[0], device)
    if fwd is None:
        return None
    made = Ready()
    made.live = True    # until its kernels are forgotten (_launch.forget_ready)
    made.device, made.M, made.D, made.k, made.fwd = device, M, D, 1 if is_rms else 2, fwd
    # the backward's, by whether dh is given (h may get no gradient although it was returned)
    made.plan_args = (M, D, device, e, is_rms, weight is not None, bias is not None, D & 15,
                      round_xhat)
    made.bwd, made.groups = [None, None], [1, 1]
    # what the calls allocate besides tensors like x and the weight, as shapes for
    # torch.empty_like to copy (which costs less than new_empty with a dtype: about 0.4 us a
    # call, measured on the CPU): the statistics, dbias, the backward's partials (without and
    # with dh, once known); each holds one element
    made.empties = [_empty_like_this(x, _FP32, made.k, M),
                    None if bias is None else _empty_like_this(x, bias.dtype, D), None, None]
    # the driver's, looked up once (the stub's and a GPU's kept kernels are never mixed: the
    # stub forgets them and the ready signatures as it comes and goes)
    made.stream = _drivers.active.get_current_stream
    # the dtypes of the backward's tensors (its keys'): dy and dh are x's, dweight the
    # weight's, dbias the bias's, fp32 statistics where either is absent (norm_backward's
    # placeholders)
    like = (lambda t, dtype=None: torch.empty(0, dtype=dtype or t.dtype))
    stats = like(None, _FP32)
    made.likes = (like(x), like(w), stats if weight is None else like(weight),
                  stats if bias is None else like(bias))
    return made
