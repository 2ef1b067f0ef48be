"""The invariance identities of normbook.checks, as property tests over random shapes and values."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from normbook import checks, reference

f64 = dict(dtype=torch.float64)


def term_size(x, w, dy, eps):
    """Size of the terms that cancel inside dx: |ghat| summed over the row, times rstd, times the
    conditioning of centring (x - mean loses log10(|mean| rstd) digits when the mean is large)."""
    _, mean, rstd = reference.layer_norm_forward(x, w, None, eps)
    return (dy * w).abs().sum(-1) * rstd * (1 + mean.abs() * rstd)


def ln_grad(x, w, dy, eps):
    _, mean, rstd = reference.layer_norm_forward(x, w, None, eps)
    return reference.layer_norm_backward(dy, x, w, mean, rstd)[0]


@st.composite
def problems(draw):
    N = draw(st.integers(1, 6))
    D = draw(st.integers(2, 300))
    seed = draw(st.integers(0, 2**31 - 1))
    loc = draw(st.floats(-1e3, 1e3))
    scale = draw(st.floats(1e-2, 1e2))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, **f64) * scale + loc
    w = torch.randn(D, generator=g, **f64)
    dy = torch.randn(N, D, generator=g, **f64)
    return x, w, dy


# Tolerances: dx_d is a difference of terms of size ~|ghat| rstd (which can cancel almost
# completely, e.g. at D = 2), and each identity sums D of them (times |xhat_d| <= sqrt(D) for the
# second); float64 leaves ~D * 1e-16 of that size, so 1e-12 relative is safe up to D = 300.
@settings(max_examples=60, deadline=None)
@given(problems(), st.sampled_from([1e-5, 1e-3, 1e-1]))
def test_shift_identity_holds_at_any_eps(problem, eps):
    x, w, dy = problem
    dx = ln_grad(x, w, dy, eps)
    size = term_size(x, w, dy, eps)
    assert (checks.shift_identity(dx).abs() <= 1e-12 * size).all()


@settings(max_examples=60, deadline=None)
@given(problems())
def test_scale_identity_holds_at_eps_zero(problem):
    x, w, dy = problem
    dx = ln_grad(x, w, dy, 0.0)
    size = term_size(x, w, dy, 0.0) * x.shape[-1] ** 0.5
    assert (checks.scale_identity(x, dx, 0.0).abs() <= 1e-12 * size).all()


@pytest.mark.parametrize("eps", [1e-5, 1e-3, 1e-1])
def test_eps_residual_closed_form_over_150_trials(eps):
    """sum(xhat * dx) = D c2 eps rstd^3, exactly (up to roundoff), at every eps > 0."""
    g = torch.Generator().manual_seed(int(eps * 1e5))
    worst = 0.0
    for _ in range(150):
        D = int(torch.randint(2, 64, (1,), generator=g))
        scale = float(torch.empty(1).uniform_(0.05, 3.0, generator=g))
        x = torch.randn(D, generator=g, **f64) * scale + float(torch.randn(1, generator=g))
        w, dy = torch.randn(D, generator=g, **f64), torch.randn(D, generator=g, **f64)
        dx = ln_grad(x, w, dy, eps)
        got = checks.scale_identity(x, dx, eps)
        want = checks.scale_identity_residual(x, dy, w, eps)
        size = (dy * w).abs().sum() / x.std(unbiased=False)   # magnitude of the terms summed
        worst = max(worst, ((got - want).abs() / size).item())
    assert worst < 1e-13


def test_the_checks_catch_a_dropped_term():
    """A backward with c1 deleted (RMSNorm's formula applied to LayerNorm) fails the shift check."""
    g = torch.Generator().manual_seed(7)
    x, w, dy = torch.randn(5, 32, generator=g, **f64) + 3, torch.randn(32, generator=g, **f64), torch.randn(5, 32, generator=g, **f64)
    _, mean, rstd = reference.layer_norm_forward(x, w, None, 1e-5)
    xhat = (x - mean[:, None]) * rstd[:, None]
    ghat = dy * w
    c2 = (ghat * xhat).mean(-1, keepdim=True)
    wrong = (ghat - c2 * xhat) * rstd[:, None]                 # c1 dropped
    with pytest.raises(AssertionError, match=r"shift identity sum\(dx\) = 0 fails: worst relative residual .* > 1.4e-14 \(token \d\)"):
        checks.assert_layer_norm_identities(x, dy, w, wrong, 1e-5)
    right = ln_grad(x, w, dy, 1e-5)
    checks.assert_layer_norm_identities(x, dy, w, right, 1e-5)


def test_the_checks_catch_a_wrong_c2():
    g = torch.Generator().manual_seed(8)
    x, w, dy = torch.randn(5, 32, generator=g, **f64), torch.randn(32, generator=g, **f64), torch.randn(5, 32, generator=g, **f64)
    _, mean, rstd = reference.layer_norm_forward(x, w, None, 1e-5)
    xhat = (x - mean[:, None]) * rstd[:, None]
    ghat = dy * w
    c1 = ghat.mean(-1, keepdim=True)
    c2 = (ghat * xhat).sum(-1, keepdim=True) / 31               # 1/(D-1) instead of 1/D
    wrong = (ghat - c1 - c2 * xhat) * rstd[:, None]
    with pytest.raises(AssertionError, match=r"scale identity sum\(xhat \* dx\) = D c2 eps rstd\^3 fails: worst relative residual .* > 1.4e-14 \(token \d\)"):
        checks.assert_layer_norm_identities(x, dy, w, wrong, 1e-5)
