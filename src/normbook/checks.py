"""The free checks: identities every correct LayerNorm or RMSNorm backward satisfies.

LayerNorm ignores shifts of its input (exactly) and positive rescalings (exactly only at
eps = 0), so its input gradient has no component along either direction. RMSNorm has no mean:
it keeps the rescalings only, so its gradient keeps the scale identity and loses the shift one.
These functions compute the identities per token; tests and chapters assert with them, with no
reference implementation, no finite differences and no autograd. See the chapter "Invariances
and the two free checks", equations (ln-shift-id), (ln-scale-id) and (ln-eps-residual), and the
chapter "RMSNorm" for RMSNorm's residual. :func:`check_norm_backward` runs a user's norm and
applies every identity its kind satisfies.
"""

from __future__ import annotations

from typing import Callable

import torch

from normbook import _validate, reference

__all__ = [
    "shift_identity",
    "scale_identity",
    "scale_identity_residual",
    "assert_layer_norm_identities",
    "rms_scale_identity",
    "rms_scale_identity_residual",
    "assert_rms_norm_identities",
    "check_norm_backward",
]


def _checked(x, **given) -> None:
    """x and the tensors ``given`` by name (dx, dy, weight; None for no weight), each a real
    floating tensor of the shape its name asks beside x: dx and dy x's, weight (D,). Else a
    TypeError or ValueError naming it, expected against given: a (1,) weight or a dx of one
    token broadcast over every token, and the identities failed with residuals of 1e303."""
    reference._tensor("x", x)
    reference._floating(x)
    reference._against_x(x, **given)


def _xhat(x: torch.Tensor, eps: float) -> torch.Tensor:
    _, mean, rstd = reference.layer_norm_forward(x, None, None, eps)
    return (x - mean[..., None]) * rstd[..., None]


def shift_identity(dx: torch.Tensor) -> torch.Tensor:
    """Equation (ln-shift-id): sum_d dx_d, which is zero for LayerNorm at any eps.

    Args:
        dx: (..., D) input gradient of a LayerNorm.

    Returns:
        Tensor: (...,), the sum over the last dim, one value per token.
    """
    _checked(dx)
    return dx.sum(-1)


def scale_identity(x: torch.Tensor, dx: torch.Tensor, eps: float) -> torch.Tensor:
    """Equation (ln-scale-id): sum_d xhat_d dx_d, zero at eps = 0 for a LayerNorm input gradient.

    xhat is LayerNorm's (the mean is subtracted), so this is not RMSNorm's identity: for RMSNorm
    compute sum_d (x_d * rstd) dx_d directly, as the exercise in the invariances chapter does.

    Args:
        x: (..., D) the forward input (xhat is recomputed from it with LayerNorm's statistics).
        dx: (..., D) the input gradient.
        eps: the eps of the forward.

    Returns:
        Tensor: (...,), one value per token. At eps > 0 it equals
            :func:`scale_identity_residual`.
    """
    _checked(x, dx=dx)
    return (_xhat(x, eps) * dx).sum(-1)


def scale_identity_residual(
    x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """Equation (ln-eps-residual): the exact sum_d xhat_d dx_d, eps > 0.

    With c2 = mean_d(ghat * xhat) and rstd = 1 / sqrt(var + eps),
    sum_d xhat_d dx_d = D * c2 * eps * rstd^3,
    because sum_d xhat_d^2 = D * var / (var + eps) rather than D.

    Args:
        x: (..., D) the forward input.
        dy: (..., D) the gradient arriving at y.
        weight: (D,) or None.
        eps: the eps of the forward.

    Returns:
        Tensor: (...,), the predicted residual, one value per token.
    """
    _checked(x, dy=dy, weight=weight)
    D = x.shape[-1]
    _, mean, rstd = reference.layer_norm_forward(x, None, None, eps)
    xhat = (x - mean[..., None]) * rstd[..., None]
    ghat = dy * weight if weight is not None else dy
    c2 = (ghat * xhat).mean(-1)
    return D * c2 * eps * rstd**3


IDENTITY_TOLERANCE_EPS = 64   # assert_layer_norm_identities' default in float32 and float64, in
                              # machine epsilons of dx's dtype (twice that in units of roundoff)


def assert_layer_norm_identities(
    x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor | None,
    dx: torch.Tensor, eps: float, atol: float | None = None,
) -> None:
    """Assert both free checks on a LayerNorm input gradient ``dx``.

    Raise AssertionError if either fails. Checks (ln-shift-id),
    sum_d dx_d = 0, and (ln-eps-residual), sum_d xhat_d dx_d equal to its
    closed form, each per token within ``atol`` scaled by the size of the
    terms being summed (default: IDENTITY_TOLERANCE_EPS machine
    epsilons of dx's dtype; 4 in float16 and bfloat16).

    Args:
        x, dy: (..., D) the forward input and the gradient arriving at y.
        weight: (D,) or None.
        dx: (..., D) the input gradient under test.
        eps: the eps of the forward.
        atol: relative tolerance per token; default
            64 * finfo(dx.dtype).eps (4 * finfo(dx.dtype).eps for
            float16 and bfloat16).
    """
    _checked(x, dy=dy, weight=weight, dx=dx)
    if atol is None:
        atol = IDENTITY_TOLERANCE_EPS * torch.finfo(dx.dtype).eps
        if dx.dtype in _HALVES:
            atol = _default_atol(dx.dtype)
    # in float64: a half x's own statistics overflow (a float16
    # row of values near 100 sums past 65504)
    x, dy, dx = x.double(), dy.double(), dx.double()
    weight = None if weight is None else weight.double()
    scale = (
        dx.abs().sum(-1) * (1 + _xhat(x, eps).abs().amax(-1))
        + torch.finfo(dx.dtype).tiny
    )
    shift = shift_identity(dx).abs() / scale
    _fail("shift identity sum(dx) = 0", shift, atol)   # (a NaN fails)
    resid = scale_identity_residual(x, dy, weight, eps)
    scale_err = (scale_identity(x, dx, eps) - resid).abs() / scale
    _fail("scale identity sum(xhat * dx) = D c2 eps rstd^3",
          scale_err, atol)


# ------------------------------------------------------------------------------ RMSNorm

def _rms_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's (xhat, rstd): (..., D) and (...,)."""
    _, rstd = reference.rms_norm_forward(x, None, eps)
    return x * rstd[..., None], rstd


def rms_scale_identity(x: torch.Tensor, dx: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's scale identity: sum_d xhat_d dx_d with xhat = x * rstd, zero at eps = 0.

    RMSNorm's (rms-xhat) has no mean, so this is :func:`scale_identity` with RMSNorm's xhat.

    Args:
        x: (..., D) the forward input.
        dx: (..., D) the input gradient.
        eps: the eps of the forward.

    Returns:
        Tensor: (...,), one value per token. At eps > 0 it equals
            :func:`rms_scale_identity_residual`.
    """
    _checked(x, dx=dx)
    return (_rms_stats(x, eps)[0] * dx).sum(-1)


def rms_scale_identity_residual(
    x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """RMSNorm's exact sum_d xhat_d dx_d when eps > 0: D * c2 * eps * rstd^3, as (ln-eps-residual).

    With ms = mean_d(x^2), rstd = 1 / sqrt(ms + eps) and c2 = mean_d(ghat * xhat), (rms-dx) gives
    sum_d xhat_d dx_d = rstd * c2 * (D - sum_d xhat_d^2), and sum_d xhat_d^2 = D ms / (ms + eps)
    = D (1 - eps rstd^2).

    Args:
        x: (..., D) the forward input.
        dy: (..., D) the gradient arriving at y.
        weight: (D,) or None.
        eps: the eps of the forward.

    Returns:
        Tensor: (...,), the predicted residual, one value per token.
    """
    _checked(x, dy=dy, weight=weight)
    D = x.shape[-1]
    xhat, rstd = _rms_stats(x, eps)
    ghat = dy * weight if weight is not None else dy
    c2 = (ghat * xhat).mean(-1)
    return D * c2 * eps * rstd**3


def _fail(identity: str, rel: torch.Tensor, atol: float) -> None:
    """Raise AssertionError naming ``identity`` if any token's relative residual exceeds atol
    (or is NaN: a gradient of NaN fails, and an atol of NaN passes nothing)."""
    if rel.numel() and not bool((rel <= atol).all()):
        worst = torch.where(rel.isnan(), torch.inf, rel).flatten()
        k = int(worst.argmax())
        raise AssertionError(
            f"{identity} fails: worst relative residual {worst[k].item():.3e} > {atol:.1e} "
            f"(token {k})")


_HALVES = (torch.float16, torch.bfloat16)


def _default_atol(dtype: torch.dtype, D: int | None = None) -> float:
    """16 machine epsilons of ``dtype`` (``torch.finfo(dtype).eps``, twice the unit roundoff),
    times sqrt(D) / 8 from D = 64 up: the c1 and c2 sums of a D-wide row carry more roundoff.
    Correct float32 backwards (torch's, normbook's, Hugging Face's, one written op by op) left
    at most 2.5 units of roundoff times that factor, over rows of 2 to 8192 values, means up to
    1e3 times the spread and eps 0 to 0.1 (tests/test_checks.py); 64 machine epsilons let an
    unbiased variance pass at D = 4096. For float16 and bfloat16, 4 machine epsilons: their
    gradients are computed in float32 (torch's norms, normbook's, the Hugging Face ones) or
    in their own dtype op by op, and carry about their final rounding, which left every
    identity within one unit of roundoff of their size (measured, tests/test_checks.py); 64
    machine epsilons of bfloat16, 0.5, passed every planted bug."""
    if dtype in _HALVES:
        return 4 * torch.finfo(dtype).eps
    return 16 * torch.finfo(dtype).eps * max(1.0, (D or 1)**0.5 / 8)


_PROBE_SEED = 0x6E6F726D    # "norm": no seed a test or a chapter draws its x from


def _probe(kind: str, x: torch.Tensor, weight: torch.Tensor | None,
           eps: float) -> torch.Tensor:
    """check_norm_backward's default dy, float64 on the CPU: a seeded standard normal plus
    (1 + xhat) / 2 times the weight's sign. ghat = dy * weight then has a mean c1 and a
    component c2 along xhat of about mean|weight| / 2; a standard normal alone leaves both
    about 1 / sqrt(D) of ghat's size, where a wrong c1 or c2 hides in half precision's
    rounding."""
    # a seed of its own: x drawn from seed 0's stream (torch.manual_seed(0); torch.randn) would
    # share z, and dy would lie in the span of 1 and xhat, where the true dx is zero
    g = torch.Generator().manual_seed(_PROBE_SEED)
    z = torch.randn(x.shape, generator=g, dtype=torch.float64)
    xd = x.detach().double().cpu()
    xhat = _xhat(xd, eps) if kind == "layer" else _rms_stats(xd, eps)[0]
    sign = 1.0 if weight is None else torch.where(weight.detach().double().cpu() < 0, -1.0, 1.0)
    return z + 0.5 * sign * (1 + xhat)


def _kind_eps(kind: str, eps, dtype: torch.dtype) -> float:
    """The eps a norm of ``kind`` (``"layer"`` or ``"rms"``, else a ValueError) used, as a
    number: ``"default"`` is torch's default of the kind (1e-5 for LayerNorm, None for
    RMSNorm), and None is the machine epsilon of the compute dtype of ``dtype`` (at least
    float32's), as torch.nn.RMSNorm's."""
    if kind not in ("layer", "rms"):
        raise ValueError(f'kind: expected "layer" or "rms", got {kind!r}')
    if isinstance(eps, str):
        if eps != "default":
            raise ValueError(f'eps: expected a number, None or "default", got {eps!r}')
        eps = 1e-5 if kind == "layer" else None
    if eps is None:
        eps = torch.finfo(_validate.compute_dtype(dtype)).eps
    return eps


def _identities(
    kind: str, x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor | None,
    dx: torch.Tensor, eps: float,
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, residual, size) per identity, (...,) tensors, computed in float64.

    size sums the magnitudes of what the identity adds up: dx_d's terms before they cancel,
    rstd (|ghat_d| + |c1| + |c2 xhat_d|), with the means of |ghat| and |ghat * xhat| for |c1|
    and |c2| (bounds that do not cancel), times the identity's other factor, times the
    centring's conditioning 1 + |mean| rstd for LayerNorm (x - mean loses those digits).
    """
    x, dy, dx = x.double(), dy.double(), dx.double()
    w = None if weight is None else weight.double()
    D = x.shape[-1]
    ghat = dy * w if w is not None else dy                                # (..., D) (ln-ghat)
    if kind == "layer":
        _, mean, rstd = reference.layer_norm_forward(x, None, None, eps)
        xhat = (x - mean[..., None]) * rstd[..., None]
        cond = 1 + mean.abs() * rstd
        m1 = ghat.abs().mean(-1, keepdim=True)
    else:
        xhat, rstd = _rms_stats(x, eps)
        cond = torch.ones_like(rstd)
        m1 = torch.zeros_like(rstd)[..., None]
    r = rstd[..., None]
    c2 = (ghat * xhat).mean(-1)                                           # (...,) (ln-c)
    c1 = ghat.mean(-1) if kind == "layer" else torch.zeros_like(c2)
    terms = r * (ghat.abs() + m1 + (ghat * xhat).abs().mean(-1, keepdim=True) * xhat.abs())
    found = []
    if kind == "layer":
        found.append(("shift identity sum(dx) = 0", dx.sum(-1), terms.sum(-1) * cond))
    found.append(("scale identity sum(xhat * dx) = D c2 eps rstd^3",
                  (xhat * dx).sum(-1) - D * c2 * eps * rstd**3,
                  (xhat.abs() * terms).sum(-1) * cond))
    found.append(("projection identity sum(dx * (ghat - dx / rstd)) = D c2^2 eps rstd^3",
                  (dx * (ghat - dx / r)).sum(-1) - D * c2**2 * eps * rstd**3,
                  (terms * (ghat.abs() + 2 * dx.abs() / r)).sum(-1) * cond))
    # not homogeneous in dx, as the three above are (up to their eps terms): a dx of zeros,
    # or one off by a common factor, fails it
    found.append(("energy identity sum(ghat * dx) = rstd (sum(ghat^2) - D c1^2 - D c2^2)",
                  (ghat * dx).sum(-1) - rstd * ((ghat * ghat).sum(-1) - D * (c1 * c1 + c2 * c2)),
                  (ghat.abs() * terms).sum(-1) * cond))
    return found


def assert_rms_norm_identities(
    x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor | None,
    dx: torch.Tensor, eps: float, atol: float | None = None,
) -> None:
    """Assert RMSNorm's free check on an input gradient ``dx``: the scale identity of
    (rms-dx), whose residual is :func:`rms_scale_identity_residual`'s.

    Raise AssertionError if, for some token, sum_d xhat_d dx_d (xhat = x * rstd) differs from
    its closed form D c2 eps rstd^3 (:func:`rms_scale_identity_residual`) by more than ``atol``
    times the size of the terms summed: sum_d ``abs(xhat_d)`` times the size of dx_d's terms
    before they cancel, ``rstd * (abs(ghat_d) + m * abs(xhat_d))`` with ``m`` the mean of
    ``abs(ghat * xhat)`` (a bound on c2 that does not cancel). There is no shift identity:
    RMSNorm is not shift invariant, and sum_d dx_d is not zero. The identity is evaluated in
    float64.

    Args:
        x, dy: (..., D) the forward input and the gradient arriving at y.
        weight: (D,) or None.
        dx: (..., D) the input gradient under test.
        eps: the eps of the forward.
        atol: relative tolerance per token; default 16 * finfo(dx.dtype).eps, times
            sqrt(D) / 8 when D > 64 (4 * finfo(dx.dtype).eps for float16 and bfloat16).
    """
    _checked(x, dy=dy, weight=weight, dx=dx)
    if atol is None:
        atol = _default_atol(dx.dtype, x.shape[-1])
    name, residual, size = _identities("rms", x, dy, weight, dx, eps)[0]
    _fail(name, residual.abs() / (size + torch.finfo(torch.float64).tiny), atol)


def check_norm_backward(
    fn: Callable[..., torch.Tensor], x: torch.Tensor,
    kind: str = "layer", eps: float | None | str = "default",
    weight: torch.Tensor | None = None, *, dy: torch.Tensor | None = None,
    atol: float | None = None,
) -> bool:
    """Run a norm's backward and assert every identity its gradients satisfy, as gradcheck does.

    ``fn`` is any differentiable callable normalizing over the last dim: ``fn(x)``, or
    ``fn(x, weight)`` when a weight is given (LayerNorm's bias does not enter any identity;
    close over it). Its gradients for a random ``dy`` (seeded) are taken by autograd and
    checked per token against (in float64, from ``x``, ``dy`` and ``weight`` alone):

    - shift identity (ln-shift-id), LayerNorm only: sum_d dx_d = 0.
    - scale identity (ln-eps-residual), both kinds with each kind's xhat:
      sum_d xhat_d dx_d = D c2 eps rstd^3.
    - projection identity, both kinds: (ln-proj) says dx / rstd is ghat with its components
      along 1 (LayerNorm) and xhat removed, so at eps = 0 it is orthogonal to what was removed,
      ghat - dx / rstd. At eps > 0, sum_d dx_d (ghat_d - dx_d / rstd) = D c2^2 eps rstd^3. This
      one sees what the two invariances cannot: a wrong factor in place of rstd, or g in place
      of ghat = g * weight.
    - energy identity, both kinds: sum_d ghat_d dx_d = rstd (sum_d ghat_d^2 - D c1^2 -
      D c2^2) (no c1 for RMSNorm), from (ln-dx) exactly at any eps. The three above are
      homogeneous in dx up to their eps terms: a dx of zeros passes them, and fails this one.
    - weight identity, with a weight: sum_d weight_d dweight_d = sum over tokens of D c2, as
      (ln-dparams) gives dweight = sum over tokens of dy * xhat; and the same contraction with
      a seeded random vector v in place of the weight, which a dweight whose error is
      orthogonal to the weight (a permutation of it, with a weight of ones) does not escape.

    Each residual is divided by the size of the terms it sums (see
    :func:`assert_rms_norm_identities`); the first identity whose worst token exceeds ``atol``
    raises AssertionError with its name, the worst relative residual and the token.

    Args:
        fn: the norm under test, ``fn(x)`` or ``fn(x, weight)`` -> (..., D).
        x: (..., D) the input (not modified).
        kind: ``"layer"`` (LayerNorm: mean subtracted) or ``"rms"`` (RMSNorm).
        eps: the eps ``fn`` uses; None, as torch.nn.RMSNorm's default, is
            finfo(dtype).eps (at least float32's). ``"default"``: torch's default of the
            kind, 1e-5 for ``"layer"`` (torch.nn.LayerNorm's), None for ``"rms"``
            (torch.nn.RMSNorm's), so that a norm left at its default passes as it is.
        weight: (D,) gamma, or None.
        dy: (..., D) the gradient arriving at y; default a seeded standard normal plus
            (1 + xhat) / 2 times the weight's sign, so that c1 and c2 are not small beside
            ghat (a wrong c1 or c2 then shows above half precision's rounding).
        atol: relative tolerance per token; default 16 * finfo(x.dtype).eps, times
            sqrt(D) / 8 when D > 64 (4 * finfo(x.dtype).eps for float16 and bfloat16).

    Returns:
        bool: True (as torch.autograd.gradcheck); every failure raises.
    """
    _checked(x, weight=weight, **({} if dy is None else {"dy": dy}))
    eps = _kind_eps(kind, eps, x.dtype)
    D = x.shape[-1]
    if atol is None:
        atol = _default_atol(x.dtype, D)
    xg = x.detach().clone().requires_grad_()
    wg = None if weight is None else weight.detach().clone().requires_grad_()
    y = fn(xg) if wg is None else fn(xg, wg)
    if y.shape != x.shape:
        raise AssertionError(f"fn(x) has shape {tuple(y.shape)}, not x's {tuple(x.shape)}")
    if dy is None:
        dy = _probe(kind, x, weight, eps).to(y.dtype).to(y.device)
    grads = torch.autograd.grad(y, [xg] if wg is None else [xg, wg], dy, allow_unused=True)
    dx = grads[0]
    if dx is None:
        raise AssertionError("fn(x) does not depend on x: no input gradient")
    tiny = torch.finfo(torch.float64).tiny
    for name, residual, size in _identities(kind, x, dy, weight, dx, eps):
        _fail(name, residual.abs() / (size + tiny), atol)
    if wg is not None:
        dweight = grads[1]
        if dweight is None:
            raise AssertionError("fn(x, weight) does not depend on weight: no weight gradient")
        assert weight is not None
        xd, dyd, wd = x.double(), dy.double(), weight.double()
        if kind == "layer":
            _, mean, rstd = reference.layer_norm_forward(xd, None, None, eps)
            xhat = (xd - mean[..., None]) * rstd[..., None]
            cond = (1 + mean.abs() * rstd).reshape(-1)                   # (N,), as above
        else:
            xhat = _rms_stats(xd, eps)[0]
            cond = torch.ones((), dtype=torch.float64)
        terms = (dyd * xhat).reshape(-1, D)                              # (N, D)
        # contracted with the weight, sum_n D c2_n; and with a seeded random vector, which a
        # dweight whose error is orthogonal to the weight (a permutation, a sum over the wrong
        # axis, with a weight of ones) does not escape
        probe = torch.randn(D, generator=torch.Generator().manual_seed(_PROBE_SEED + 1),
                            dtype=torch.float64)
        for v, name in ((wd, "weight identity sum(weight * dweight) = D sum_n c2"),
                        (probe.to(wd.device), "weight identity sum(v * dweight) = "
                                              "sum_n v . (dy_n * xhat_n), v random")):
            got = (v * dweight.double()).sum()
            want = (terms * v).sum()
            # each token's share, times the centring's conditioning, as the other identities'
            size = ((terms.abs() * v.abs()).sum(-1) * cond).sum() + tiny
            _fail(name, ((got - want).abs() / size).reshape(1), atol)
    return True
