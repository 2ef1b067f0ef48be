"""Pre-norm and post-norm residual blocks, stacked deep: the experiment of "Pre-norm vs post-norm".

Two ways to place a norm ``N`` around a residual branch ``F`` (the chapter's equations
(pre-norm) and (post-norm)):

- pre-norm:  ``y = x + F(N(x))``, the norm reads a copy of x and the identity path is a bare +;
- post-norm: ``y = N(x + F(x))``, the norm sits on the residual path itself.

A pre-norm stack ends with one more norm (the final norm); a post-norm stack does not need one,
since its last block already ends in a norm. The branch ``F`` is a two-layer MLP, the
position-wise sublayer of a transformer, acting on each token (row) separately. The norm is any
module class called as ``norm(dim)``: :class:`normbook.LayerNorm` by default, so the gradients
in the chapter flow through the book's hand-derived backward (ln-dx);
:class:`normbook.RMSNorm` works too.

Shapes: tokens are rows, ``(..., D)``; ``dim`` is D, ``hidden`` the MLP's inner width.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from normbook.modules import LayerNorm

__all__ = [
    "MLP",
    "PreNormBlock",
    "PostNormBlock",
    "ResidualStack",
    "make_teacher",
    "teacher_batch",
    "layer_grad_norms",
    "train",
]

ARRANGEMENTS = ("pre", "post")


class MLP(nn.Module):
    """The branch F: Linear(D, hidden) -> GELU -> Linear(hidden, D), per token.

    torch's default Linear initialisation (uniform, scale 1/sqrt(fan_in)).
    """

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """F(x) for x of shape (..., D)."""
        return self.down(nn.functional.gelu(self.up(x)))   # (..., D)


class PreNormBlock(nn.Module):
    """Pre-norm residual block, equation (pre-norm): y = x + F(N(x)),
    x and y of shape (..., dim).

    Args:
        dim: D, the width of the residual stream.
        hidden: the width of F's hidden layer (F = :class:`MLP`).
        norm: builds N from dim (default normbook's LayerNorm).
    """

    def __init__(
            self, dim: int, hidden: int,
            norm: Callable[[int], torch.nn.Module] = LayerNorm,
    ) -> None:
        super().__init__()
        self.norm = norm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + F(N(x)) for x of shape (..., D)."""
        return x + self.mlp(self.norm(x))  # identity path: a bare +


class PostNormBlock(nn.Module):
    """Post-norm residual block, equation (post-norm): y = N(x + F(x)),
    x and y of shape (..., dim).

    Args:
        dim: D, the width of the residual stream.
        hidden: the width of F's hidden layer (F = :class:`MLP`).
        norm: builds N from dim (default normbook's LayerNorm).
    """

    def __init__(
            self, dim: int, hidden: int,
            norm: Callable[[int], torch.nn.Module] = LayerNorm,
    ) -> None:
        super().__init__()
        self.norm = norm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """N(x + F(x)) for x of shape (..., D)."""
        return self.norm(x + self.mlp(x))  # identity path goes through N


class ResidualStack(nn.Module):
    """A deep stack of residual blocks between a linear embedding and a linear head.

    ``x (..., d_in) -> embed -> depth blocks -> [final norm] -> head -> (..., d_out)``.

    Args:
        d_in, d_out: input and output widths of the task.
        dim: the residual stream's width D.
        depth: the number of blocks.
        arrangement: ``"pre"`` (equation (pre-norm)) or ``"post"`` (equation (post-norm)).
        hidden: the MLP's inner width; default 4 * dim.
        norm: the norm's class, called as ``norm(dim)``; default :class:`normbook.LayerNorm`.
        final_norm: whether a norm follows the last block. Default: True for pre-norm (its
            residual stream is never normalized otherwise), False for post-norm (its last block
            already ends in a norm).
    """

    def __init__(self, d_in: int, d_out: int, dim: int, depth: int, arrangement: str = "pre",
                 hidden: int | None = None,
                 norm: Callable[[int], torch.nn.Module] = LayerNorm,
                 final_norm: bool | None = None) -> None:
        super().__init__()
        if arrangement not in ARRANGEMENTS:
            raise ValueError(f"arrangement: expected one of {ARRANGEMENTS}, got {arrangement!r}")
        for name, n in (("d_in", d_in), ("d_out", d_out), ("dim", dim), ("depth", depth)):
            _count(name, n)
        hidden = 4 * dim if hidden is None else _count("hidden", hidden)
        block = PreNormBlock if arrangement == "pre" else PostNormBlock
        if final_norm is None:
            final_norm = arrangement == "pre"
        self.arrangement = arrangement
        self.embed = nn.Linear(d_in, dim)
        self.blocks = nn.ModuleList(block(dim, hidden, norm) for _ in range(depth))
        self.final_norm = norm(dim) if final_norm else nn.Identity()
        self.head = nn.Linear(dim, d_out)
        for mod in self.modules():
            if isinstance(mod, nn.Linear):                 # the initialisation Xiong et al. (2020)
                nn.init.xavier_uniform_(mod.weight)        # analyse, instead of torch's default,
                nn.init.zeros_(mod.bias)                   # whose branches start smaller

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_in) -> (..., d_out)."""
        h = self.embed(x)            # (..., D) the residual stream
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.final_norm(h))       # (..., d_out)


def teacher_batch(teacher: nn.Module, batch: int, d_in: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression batch: Gaussian inputs and the outputs of a fixed random ``teacher``.

    Args:
        teacher: the target map, from :func:`make_teacher`.
        batch: the number of inputs. d_in: their width.
        generator: a seeded ``torch.Generator`` that draws the inputs.

    Returns:
        tuple: the pair (x, target), of shapes (batch, d_in) and (batch, d_out); the target is
            computed without gradient.
    """
    x = torch.randn(batch, d_in, generator=generator)    # (batch, d_in)
    with torch.no_grad():
        target = teacher(x)                                # (batch, d_out)
    return x, target


def make_teacher(d_in: int, d_out: int, width: int = 64, seed: int = 0) -> nn.Sequential:
    """The task: a fixed random two-layer tanh network, x (..., d_in) -> (..., d_out).

    Gaussian weights, scaled so that tanh works in its curved range and each output has a
    variance of order one (about 2): a smooth, learnable regression target. Its weights come
    from a generator of its own seeded with ``seed``: building it draws nothing from torch's
    global random state (a model built after it is the one built without it).
    """
    for name, n in (("d_in", d_in), ("d_out", d_out), ("width", width)):
        _count(name, n)
    g = torch.Generator().manual_seed(seed)
    W1 = torch.randn(width, d_in, generator=g) / math.sqrt(d_in)
    W2 = torch.randn(d_out, width, generator=g) / math.sqrt(width) * 2
    # skip_init: nn.Linear's own initialization would draw from the global generator
    first = nn.utils.skip_init(nn.Linear, d_in, width, bias=False)
    last = nn.utils.skip_init(nn.Linear, width, d_out, bias=False)
    teacher = nn.Sequential(first, nn.Tanh(), last)
    with torch.no_grad():
        first.weight.copy_(W1)
        last.weight.copy_(W2)
    return teacher.requires_grad_(False)


def _count(name: str, n, least: int = 1) -> int:
    """n, an int (not a bool) of at least ``least``; else an error naming it."""
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"{name}: expected an int, got {type(n).__name__} {n!r}")
    if n < least:
        kind = "a positive int" if least == 1 else f"an int >= {least}"
        raise ValueError(f"{name}: expected {kind}, got {n}")
    return n


def _check_schedule(steps, lr, warmup, batch) -> None:
    """:func:`train`'s numbers, each named where it is wrong: a negative step count failed
    in torch.full, a zero batch trained on nothing, a negative warmup ran as none, a NaN
    learning rate trained to NaN."""
    _count("steps", steps, least=0)
    _count("warmup", warmup, least=0)
    _count("batch", batch)
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr < math.inf):
        raise ValueError(f"lr: expected a positive, finite number, got {lr!r}")


def _mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean squared error of a model's (..., d_out) prediction, a ValueError where the
    target's shape differs (mse_loss would broadcast, a model of the wrong d_out training
    against a warning only)."""
    if prediction.shape != target.shape:
        raise ValueError(f"target: expected the model's output shape {tuple(prediction.shape)}, "
                         f"got {tuple(target.shape)} (does the model's d_out match the "
                         f"teacher's?)")
    return nn.functional.mse_loss(prediction, target)


def layer_grad_norms(model: ResidualStack, x: torch.Tensor,
                     target: torch.Tensor) -> torch.Tensor:
    """Per-block gradient norms of the MSE loss at the current parameters.

    Args:
        model: a :class:`ResidualStack`; its gradients are left cleared.
        x: (..., d_in) inputs. target: (..., d_out) targets.

    Returns:
        Tensor: float64, of shape (depth,), the 2-norm of the
            gradient of all of a block's parameters together: block 1
            (next to the input) at index 0 to block depth (next to the
            output) at depth - 1.
    """
    model.zero_grad(set_to_none=True)
    loss = _mse(model(x), target)
    loss.backward()
    norms = []
    for blk in model.blocks:
        # (a frozen parameter has no gradient: it adds nothing)
        sq = sum(float(p.grad.pow(2).sum()) for p in blk.parameters()
                 if p.grad is not None)
        norms.append(math.sqrt(sq))
    model.zero_grad(set_to_none=True)
    return torch.tensor(norms, dtype=torch.float64)


def train(model: ResidualStack, teacher: nn.Module, *,
          steps: int, lr: float, warmup: int = 0, batch: int = 64,
          seed: int = 0) -> torch.Tensor:
    """Train ``model`` on fresh teacher batches with Adam.

    Return the loss at every step. The learning rate rises linearly from
    lr / warmup to lr over the first ``warmup`` steps (linear warmup),
    then stays at lr; ``warmup=0`` uses lr from the first step.

    Args:
        model: a :class:`ResidualStack`, trained in place. teacher: the
            target map, fixed.
        steps: number of Adam steps. lr: peak learning rate. warmup:
            warmup length in steps.
        batch: tokens per step. seed: seeds the data stream (the model is
            initialised by the caller).

    Returns:
        Tensor: float64, of shape (steps,), the training loss (MSE)
            of each step's batch before that step's update. A non-finite
            loss stops training; the remaining entries are nan.
    """
    _check_schedule(steps, lr, warmup, batch)
    d_in = model.embed.in_features
    g = torch.Generator().manual_seed(seed)
    # one fused kernel for all tensors
    opt = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    losses = torch.full((steps,), float("nan"), dtype=torch.float64)
    for step in range(steps):
        if warmup > 0:
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / warmup)
        x, target = teacher_batch(teacher, batch, d_in, g)
        loss = _mse(model(x), target)
        if not torch.isfinite(loss):
            break
        losses[step] = loss.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return losses
