"""Pre-norm and post-norm blocks (pre-norm, post-norm, pre-jac, post-jac) and the experiment's helpers."""

import re

import pytest
import torch

import normbook
from normbook import blocks, reference


def _mlp64(dim, hidden, seed):
    torch.manual_seed(seed)
    return blocks.MLP(dim, hidden).double()


def test_pre_norm_block_is_x_plus_branch_of_norm():
    blk = blocks.PreNormBlock(8, 16).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    ref = x + blk.mlp(torch.nn.functional.layer_norm(x, (8,), blk.norm.weight, blk.norm.bias))
    torch.testing.assert_close(blk(x), ref, rtol=1e-12, atol=1e-12)


def test_post_norm_block_is_norm_of_sum():
    blk = blocks.PostNormBlock(8, 16).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    ref = torch.nn.functional.layer_norm(x + blk.mlp(x), (8,), blk.norm.weight, blk.norm.bias)
    torch.testing.assert_close(blk(x), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("arrangement", ["pre", "post"])
def test_block_jacobian_matches_autograd(arrangement):
    # (pre-jac): I + J_F J_N at N's input x; (post-jac): J_N (I + J_F) at N's input x + F(x)
    torch.manual_seed(0)
    D, eps = 6, 1e-5
    block = (blocks.PreNormBlock if arrangement == "pre" else blocks.PostNormBlock)(D, 12).double()
    x = 2 * torch.randn(D, dtype=torch.float64) + 1
    J_F = lambda u: torch.autograd.functional.jacobian(block.mlp, u)        # noqa: E731
    J_N = lambda u: reference.layer_norm_jacobian(u, eps)                   # noqa: E731 weight 1
    eye = torch.eye(D, dtype=torch.float64)
    with torch.no_grad():
        if arrangement == "pre":
            by_formula = eye + J_F(block.norm(x)) @ J_N(x)
        else:
            by_formula = J_N(x + block.mlp(x)) @ (eye + J_F(x))
    torch.testing.assert_close(torch.autograd.functional.jacobian(block, x), by_formula,
                               rtol=1e-10, atol=1e-12)   # float64, products of a few D x D matrices


@pytest.mark.parametrize("arrangement", ["pre", "post"])
@pytest.mark.parametrize("norm", [normbook.LayerNorm, normbook.RMSNorm])
def test_stack_shapes_and_grad_norms(arrangement, norm):
    torch.manual_seed(1)
    model = blocks.ResidualStack(5, 3, dim=16, depth=4, arrangement=arrangement, norm=norm)
    assert isinstance(model.blocks[0].norm, norm)
    assert isinstance(model.final_norm, norm) == (arrangement == "pre")
    x = torch.randn(2, 7, 5)
    assert model(x).shape == (2, 7, 3)
    norms = blocks.layer_grad_norms(model, x, torch.zeros(2, 7, 3))
    assert norms.shape == (4,) and bool((norms > 0).all()) and bool(torch.isfinite(norms).all())
    assert all(p.grad is None for p in model.parameters())      # left clean


def test_stack_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"arrangement: expected one of \('pre', 'post'\), got 'sandwich'"):
        blocks.ResidualStack(2, 2, 8, 2, arrangement="sandwich")
    with pytest.raises(ValueError, match=r"depth: expected a positive int, got 0"):
        blocks.ResidualStack(2, 2, 8, 0)
    with pytest.raises(TypeError, match=r"^depth: expected an int, got float 2.5$"):
        blocks.ResidualStack(2, 2, 8, 2.5)
    with pytest.raises(ValueError, match=r"^hidden: expected a positive int, got 0$"):
        blocks.ResidualStack(2, 2, 8, 2, hidden=0)
    with pytest.raises(ValueError, match=r"^d_out: expected a positive int, got 0$"):
        blocks.make_teacher(3, 0)


@pytest.mark.parametrize("kw, error, message", [
    (dict(steps=-1), ValueError, "steps: expected an int >= 0, got -1"),
    (dict(steps=2.0), TypeError, "steps: expected an int, got float 2.0"),
    (dict(batch=0), ValueError, "batch: expected a positive int, got 0"),
    (dict(warmup=-5), ValueError, "warmup: expected an int >= 0, got -5"),
    (dict(lr=float("nan")), ValueError, "lr: expected a positive, finite number, got nan"),
    (dict(lr=-1e-3), ValueError, "lr: expected a positive, finite number, got -0.001"),
])
def test_train_names_a_bad_argument(kw, error, message):
    """A negative step count failed inside torch.full, a zero batch trained on nothing, a
    negative warmup ran as none and a NaN learning rate trained to NaN: each is named."""
    args = dict(steps=3, lr=1e-3) | kw
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        blocks.train(blocks.ResidualStack(3, 1, 8, 1), blocks.make_teacher(3, 1), **args)


def test_train_is_seeded_and_learns():
    teacher = blocks.make_teacher(4, 2)

    def run():
        torch.manual_seed(3)
        model = blocks.ResidualStack(4, 2, dim=16, depth=2, arrangement="pre")
        return blocks.train(model, teacher, steps=60, lr=3e-3, warmup=10, batch=32, seed=0)

    a, b = run(), run()
    torch.testing.assert_close(a, b, rtol=0, atol=0)            # same seeds, same curve
    assert a.shape == (60,) and bool(torch.isfinite(a).all())
    assert a[-10:].mean() < 0.5 * a[:5].mean()                  # it learns something


def test_a_model_whose_output_does_not_fit_the_teacher_is_refused():
    """A model of d_out 1 against a teacher of d_out 3: mse_loss broadcast the two and trained
    with a warning only; train and layer_grad_norms now name the target's shape."""
    model = blocks.ResidualStack(4, 1, 8, 2)
    teacher = blocks.make_teacher(4, 3)
    with pytest.raises(ValueError, match=r"target: expected the model's output shape "
                                         r"\(64, 1\), got \(64, 3\)"):
        blocks.train(model, teacher, steps=1, lr=1e-3)
    x, target = blocks.teacher_batch(teacher, 5, 4, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="does the model's d_out match the teacher's"):
        blocks.layer_grad_norms(model, x, target)


def test_layer_grad_norms_skips_a_frozen_parameter():
    """A block's norm weight frozen: its gradient is None, and layer_grad_norms raised
    AttributeError ('NoneType' has no attribute 'pow'); it counts it as no gradient."""
    torch.manual_seed(0)
    model = blocks.ResidualStack(3, 1, 8, 2)
    x, target = torch.randn(4, 3), torch.randn(4, 1)
    before = blocks.layer_grad_norms(model, x, target)
    model.blocks[0].norm.weight.requires_grad_(False)
    after = blocks.layer_grad_norms(model, x, target)
    assert after.shape == (2,) and after[0] < before[0] and after[1] == before[1]


def test_make_teacher_leaves_the_global_generator_alone():
    """nn.Linear's own initialization drew from torch's global generator, so a model built
    after make_teacher(seed=...) differed from one built without it."""
    torch.manual_seed(7)
    before = torch.get_rng_state()
    teacher = blocks.make_teacher(5, 3, width=8, seed=1)
    assert torch.equal(torch.get_rng_state(), before)
    again = blocks.make_teacher(5, 3, width=8, seed=1)
    for a, b in zip(teacher.parameters(), again.parameters()):
        assert torch.equal(a, b) and not a.requires_grad
