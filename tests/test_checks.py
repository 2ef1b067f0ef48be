"""The invariance identities of normbook.checks, as property tests over random shapes and values;
check_norm_backward on torch's and normbook's norms, and on norms with a planted bug."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import normbook
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


# ------------------------------------------------------------------------------ RMSNorm

def rms_grad(x, w, dy, eps):
    _, rstd = reference.rms_norm_forward(x, w, eps)
    return reference.rms_norm_backward(dy, x, w, rstd)[0]


@pytest.mark.parametrize("eps", [0.0, 1e-5, 1e-3, 1e-1])
def test_rms_scale_identity_and_its_eps_residual_over_150_trials(eps):
    """RMSNorm's sum(xhat * dx) = D c2 eps rstd^3 (xhat = x rstd), to rounding, at every eps."""
    g = torch.Generator().manual_seed(int(eps * 1e5) + 1)
    worst = 0.0
    for _ in range(150):
        D = int(torch.randint(2, 64, (1,), generator=g))
        scale = 10 ** (3 * float(torch.rand(1, generator=g)) - 2)
        x = scale * (torch.randn(D, generator=g, **f64) + float(torch.randn(1, generator=g)))
        w, dy = torch.randn(D, generator=g, **f64), torch.randn(D, generator=g, **f64)
        dx = rms_grad(x, w, dy, eps)
        got = checks.rms_scale_identity(x, dx, eps)
        want = checks.rms_scale_identity_residual(x, dy, w, eps)
        _, rstd = reference.rms_norm_forward(x, w, eps)
        size = (dy * w).abs().sum() * rstd * (1 + D ** 0.5)    # |xhat_d| <= sqrt(D)
        worst = max(worst, ((got - want).abs() / size).item())
    assert worst < 1e-14


def test_rms_norm_has_no_shift_identity():
    g = torch.Generator().manual_seed(2)
    x, w, dy = torch.randn(4, 32, generator=g, **f64) + 1, torch.randn(32, generator=g, **f64), torch.randn(4, 32, generator=g, **f64)
    dx = rms_grad(x, w, dy, 1e-5)
    assert (checks.shift_identity(dx).abs() > 1e-3 * dx.abs().sum(-1)).all()
    checks.assert_rms_norm_identities(x, dy, w, dx, 1e-5)              # its own check passes
    with pytest.raises(AssertionError, match=r"shift identity"):
        checks.assert_layer_norm_identities(x, dy, w, dx, 1e-5)         # LayerNorm's does not


def test_assert_rms_norm_identities_catches_a_dropped_c2():
    g = torch.Generator().manual_seed(9)
    x, w, dy = torch.randn(5, 32, generator=g, **f64), torch.randn(32, generator=g, **f64), torch.randn(5, 32, generator=g, **f64)
    _, rstd = reference.rms_norm_forward(x, w, 1e-5)
    wrong = dy * w * rstd[:, None]                                      # (rms-dx) without - c2 xhat
    with pytest.raises(AssertionError, match=r"scale identity sum\(xhat \* dx\) = D c2 eps rstd\^3 fails: worst relative residual .* > 3.6e-15 \(token \d\)"):
        checks.assert_rms_norm_identities(x, dy, w, wrong, 1e-5)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        xd, wd, dyd = x.to(dtype), w.to(dtype), dy.to(dtype)
        dx = torch.autograd.grad(F.rms_norm(xd.requires_grad_(), (32,), wd, 1e-5), xd, dyd)[0]
        checks.assert_rms_norm_identities(xd, dyd, wd, dx, 1e-5)


# ------------------------------------------------------------------------------ check_norm_backward

CORRECT = {
    ("layer", "torch"): lambda eps: lambda x, w=None: F.layer_norm(x, x.shape[-1:], w, None, eps),
    ("layer", "normbook"): lambda eps: lambda x, w=None: normbook.layer_norm(x, x.shape[-1:], w, None, eps),
    ("rms", "torch"): lambda eps: lambda x, w=None: F.rms_norm(x, x.shape[-1:], w, eps),
    ("rms", "normbook"): lambda eps: lambda x, w=None: normbook.rms_norm(x, x.shape[-1:], w, eps),
}


@pytest.mark.parametrize("kind, impl", list(CORRECT))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_torch_and_normbook_norms_pass(kind, impl, dtype):
    """Rows of 2 to 4096 features, centred and not, large and small, eps 0 to 1e-1, with and
    without a weight: every identity holds within the default tolerance."""
    g = torch.Generator().manual_seed(0)
    for D, loc, scale, eps in [(2, 0.0, 1.0, 1e-5), (3, 5.0, 0.1, 0.0), (64, -2.0, 30.0, 1e-1),
                               (1000, 1.0, 1e-2, 1e-5), (4096, 0.0, 3.0, 1e-3)]:
        x = (scale * (torch.randn(3, D, generator=g, **f64) + loc)).to(dtype)
        w = torch.randn(D, generator=g, **f64).to(dtype)
        assert checks.check_norm_backward(CORRECT[kind, impl](eps), x, kind, eps, w)
        assert checks.check_norm_backward(CORRECT[kind, impl](eps), x, kind, eps)


def test_the_modules_pass_with_their_default_eps():
    x = torch.randn(2, 5, 48)
    for module, kind in [(torch.nn.LayerNorm(48), "layer"), (torch.nn.RMSNorm(48), "rms"),
                         (normbook.LayerNorm(48), "layer"), (normbook.RMSNorm(48), "rms")]:
        with torch.no_grad():
            module.weight.normal_()
        eps = module.eps                                  # None for RMSNorm: finfo(dtype).eps
        assert checks.check_norm_backward(lambda x, w: torch.func.functional_call(
            module, {"weight": w, **({"bias": module.bias} if kind == "layer" else {})}, (x,)),
            x, kind, eps, module.weight)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_norm_at_its_default_passes_without_an_eps(dtype):
    """check_norm_backward(fn, x, kind) as the README writes it: eps is the kind's default in
    torch (1e-5 for LayerNorm, None for RMSNorm), so torch's and normbook's modules left at
    theirs pass. (With 1e-5 for both, a float64 torch.nn.RMSNorm failed the scale identity.)"""
    x = torch.randn(4, 16, dtype=dtype)
    for module, kind in [(torch.nn.LayerNorm(16, dtype=dtype), "layer"),
                         (torch.nn.RMSNorm(16, dtype=dtype), "rms"),
                         (normbook.LayerNorm(16, dtype=dtype), "layer"),
                         (normbook.RMSNorm(16, dtype=dtype), "rms")]:
        assert checks.check_norm_backward(module, x, kind=kind)
    with pytest.raises(AssertionError, match="scale identity"):   # a wrong eps still fails
        checks.check_norm_backward(torch.nn.RMSNorm(16, dtype=torch.float64),
                                   x.double(), kind="rms", eps=1e-5)


def buggy_norm(kind, bug, eps):
    """A norm whose forward is right and whose backward has one planted bug."""
    class Buggy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            if kind == "layer":
                y, mean, rstd = reference.layer_norm_forward(x, w, None, eps)
                xhat = (x - mean[..., None]) * rstd[..., None]
            else:
                y, rstd = reference.rms_norm_forward(x, w, eps)
                xhat = x * rstd[..., None]
            ctx.save_for_backward(x, xhat, rstd, w)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, xhat, rstd, w = ctx.saved_tensors
            D = x.shape[-1]
            ghat = dy if bug == "forgot weight" else dy * w                  # (ln-ghat)
            n = D - 1 if bug == "1/(D-1)" else D
            c1 = ghat.sum(-1, keepdim=True) / n                               # (ln-c)
            c2 = (ghat * xhat).sum(-1, keepdim=True) / n
            if bug == "dropped c2":
                c2 = torch.zeros_like(c2)
            if bug == "c2 sign":
                c2 = -c2
            if (kind == "rms" and bug != "added c1") or bug == "dropped c1":
                c1 = torch.zeros_like(c1)
            r = rstd[..., None]
            factor = {"missing rstd": 1.0, "rstd squared": r * r}.get(bug, r)
            dx = (ghat - c1 - c2 * xhat) * factor                             # (ln-dx), (rms-dx)
            dw = (dy * (x if bug == "x for xhat in dweight" else xhat)).reshape(-1, D).sum(0)
            return dx, dw

    return Buggy.apply


BUGS = [  # kind, bug, eps, the identity that names it
    ("layer", "none", 1e-5, None),
    ("layer", "dropped c1", 1e-5, "shift identity"),
    ("layer", "dropped c2", 1e-5, "scale identity"),
    ("layer", "c2 sign", 0.0, "scale identity"),
    ("layer", "1/(D-1)", 1e-5, "shift identity"),
    ("layer", "missing rstd", 0.0, "projection identity"),
    ("layer", "rstd squared", 0.0, "projection identity"),
    ("layer", "forgot weight", 0.0, "projection identity"),
    ("layer", "x for xhat in dweight", 1e-5, "weight identity"),
    ("rms", "none", 1e-5, None),
    ("rms", "added c1", 1e-5, "scale identity"),        # LayerNorm's (ln-dx) used for RMSNorm
    ("rms", "dropped c2", 1e-5, "scale identity"),
    ("rms", "1/(D-1)", 0.0, "scale identity"),
    ("rms", "missing rstd", 0.0, "projection identity"),
    ("rms", "forgot weight", 0.0, "projection identity"),
    ("rms", "x for xhat in dweight", 1e-5, "weight identity"),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind, bug, eps, identity", BUGS, ids=[f"{k}-{b}" for k, b, *_ in BUGS])
def test_check_norm_backward_catches_each_planted_bug(kind, bug, eps, identity, dtype):
    """Each bug fails with the name of the identity it breaks, far above the tolerance (the
    relative residuals are 1e-3 to 1); the correct backward passes."""
    g = torch.Generator().manual_seed(11)
    x = (3 * torch.randn(6, 64, generator=g, **f64) + 1).to(dtype)
    w = torch.randn(64, generator=g, **f64).to(dtype)
    fn = buggy_norm(kind, bug, eps)
    if identity is None:
        assert checks.check_norm_backward(fn, x, kind, eps, w)
        return
    with pytest.raises(AssertionError, match=rf"^{identity} .* fails: worst relative residual "
                                             r"(\S+) > \S+ \(token \d\)$") as info:
        checks.check_norm_backward(fn, x, kind, eps, w)
    worst = float(info.value.args[0].split("residual ")[1].split()[0])
    assert worst > 1e-4


def test_at_eps_0_the_invariances_miss_what_the_projection_identity_sees():
    """The blind spot of the invariances chapter's exercise "What the checks cannot see": a wrong
    factor in place of rstd, or g in place of ghat, passes both free checks at eps = 0."""
    g = torch.Generator().manual_seed(12)
    x, w = 3 * torch.randn(6, 64, generator=g, **f64) + 1, torch.randn(64, generator=g, **f64)
    dy = torch.randn(6, 64, generator=g, **f64)
    for bug in ("missing rstd", "forgot weight"):
        xg = x.clone().requires_grad_()
        dx = torch.autograd.grad(buggy_norm("layer", bug, 0.0)(xg, w), xg, dy)[0]
        checks.assert_layer_norm_identities(x, dy, w, dx, 0.0)       # passes
        with pytest.raises(AssertionError, match="projection identity"):
            checks.check_norm_backward(buggy_norm("layer", bug, 0.0), x, "layer", 0.0, w, dy=dy)


def test_the_eps_residuals_are_needed_in_float64():
    """At eps = 0.1 the uncorrected identities are far from zero, and the closed forms
    D c2 eps rstd^3 and D c2^2 eps rstd^3 make them hold to rounding."""
    g = torch.Generator().manual_seed(13)
    x, w = 0.5 * torch.randn(4, 32, generator=g, **f64), torch.randn(32, generator=g, **f64)
    for kind in ("layer", "rms"):
        fn = CORRECT[kind, "torch"](0.1)
        assert checks.check_norm_backward(fn, x, kind, 0.1, w, atol=1e-13)
        with pytest.raises(AssertionError, match="scale identity"):
            checks.check_norm_backward(fn, x, kind, 0.0, w)   # told eps = 0: the residual shows


def test_a_norm_of_the_other_kind_fails():
    x = torch.randn(4, 32, **f64) + 2
    with pytest.raises(AssertionError, match="shift identity"):
        checks.check_norm_backward(CORRECT["rms", "torch"](1e-5), x, "layer", 1e-5)
    with pytest.raises(AssertionError, match="scale identity"):
        checks.check_norm_backward(CORRECT["layer", "torch"](1e-5), x, "rms", 1e-5)
    with pytest.raises(ValueError, match="kind"):
        checks.check_norm_backward(CORRECT["layer", "torch"](1e-5), x, "batch")


@pytest.mark.parametrize("which", ["all NaN", "one NaN", "NaN atol"])
def test_assert_layer_norm_identities_fails_on_nan(which):
    """A gradient holding a NaN fails both identities' check, and an atol of NaN passes nothing
    (the comparison residual > atol is False for NaN: the check passed a gradient of NaNs, and
    atol=nan turned it off), as the RMSNorm check already did."""
    torch.manual_seed(0)
    x, dy, w = torch.randn(3, 8, **f64), torch.randn(3, 8, **f64), torch.randn(8, **f64)
    dx = ln_grad(x, w, dy, 1e-5)
    checks.assert_layer_norm_identities(x, dy, w, dx, 1e-5)            # the right one passes
    atol = None
    if which == "all NaN":
        dx = torch.full_like(dx, float("nan"))
    elif which == "one NaN":
        dx = dx.clone()
        dx[1, 3] = float("nan")
    else:
        dx, atol = 1.5 * dx, float("nan")
    with pytest.raises(AssertionError, match="identity .* fails"):
        checks.assert_layer_norm_identities(x, dy, w, dx, 1e-5, atol)


def test_the_weight_identity_takes_the_centring_into_account():
    """torch's own LayerNorm, on rows whose mean is 1e3 times their spread, in float32: the
    weight identity's bound left out the conditioning 1 + |mean| rstd that the other
    identities carry, and refused torch's gradient in about half of the seeds."""
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(6, 17, generator=g) + 1e3
        w = torch.randn(17, generator=g)
        assert checks.check_norm_backward(
            lambda x, w: torch.nn.functional.layer_norm(x, (17,), w), x, "layer", weight=w)


# ------------------------------------------------------------------------------ a reviewer's cases

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind, bug", [(k, b) for k, b, *_ in BUGS if b != "1/(D-1)"],
                         ids=[f"{k}-{b}" for k, b, *_ in BUGS if b != "1/(D-1)"])
def test_check_norm_backward_judges_half_precision(kind, bug, dtype):
    """In bfloat16 and float16 every planted bug passed: the tolerance, 64 machine epsilons
    (0.5 in bfloat16), was above any relative residual, and a standard normal dy leaves c1 and
    c2 small beside ghat. With dy's default now carrying a mean and a component along xhat,
    and 4 machine epsilons in half precision, each bug fails and the correct backward passes
    (1/(D-1) is a 1/D error: below half precision's rounding at D = 64; float32 sees it)."""
    g = torch.Generator().manual_seed(11)
    x = (3 * torch.randn(6, 64, generator=g, **f64) + 1).to(dtype)
    w = torch.randn(64, generator=g, **f64).to(dtype)
    fn = buggy_norm(kind, bug, 1e-5)
    if bug == "none":
        assert checks.check_norm_backward(fn, x, kind, 1e-5, w)
        return
    with pytest.raises(AssertionError, match="identity .* fails"):
        checks.check_norm_backward(fn, x, kind, 1e-5, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_backward_of_zeros_fails(dtype):
    """dx = 0, chapter 3's placeholder, satisfies the shift, scale and projection identities
    up to their eps terms (each is homogeneous in dx), and passed in float32 and bfloat16; the
    energy identity, sum(ghat * dx) = rstd (sum(ghat^2) - D c1^2 - D c2^2), is not."""
    x = (torch.randn(4, 64, **f64) + 1).to(dtype)
    for kind in ("layer", "rms"):
        with pytest.raises(AssertionError, match="^energy identity"):
            checks.check_norm_backward(lambda t: 0 * t, x, kind)


def test_a_permuted_dweight_fails_with_a_weight_of_ones():
    """dweight summed over the features instead of the tokens (N = D): with a weight of ones,
    the modules' initial one, its error is orthogonal to the weight, and the weight identity
    (the contraction with the weight) passed it; the contraction with a random vector fails."""
    class WrongAxis(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return F.layer_norm(x, x.shape[-1:], w, None, 1e-5)

        @staticmethod
        def backward(ctx, dy):
            x, w = ctx.saved_tensors
            with torch.enable_grad():
                xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
                dx, dw = torch.autograd.grad(F.layer_norm(xg, x.shape[-1:], wg, None, 1e-5),
                                             (xg, wg), dy)
            _, mean, rstd = reference.layer_norm_forward(x, None, None, 1e-5)
            return dx, (dy * (x - mean[:, None]) * rstd[:, None]).sum(1)   # over D: wrong

    x = torch.randn(32, 32, **f64)
    with pytest.raises(AssertionError, match=r"^weight identity sum\(v \* dweight\)"):
        checks.check_norm_backward(WrongAxis.apply, x, "layer", 1e-5, torch.ones(32, **f64))


def test_an_unbiased_variance_fails_in_float32_at_4096():
    """x.var() (unbiased) in place of LayerNorm's biased variance scales rstd by about
    1 + 1/(2D): at D = 4096 in float32 it passed the old default, 64 machine epsilons times
    sqrt(D) / 8, and fails the new one, 16 machine epsilons times the same."""
    x = torch.randn(4, 4096, generator=torch.Generator().manual_seed(3))

    def unbiased(t):
        return (t - t.mean(-1, keepdim=True)) / torch.sqrt(t.var(-1, keepdim=True) + 1e-5)

    with pytest.raises(AssertionError, match="identity .* fails"):
        checks.check_norm_backward(unbiased, x, "layer", 1e-5)


def test_the_free_checks_take_float16_rows_whose_sum_overflows():
    """torch's own float16 LayerNorm of rows near 100 (D = 1024): their sum passes 65504, and
    assert_layer_norm_identities, computing xhat in float16, took the mean as inf and failed a
    correct, finite gradient. It computes in float64 now, and a dropped c1 still fails."""
    g = torch.Generator().manual_seed(5)
    x = (100 + torch.randn(3, 1024, generator=g, **f64)).half()
    dy = torch.randn(3, 1024, generator=g, **f64).half()
    xg = x.clone().requires_grad_()
    dx = torch.autograd.grad(F.layer_norm(xg, (1024,), None, None, 1e-5), xg, dy)[0]
    assert dx.isfinite().all()
    checks.assert_layer_norm_identities(x, dy, None, dx, 1e-5)
    wrong = dx + (dy.double().mean(-1, keepdim=True) * 0.5).half()     # half of c1 put back
    with pytest.raises(AssertionError, match="shift identity"):
        checks.assert_layer_norm_identities(x, dy, None, wrong, 1e-5)


def test_the_default_dy_is_not_drawn_from_the_stream_x_may_come_from():
    """x drawn as torch.manual_seed(0); torch.randn(...): the default dy's normal part was
    seed 0's same stream, so dy lay in the span of 1 and xhat, where the true dx is zero, and
    a backward of zeros passed. The default dy has a seed of its own."""
    torch.manual_seed(0)
    x = (3 * torch.randn(4, 16, dtype=torch.float64) + 1).float()
    with pytest.raises(AssertionError, match="^energy identity"):
        checks.check_norm_backward(lambda t: 0 * t, x, "layer")


def test_the_identities_name_a_wrong_shape_or_dtype():
    """A (1,) weight or a dx of one token was broadcast over every token: "scale identity
    fails: worst relative residual 5e+303"; an integer dx raised finfo's bare TypeError."""
    x, dy = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    dx = torch.randn(3, 8, dtype=torch.float64)
    for assert_ids in (checks.assert_layer_norm_identities, checks.assert_rms_norm_identities):
        with pytest.raises(ValueError, match=r"weight: expected shape \(8,\)"):
            assert_ids(x, dy, torch.ones(1, dtype=torch.float64), dx, 1e-5)
        with pytest.raises(ValueError, match=r"dx: expected shape \(3, 8\) \(as x\), got shape \(8,\)"):
            assert_ids(x, dy, None, dx[0], 1e-5)
        with pytest.raises(TypeError, match="dx: expected a real floating-point dtype, got torch.int64"):
            assert_ids(x, dy, None, dx.long(), 1e-5)
    for residual in (checks.scale_identity_residual, checks.rms_scale_identity_residual):
        with pytest.raises(ValueError, match=r"weight: expected shape \(8,\)"):
            residual(x, dy, torch.ones(1, dtype=torch.float64), 1e-5)
    with pytest.raises(TypeError, match="x: expected a real floating-point dtype, got torch.int64"):
        checks.check_norm_backward(lambda t: t, x.long())
    with pytest.raises(ValueError, match='kind: expected "layer" or "rms", got \'RMS\''):
        checks.check_norm_backward(lambda t: t, x, "RMS")
