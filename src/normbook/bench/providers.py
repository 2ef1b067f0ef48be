"""The providers: one implementation of each op per provider, to be timed side by side.

A provider is a small function ``provider(op, mode, device) -> fn`` where ``fn(inp)`` runs
the op's forward on an :class:`Inputs` and returns its outputs as a tuple: ``(y,)`` for
``layer_norm``/``rms_norm`` and ``(y, h)`` for the fused adds (h = x + residual). The mode
(fwd, bwd, fwd_bwd) is turned into a timed callable by :func:`normbook.bench.timing.closure`;
a provider only says whether it supports it. Unsupported combinations raise
:class:`Unsupported` with a reason, which the runner records as a skipped row. What a provider
needs whatever the op (its package, a GPU, a compiler) is checked by its ``_ready_*`` function,
which :func:`unavailable` calls before anything is measured.

Providers:
    normbook   the Triton kernels, ``normbook.kernels`` (CUDA only here: the interpreter is
               far too slow to time).
    torch      eager ``torch.nn.functional.layer_norm`` / ``rms_norm``; add_*: x + residual,
               then the norm.
    compile    ``torch.compile`` of the reference formula written plainly in torch ops, in fp32.
    naive      the formula as separate framework ops in the input dtype (mean, sub, pow,
               mean, add eps, rsqrt, mul, mul, add): one kernel and one round trip to memory
               per op, the baseline that fusion removes.
    reference  ``normbook.layer_norm`` / ``normbook.rms_norm`` on the CPU: the book's
               hand-derived autograd Function (on CUDA those dispatch to the kernels).
    liger      Liger-Kernel (``liger_kernel``), where importable.
    quack      quack-kernels (``quack``), where importable.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["Unsupported", "Inputs", "make_inputs", "PROVIDERS", "get", "unavailable",
           "TORCH_DTYPES"]

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-5

# Set by ``python -m normbook.bench --dry-run``: the normbook kernels may run in Triton's
# interpreter on the CPU (to check the benchmark's steps, not to time anything), and
# torch.compile uses this backend ("aot_eager" traces as inductor would, without its C++ build).
SETTINGS = {"interpreter": False, "compile_backend": "inductor"}


class Unsupported(Exception):
    """This provider cannot run this (op, mode) here; the message says why."""


@dataclass
class Inputs:
    """The tensors of one problem, shared by all providers and modes.

    x, residual, dy, dh: (M, D) in the activation dtype; weight, bias: (D,) in the same dtype.
    residual and dh exist only for the fused adds, bias only for LayerNorm.
    """

    op: str
    x: torch.Tensor                       # (M, D), requires grad
    weight: torch.Tensor                  # (D,), requires grad
    bias: torch.Tensor | None             # (D,), requires grad; LayerNorm only
    residual: torch.Tensor | None         # (M, D), requires grad; add_* only
    dy: torch.Tensor                      # (M, D) gradient of y
    dh: torch.Tensor | None               # (M, D) gradient of h; add_* only
    eps: float = EPS

    def wrt(self) -> list[torch.Tensor]:
        """The tensors backward differentiates with respect to: x, residual, weight, bias."""
        return [t for t in (self.x, self.residual, self.weight, self.bias) if t is not None]

    def grad_outputs(self) -> list[torch.Tensor]:
        """The incoming gradients, matched to the outputs (y,) or (y, h)."""
        return [t for t in (self.dy, self.dh) if t is not None]


def make_inputs(op: str, M: int, D: int, dtype: str, device) -> Inputs:
    """Random inputs for (op, M, D, dtype) on ``device``; weight near 1, bias near 0."""
    dt = TORCH_DTYPES[dtype]
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0, shift=0.0):
        t = torch.randn(*shape, generator=g, device=device, dtype=dt)
        return (t.mul_(scale).add_(shift)).requires_grad_(True)

    is_add, is_ln = op.startswith("add_"), op.endswith("layer_norm")
    return Inputs(
        op=op,
        x=randn(M, D),
        weight=randn(D, scale=0.1, shift=1.0),
        bias=randn(D, scale=0.1) if is_ln else None,
        residual=randn(M, D) if is_add else None,
        dy=torch.randn(M, D, generator=g, device=device, dtype=dt),
        dh=torch.randn(M, D, generator=g, device=device, dtype=dt) if is_add else None,
    )


Fn = Callable[[Inputs], tuple]


def _norm_then_add(norm) -> dict[str, Fn]:
    """All four ops from a pair of ``norm(x, inputs) -> y``: (LayerNorm, RMSNorm)."""
    ln, rms = norm

    return {
        "layer_norm": lambda i: (ln(i.x, i),),
        "rms_norm": lambda i: (rms(i.x, i),),
        "add_layer_norm": lambda i: _add(ln, i),
        "add_rms_norm": lambda i: _add(rms, i),
    }


def _add(norm, i: Inputs):
    h = i.x + i.residual  # (M, D)
    return norm(h, i), h


# ---- torch eager ---------------------------------------------------------------------------
_TORCH = _norm_then_add((
    lambda x, i: F.layer_norm(x, (x.shape[-1],), i.weight, i.bias, i.eps),
    lambda x, i: F.rms_norm(x, (x.shape[-1],), i.weight, i.eps),
))


def torch_eager(op: str, mode: str, device) -> Fn:
    return _TORCH[op]


# ---- naive: one framework op per step, in the input dtype ----------------------------------
def _naive_layer_norm(x, i):
    mean = x.mean(-1, keepdim=True)                 # (M, 1)
    xc = x - mean                                   # (M, D)
    var = xc.pow(2).mean(-1, keepdim=True)          # (M, 1) biased
    rstd = (var + i.eps).rsqrt()                    # (M, 1)
    return xc * rstd * i.weight + i.bias            # (M, D)


def _naive_rms_norm(x, i):
    rstd = (x.pow(2).mean(-1, keepdim=True) + i.eps).rsqrt()  # (M, 1)
    return x * rstd * i.weight                                # (M, D)


_NAIVE = _norm_then_add((_naive_layer_norm, _naive_rms_norm))


def naive(op: str, mode: str, device) -> Fn:
    return _NAIVE[op]


# ---- torch.compile of the plain formula (fp32 inside, as the reference) --------------------
def _plain_layer_norm(x, weight, bias, eps):
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    return ((xf - mean) * torch.rsqrt(var + eps) * weight.float() + bias.float()).to(x.dtype)


def _plain_rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _plain_add_layer_norm(x, residual, weight, bias, eps):
    h = x + residual
    return _plain_layer_norm(h, weight, bias, eps), h


def _plain_add_rms_norm(x, residual, weight, eps):
    h = x + residual
    return _plain_rms_norm(h, weight, eps), h


def _ready_compile(device) -> None:
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise Unsupported(f"torch.compile is not supported here (torch {torch.__version__}, "
                          f"Python {sys.version.split()[0]})")
    backend = SETTINGS["compile_backend"]
    if backend == "inductor" and device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise Unsupported("torch.compile's inductor backend needs triton on CUDA; not installed")
    if backend == "inductor" and device.type == "cpu" and not any(
            shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise Unsupported("torch.compile's inductor backend needs a C++ compiler on the CPU; "
                          "none on PATH (g++, c++, clang++)")


def compiled(op: str, mode: str, device) -> Fn:
    """torch.compile(dynamic=False) of the plain formula; the runner resets dynamo per shape."""
    _ready_compile(device)
    opts = dict(dynamic=False, backend=SETTINGS["compile_backend"])
    if op == "layer_norm":
        f = torch.compile(_plain_layer_norm, **opts)
        return lambda i: (f(i.x, i.weight, i.bias, i.eps),)
    if op == "rms_norm":
        f = torch.compile(_plain_rms_norm, **opts)
        return lambda i: (f(i.x, i.weight, i.eps),)
    if op == "add_layer_norm":
        f = torch.compile(_plain_add_layer_norm, **opts)
        return lambda i: f(i.x, i.residual, i.weight, i.bias, i.eps)
    f = torch.compile(_plain_add_rms_norm, **opts)
    return lambda i: f(i.x, i.residual, i.weight, i.eps)


# ---- the book's reference path (CPU) -------------------------------------------------------
def _ready_reference(device) -> None:
    if device.type == "cuda":
        raise Unsupported("on CUDA normbook.layer_norm dispatches to the kernels: see 'normbook'")


def reference(op: str, mode: str, device) -> Fn:
    _ready_reference(device)
    import normbook

    return _norm_then_add((
        lambda x, i: normbook.layer_norm(x, (x.shape[-1],), i.weight, i.bias, i.eps),
        lambda x, i: normbook.rms_norm(x, (x.shape[-1],), i.weight, i.eps),
    ))[op]


# ---- normbook's Triton kernels -------------------------------------------------------------
def _ready_normbook(device):
    if device.type != "cuda" and not SETTINGS["interpreter"]:
        raise Unsupported("Triton kernels run only in the interpreter on the CPU, far too slow "
                          "to benchmark; run on a CUDA device")
    try:
        from normbook import kernels as K
    except ImportError as e:
        raise Unsupported(f"normbook.kernels not importable: {e}") from None
    return K


def normbook_kernels(op: str, mode: str, device) -> Fn:
    K = _ready_normbook(device)
    if op == "layer_norm":
        return lambda i: (K.layer_norm(i.x, (i.x.shape[-1],), i.weight, i.bias, i.eps),)
    if op == "rms_norm":
        return lambda i: (K.rms_norm(i.x, (i.x.shape[-1],), i.weight, i.eps),)
    if op == "add_layer_norm":
        return lambda i: tuple(K.add_layer_norm(i.x, i.residual, i.weight, i.bias, i.eps))
    return lambda i: tuple(K.add_rms_norm(i.x, i.residual, i.weight, i.eps))


# ---- third-party kernels, where importable -------------------------------------------------
def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception as e:  # ImportError, or a broken install raising anything else
        raise Unsupported(f"{name} not importable ({type(e).__name__}: {e})") from None


def _ready_liger(device):
    LF = _import("liger_kernel.transformers.functional")   # first: a dry run checks the import
    if device.type != "cuda":
        raise Unsupported("Liger-Kernel needs a GPU (it imports here)")
    return LF


def liger(op: str, mode: str, device) -> Fn:
    LF = _ready_liger(device)
    if op == "layer_norm":
        return lambda i: (LF.liger_layer_norm(i.x, i.weight, i.bias, i.eps),)
    if op == "rms_norm":
        # in_place=False: Liger's default writes dx into dy, which a repeated backward would reuse
        return lambda i: (LF.liger_rms_norm(i.x, i.weight, i.eps, 0.0, "llama", False),)
    if op == "add_rms_norm" and hasattr(LF, "liger_fused_add_rms_norm"):
        return lambda i: tuple(LF.liger_fused_add_rms_norm(
            i.x, i.residual, i.weight, i.eps, 0.0, "llama", False))
    raise Unsupported(f"no such op: this Liger-Kernel has no fused {op}")


def _ready_quack(device):
    if device.type != "cuda":
        raise Unsupported("quack needs a GPU (CuTe DSL)")
    try:
        return _import("quack.rmsnorm")
    except Unsupported as e:
        # the usual case on the lent GPU machines: say why, beside the import's own error
        raise Unsupported(f"{e}; quack-kernels needs the CUTLASS DSL's wheel (about 92 MB), "
                          "over the 64 MiB the device tool carries (benchmarks/README.md), so "
                          "install it where the GPU is to measure it") from None


def quack(op: str, mode: str, device) -> Fn:
    Q = _ready_quack(device)
    if op == "rms_norm":
        return lambda i: (Q.rmsnorm(i.x, i.weight, eps=i.eps),)
    if op == "add_rms_norm":
        return lambda i: tuple(Q.rmsnorm(i.x, i.weight, residual=i.residual, eps=i.eps,
                                         prenorm=True))
    if op == "layer_norm":
        ln = getattr(Q, "layernorm", None) or getattr(_import("quack.layernorm"), "layernorm", None)
        if ln is None:
            raise Unsupported("no such op: quack has no layernorm here")
        if mode != "fwd":
            raise Unsupported("quack's layernorm is forward-only")
        return lambda i: (ln(i.x, i.weight, eps=i.eps),)
    raise Unsupported(f"no such op: quack has no fused {op}")


PROVIDERS: dict[str, Callable[..., Fn]] = {
    "normbook": normbook_kernels,
    "torch": torch_eager,
    "compile": compiled,
    "naive": naive,
    "reference": reference,
    "liger": liger,
    "quack": quack,
}


# what each provider needs whatever the op; torch and naive need nothing beyond torch
_READY: dict[str, Callable] = {
    "normbook": _ready_normbook,
    "compile": _ready_compile,
    "reference": _ready_reference,
    "liger": _ready_liger,
    "quack": _ready_quack,
}


def unavailable(provider: str, device) -> str | None:
    """Why ``provider`` cannot run any op on ``device`` (None if it can): checked before measuring,
    so that a run does not time its rivals for minutes and then record nothing for it."""
    if provider not in PROVIDERS:
        raise ValueError(f"provider: expected one of {list(PROVIDERS)}, got {provider!r}")
    try:
        _READY.get(provider, lambda device: None)(torch.device(device))
    except Unsupported as e:
        return str(e)
    return None


def get(provider: str, op: str, mode: str, device) -> Fn:
    """The forward ``fn(inputs) -> outputs`` of ``provider`` for (op, mode) on ``device``.

    Raises Unsupported (with the reason) where the combination cannot run here.
    """
    if provider not in PROVIDERS:
        raise ValueError(f"provider: expected one of {list(PROVIDERS)}, got {provider!r}")
    return PROVIDERS[provider](op, mode, torch.device(device))
