"""``normbook.swap_norms``: put normbook's modules into an existing model, in place.

Every ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` of a model, and every Hugging Face norm
class in :data:`normbook.swap.HF_NORMS`, becomes a :class:`normbook.LayerNorm` or
:class:`normbook.RMSNorm` that holds the same ``Parameter`` objects under the same names: the
``state_dict`` keys, the device, the dtype and an optimizer built before the swap all stay
valid.

How each maps (equations (ln-y) and (rms-y) of the chapter "One token's vector"):

- ``torch.nn.LayerNorm``: (ln-y), y = (x - mean) * rstd * weight + bias; the module keeps its
  identity and only its class changes (``normbook.LayerNorm`` subclasses it and adds no state).
- ``torch.nn.RMSNorm``: (rms-y), y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps); as above.
- Llama-style ``*RMSNorm`` (Llama, Mistral, Qwen2, ...):
  ``weight * (h * rsqrt(mean(h^2) + variance_epsilon)).to(input_dtype)`` with
  ``h = x.to(float32)``. That is (rms-y) with gamma = ``weight`` and eps = ``variance_epsilon``,
  and, in bfloat16 or float16, xhat rounded to the input dtype *before* the weight multiplies:
  the replacement's ``round_xhat``. Op for op in float32, bfloat16 and float16 (float64
  Hugging Face computes in float32: swapped only with ``strict=False``).
- Gemma-style ``*RMSNorm``: y = (xhat * (1.0 + weight.float())).type_as(x): the replacement's
  ``offset`` of 1, gamma = 1 + weight taken in float32, y rounded once; the parameter stays the
  model's ``weight``.
- Cohere's and OLMo's ``*LayerNorm``: (ln-y) of a float32 copy of the rows, without bias
  (OLMo's without any parameter, eps 1e-5), rounded once: a ``normbook.LayerNorm(...,
  bias=False, upcast=...)``. OLMo's runs torch's float32 kernel, as ``upcast=True`` does;
  Cohere's writes the equations out in torch ops, whose sums round differently from that
  kernel's, as ``upcast="ops"`` does. Both bit for bit in float32, bfloat16 and float16.
- T5's ``T5LayerNorm`` (an RMSNorm, despite its name): ``weight * (x * rsqrt(mean(h^2) +
  variance_epsilon))``, h = x.to(float32), xhat (float32 for half rows) rounded first to the
  weight's dtype when that is bfloat16 or float16, so the output has a half weight's dtype
  whatever the input's. Rows in the weight's dtype: Llama's order (``round_xhat``). Rows of
  another dtype (T5 keeps ``wo`` in float32, so a float16 T5's norms get float32 rows):
  normbook's xhat of the rows in float32, then T5's rounding and product (``xhat_to_weight``),
  for any pairing of float32, bfloat16 and float16; a pairing with float64 in it runs T5's own
  forward. Hugging Face's dtype and bits for each. Since it looks at each input's dtype, the
  replacement is the class :func:`patch_hf` builds for T5 (a :class:`normbook.RMSNorm`
  subclass named ``T5LayerNorm``), not a plain ``normbook.RMSNorm``.

A norm that is left alone (not reproducible, or not exact in its dtype under ``strict``) gives
one ``UserWarning`` per class that names it. Classes are matched by module path and name,
so ``transformers`` is never imported here: without it, only torch's classes can be present.

Copying and pickling: a swapped norm is a plain ``normbook.RMSNorm`` or ``LayerNorm`` and copies
and pickles as one (T5's, the patched class, as below). The classes :func:`patch_hf` builds are
made once per (modeling module, class name, ``strict``) and kept in this module, and their
instances pickle as a call of ``normbook.swap._rebuild`` with those three names, not by the
class's Hugging Face name: ``copy.deepcopy`` (and ``torch.optim.swa_utils.AveragedModel``)
gives the same class, and a pickled model (``torch.save(model)``) loads with normbook's norms
whether a patch is active or not, in this process or another (which imports the modeling
module; transformers must be installed).

``reset_parameters()`` of a replacement is torch's: weight = 1 whatever the ``offset``, so a
swapped or patched Gemma norm (offset 1, identity at weight 0, as Gemma initialises and stores
it) becomes gamma = 2 if it is called. Hugging Face's own initialisation (Gemma's
``_init_weights``, which goes by a class name ending in ``RMSNorm``) still zeroes a swapped or
patched Gemma norm. ``reset_parameters`` is left as torch's, rather than made the identity for
offset 1, so that a swapped norm, a plain ``normbook.RMSNorm(D, offset=1.0)``, resets as every
``normbook.RMSNorm`` does (see its docstring) and as torch's module it subclasses; to reset a
Gemma norm to the identity, ``torch.nn.init.zeros_(norm.weight)``.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import torch

from normbook.functional import rms_norm
from normbook.modules import LayerNorm, RMSNorm

__all__ = ["HFNorm", "HF_NORMS", "swap_norms", "patch_hf", "HFPatch"]


@dataclass(frozen=True)
class HFNorm:
    """How one Hugging Face norm class maps onto normbook's modules.

    Attributes:
        module: the module that defines the class, ``transformers.models.<m>.modeling_<m>``.
        name: the class name.
        weight: the attribute holding gamma, kept as the replacement's ``weight``; None for a
            class without one.
        eps: the attribute holding eps, the replacement's ``eps``, or the class's fixed eps.
        exact: the weight dtypes in which normbook's forward is the class's, op for op; an
            empty tuple: never swapped (``note`` says why).
        note: the class's forward as an equation, and how it maps.
        offset: the replacement's ``offset`` (gamma = offset + weight in float32: Gemma's 1).
        round_xhat: the replacement's ``round_xhat`` (xhat rounded to the input's dtype before
            the weight multiplies: Llama's order in bf16 and fp16).
        upcast: a LayerNorm replacement's ``upcast``: True, half rows normalized as a float32
            copy by torch's float32 kernel (OLMo's); "ops", by the equations in torch ops
            (Cohere's).
        xhat_to_weight: xhat of float32 rows rounded to a half *weight's* dtype rather than the
            input's, the output in the weight's dtype for any input (T5's); the replacement
            checks each input's dtype (see the module docstring).
        kind: "rms" (the replacement a :class:`normbook.RMSNorm`) or "layer" (a LayerNorm
            without bias, ``normbook.LayerNorm(bias=False)``).
    """

    module: str
    name: str
    weight: Optional[str] = "weight"
    eps: Union[str, float] = "variance_epsilon"
    exact: tuple[torch.dtype, ...] = (torch.float32,)
    note: str = ""
    offset: float = 0.0
    round_xhat: bool = False
    upcast: Union[bool, str] = False
    kind: str = "rms"        # "layer": a LayerNorm without bias, normbook.LayerNorm(bias=False)
    xhat_to_weight: bool = False


_HALVES = (torch.float32, torch.bfloat16, torch.float16)
_LLAMA = ("weight * (h * rsqrt(mean(h^2) + variance_epsilon)).to(input_dtype), h = x.to(float32): "
          "(rms-y) with gamma = weight, xhat rounded to the input's dtype before the weight "
          "multiplies (round_xhat)")
_GEMMA = ("((h * rsqrt(mean(h^2) + eps)) * (1.0 + weight.float())).type_as(x), h = x.float(): "
          "(rms-y) with gamma = 1 + weight taken in float32 (offset 1)")


def _hf(package: str, name: str, note: str = _LLAMA, **kw) -> HFNorm:
    if note is _LLAMA:
        kw = dict(dict(exact=_HALVES, round_xhat=True), **kw)
    return HFNorm(f"transformers.models.{package}.modeling_{package}", name, note=note, **kw)


#: The Hugging Face norm classes that :func:`normbook.swap_norms` knows, one
#: ``normbook.swap.HFNorm`` each; these swapped exactly in float32, bfloat16 and float16: the
#: Llama-style RMSNorms (Llama, Mistral, Mixtral, Ministral, Qwen2, Qwen2-MoE, Qwen3,
#: Qwen3-MoE, Phi-3, Granite, GraniteMoe, DeepSeek-V3, GLM-4, SmolLM3, EXAONE 4;
#: ``round_xhat``), T5's (that order where input and weight share a dtype; ``xhat_to_weight``
#: for the others), OLMo-2's, OLMo-3's and Helium's (one rounding, normbook's own), and Gemma,
#: Gemma 2, Gemma 3 and Qwen3-Next (y = xhat * (1 + weight); ``offset`` 1);
#: and LayerNorms without bias: OLMo's (``upcast=True``), Cohere's and Cohere 2's
#: (``upcast="ops"``) (a per-head QK-norm of Cohere's, whose weight has two dims, is left).
#: Checked against transformers 5.24: tests/test_swap.py resolves every entry and compares each
#: class with its replacement in each dtype. Models built on ``torch.nn.LayerNorm`` (GPT-2)
#: need no entry.
HF_NORMS: tuple[HFNorm, ...] = (
    *(_hf(p, n) for p, n in [
        ("llama", "LlamaRMSNorm"), ("mistral", "MistralRMSNorm"), ("mixtral", "MixtralRMSNorm"),
        ("ministral", "MinistralRMSNorm"), ("qwen2", "Qwen2RMSNorm"),
        ("qwen2_moe", "Qwen2MoeRMSNorm"), ("qwen3", "Qwen3RMSNorm"),
        ("qwen3_moe", "Qwen3MoeRMSNorm"), ("phi3", "Phi3RMSNorm"), ("granite", "GraniteRMSNorm"),
        ("granitemoe", "GraniteMoeRMSNorm"), ("deepseek_v3", "DeepseekV3RMSNorm"),
        ("glm4", "Glm4RMSNorm"), ("smollm3", "SmolLM3RMSNorm"),
        ("exaone4", "Exaone4RMSNorm")]),
    # (weight * xhat).to(input_dtype): one rounding of an fp32 product, as normbook rounds y
    # (Helium's takes weight.to(float32) first: the same product)
    *(_hf(p, n, exact=(torch.float32, torch.bfloat16, torch.float16),
          note="(weight * h * rsqrt(mean(h^2) + variance_epsilon)).to(input_dtype), h = "
               "x.to(float32): (rms-y) with gamma = weight")
      for p, n in [("olmo2", "Olmo2RMSNorm"), ("olmo3", "Olmo3RMSNorm"),
                   ("helium", "HeliumRMSNorm")]),
    _hf("t5", "T5LayerNorm", exact=_HALVES, round_xhat=True, xhat_to_weight=True,
        note="weight * (x * rsqrt(mean(x^2) + variance_epsilon)), xhat rounded to a bf16/fp16 "
             "weight's dtype first: (rms-y) with gamma = weight (T5's LayerNorm has no mean), "
             "round_xhat for inputs in the weight's dtype, xhat_to_weight for others"),
    # LayerNorms without bias: Cohere's, (h - mean) * rsqrt(var + eps) * weight in float32
    # torch ops, rounded once (upcast="ops": torch's fused float32 kernel sums in another order
    # and differs in about a third of the float32 values by a unit); OLMo's, F.layer_norm of h
    # in float32 without parameters, eps 1e-5, rounded once (upcast=True)
    *(_hf(p, n, kind="layer", upcast="ops", exact=_HALVES,
          note="weight * ((h - mean) * rsqrt(var + variance_epsilon)), h = x.to(float32), "
               "var = (h - mean).pow(2).mean(), rounded once: (ln-y) with gamma = weight and no "
               "bias, in those torch ops (upcast='ops')")
      for p, n in [("cohere", "CohereLayerNorm"), ("cohere2", "Cohere2LayerNorm")]),
    _hf("olmo", "OlmoLayerNorm", kind="layer", weight=None, eps=1e-5, upcast=True,
        exact=_HALVES,
        note="F.layer_norm(x.to(float32), eps=1e-5) rounded once: (ln-y) without parameters, "
             "upcast"),
    *(_hf(p, n, eps="eps", exact=_HALVES, offset=1.0, note=_GEMMA) for p, n in [
        ("gemma", "GemmaRMSNorm"), ("gemma2", "Gemma2RMSNorm"), ("gemma3", "Gemma3RMSNorm"),
        ("qwen3_next", "Qwen3NextRMSNorm")]),
)

_BY_CLASS = {(e.module, e.name): e for e in HF_NORMS}


def _entry(cls: type) -> HFNorm | None:
    return _BY_CLASS.get((cls.__module__, cls.__qualname__))


def _replacement(old: torch.nn.Module, entry: HFNorm, strict: bool) -> torch.nn.Module:
    """A normbook.RMSNorm (a normbook.LayerNorm for ``kind`` "layer"; for T5's, whose output
    dtype depends on each input's, the class :func:`patch_hf` builds) holding ``old``'s
    weight Parameter itself, its training flag, its hooks (the same dicts, so handles
    registered on ``old`` still remove them) and every other attribute of its own (Hugging
    Face's ``_is_hf_initialized``, without which ``init_weights`` would reset a trained weight;
    ``variance_epsilon`` is the modules' alias of ``eps``, read and written)."""
    cls: Any = LayerNorm if entry.kind == "layer" else RMSNorm
    if entry.xhat_to_weight:
        cls = _patched(entry.module, entry.name, strict)
    new = cls.__new__(cls)
    _adopt(new, old, entry)
    return new


def _adopt(new: Any, old: Any, entry: HFNorm) -> None:
    """Initialise ``new`` (a normbook.RMSNorm or LayerNorm, or a subclass, not yet
    initialised) as :func:`_replacement` describes, from ``old``."""
    weight = None if entry.weight is None else getattr(old, entry.weight)
    shape = torch.Size(weight.shape if weight is not None else old.normalized_shape)
    eps = float(getattr(old, entry.eps) if isinstance(entry.eps, str) else entry.eps)
    if entry.kind == "layer":
        LayerNorm.__init__(new, shape, eps=eps, elementwise_affine=weight is not None,
                           bias=False, device="meta", upcast=entry.upcast)
    else:
        RMSNorm.__init__(new, shape, eps=eps, device="meta", offset=entry.offset,
                         round_xhat=entry.round_xhat)
    if weight is not None:
        new.weight = weight                      # the Parameter itself: device, dtype, optimizer
    new.training = old.training
    for key, value in vars(old).items():
        if (key.startswith("_") and "hooks" in key) or key == "_is_full_backward_hook" or (
                key not in new.__dict__ and key != entry.weight
                and not isinstance(getattr(type(new), key, None), property)):
            new.__dict__[key] = value           # (variance_epsilon is eps's property)


def _why_not(module: torch.nn.Module, entry: Optional[HFNorm] = None) -> str | None:
    """Why a norm of a known class must still be left as it is, or None."""
    if entry is not None and entry.kind == "layer" and entry.weight is not None and getattr(
            module, entry.weight).dim() != 1:
        return ("its weight has several dims but it normalizes over the last one (a per-head "
                "QK-norm), which normbook.LayerNorm's normalized_shape cannot say")
    if torch.nn.utils.parametrize.is_parametrized(module):
        return ("parametrized (its weight is computed where it is read): swap before "
                "registering the parametrization")
    if "forward" in vars(module):
        return ("its forward is replaced on the instance (accelerate's hooks, say), which would "
                "still run instead: swap before dispatching the model or adding such hooks")
    return None


def _dtype_of(module: torch.nn.Module, entry: HFNorm, model: torch.nn.Module) -> torch.dtype:
    """The dtype a norm is judged in under ``strict``: its weight's, or for a class without
    one (OLMo's), the model's (its first floating parameter's; float32 if it has none)."""
    if entry.weight is not None:
        return getattr(module, entry.weight).dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _looks_like_a_norm(cls: type) -> bool:
    return cls.__name__.endswith(("RMSNorm", "LayerNorm"))


def _check_strict(strict) -> None:
    """``strict`` a bool: "no" was taken as true."""
    if type(strict) is not bool:
        raise TypeError(f"strict: expected a bool, got {strict!r}")


def swap_norms(model: torch.nn.Module, *, strict: bool = True) -> int:
    """Replace the norms of ``model`` in place by normbook's modules; return how many.

    ``torch.nn.LayerNorm`` computes (ln-y) and becomes :class:`normbook.LayerNorm`;
    ``torch.nn.RMSNorm`` computes (rms-y) and becomes :class:`normbook.RMSNorm` (the object
    stays, its class changes). A Hugging Face norm in :data:`normbook.swap.HF_NORMS` that
    computes (rms-y), ``weight * x * rsqrt(mean(x^2) + variance_epsilon)``, becomes a
    :class:`normbook.RMSNorm` with gamma = its ``weight`` (the same Parameter) and eps = its
    ``variance_epsilon``, in every place the model holds it (T5's, a subclass of it: see the
    module docstring). Norms already normbook's are not counted, so a second call returns 0.

    The replacement takes the entry's ``offset`` (Gemma's 1 + weight) and ``round_xhat`` (a
    Llama-style norm's rounding of xhat before the weight multiplies, in bf16 and fp16), so
    that it is the class's forward op for op in float32, bfloat16 and float16.

    Left alone, with one ``UserWarning`` per class naming it: with ``strict`` (the default)
    registry classes whose weight dtype is not in their entry's ``exact`` (float64, where
    Hugging Face computes in float32); subclasses of torch's norms that are not normbook's
    (their forward may differ); other classes named ``*LayerNorm`` or ``*RMSNorm`` that the
    registry does not know.

    Also left alone, with the reason: a norm whose forward was replaced on the instance
    (accelerate's hooks: theirs would still run, so swap before dispatching the model) and a
    parametrized one (swap before registering the parametrization).

    Swapped but not always called: ``torch.nn.TransformerEncoderLayer`` (and so
    ``TransformerEncoder``) in eval mode without gradients takes torch's fused "fast path",
    which reads its norms' weight, bias and eps and computes them itself, never calling their
    forward (measured on torch 2.13, CPU: none of the two norms' forwards ran in eval under
    ``torch.no_grad()``, both in training). Its output is then torch's LayerNorm's, not
    normbook's kernels'.

    "Exact" means the same operations in the same precision, for inputs in the weight's dtype
    (the one dtype known when swapping). ``strict`` judges the dtype at the swap: swap after
    casting the model (``model.bfloat16()`` after a swap in float32 is not refused). An input
    of another dtype than the weight (a bf16 input to a float32 Llama norm, as autocast on a
    CPU gives Qwen3's q/k norms) gives Hugging Face's dtype and bits too, for every pairing of
    float32, bfloat16 and float16 and every registry class (tests/test_swap.py checks each on
    the CPU): a Llama-style norm gives ``weight * xhat.to(input dtype)`` in the promoted dtype
    (float32 for that bf16 input), as normbook's ``round_xhat`` does; a Gemma-style, OLMo or
    Cohere norm the input's dtype; T5's the weight's (see the module docstring). The forward
    of a swapped norm gives the same bits on the CPU; the backward is normbook's (rms-dx), not
    autograd's chain through the forward's ops, so gradients agree to rounding, as do torch's
    LayerNorm and normbook's (a different order of the same sums).

    Args:
        model: the model; changed in place. Its root must not itself be a Hugging Face norm
            (there is no parent to put the replacement in).
        strict: swap a registry class only in the dtypes where it is exact (see above).

    Returns:
        int: the number of norm modules replaced.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    _check_strict(strict)
    done: dict[int, torch.nn.Module] = {}        # id(old) -> its replacement (a shared norm once)
    left: dict[str, str] = {}                     # class name -> why it was left alone
    for module in list(model.modules()):
        cls = type(module)
        where = f"{cls.__module__}.{cls.__qualname__}"
        if isinstance(module, (LayerNorm, RMSNorm)):   # normbook's already (parametrized too)
            continue
        if (isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or _looks_like_a_norm(cls)
                ) and (why := _why_not(module, _entry(cls))) is not None:
            left[where] = why
            continue
        if cls is torch.nn.LayerNorm:
            module.__class__ = LayerNorm
            done[id(module)] = module
        elif cls is torch.nn.RMSNorm:
            module.__class__ = RMSNorm
            done[id(module)] = module
        elif isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
            left[where] = "a subclass of torch's norm whose forward may differ"
        elif (entry := _entry(cls)) is not None:
            dtype = _dtype_of(module, entry, model)
            if not entry.exact:
                left[where] = entry.note
            elif strict and dtype not in entry.exact:
                left[where] = (f"in {dtype} normbook rounds differently "
                                          f"({entry.note}); swap_norms(..., strict=False) swaps it")
            elif module is model:
                raise TypeError(f"swap_norms: the model is itself a {cls.__qualname__}; "
                                "pass a module that contains it")
            else:
                done[id(module)] = _replacement(module, entry, strict)
        elif _looks_like_a_norm(cls):
            left[where] = "not in normbook.swap.HF_NORMS"
    # every name of every parent: named_children() gives a module held under two names of
    # one parent (s.a = s.b = norm, ModuleList([norm] * 3)) at its first name only
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            new = done.get(id(child))
            if new is not None and new is not child:
                setattr(parent, name, new)
    for name, why in left.items():
        warnings.warn(f"normbook.swap_norms left {name} as it is: {why}", UserWarning,
                      stacklevel=2)
    return len(done)


# (modeling module, class name) -> [the class found before the first active patch, then each
# active patch and the class it put there, oldest first]: the module holds the newest's class,
# so patches nest and may be undone in any order
_LAYERS: dict[tuple[str, str], list] = {}


class HFPatch:
    """What :func:`normbook.patch_hf` changed: the Hugging Face modeling modules whose norm class it
    replaced, undone by :meth:`undo` (or on leaving a ``with`` block). ``classes`` names the
    replaced classes; ``left`` the known ones it left, with the reason.

    Patches nest: each class name holds the class of the newest patch still in force, and
    undoing a patch (in any order) leaves the others' in force; when none is left, the class
    found before the first is put back."""

    def __init__(self, replaced: list, left: dict) -> None:
        # replaced: (modeling module, class name, patched class) for each, put in place here
        self._replaced = []                    # (modeling module, class name)
        for module, name, cls in replaced:
            layers = _LAYERS.setdefault((module.__name__, name), [getattr(module, name)])
            layers.append((self, cls))
            setattr(module, name, cls)
            self._replaced.append((module, name))
        self.classes = tuple(f"{m.__name__}.{name}" for m, name in self._replaced)
        self.left = left

    def undo(self) -> None:
        """Take this patch's classes out: each name gets the class of the newest patch still in
        force, or the original when there is none (models built meanwhile keep normbook's
        norms). A second call does nothing."""
        for module, name in reversed(self._replaced):
            key = (module.__name__, name)
            layers = _LAYERS[key]
            layers[1:] = [layer for layer in layers[1:] if layer[0] is not self]
            setattr(module, name, layers[-1][1] if len(layers) > 1 else layers[0])
            if len(layers) == 1:
                del _LAYERS[key]
        self._replaced = []

    def __enter__(self) -> "HFPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"HFPatch(classes={self.classes!r})"


def _family(entry: HFNorm) -> str:
    return entry.module.split(".")[2]        # transformers.models.<family>.modeling_<family>


# (modeling module, class name, strict) -> the class patch_hf puts there: one class each, so
# that a copy, or a model unpickled while it is in force, has the very class of the model
_PATCHED: dict[tuple[str, str, bool], Any] = {}


def _patched(module: str, name: str, strict: bool) -> Any:
    """The class :func:`patch_hf` puts in place of ``module.name`` (Hugging Face's class, or
    what another library put there before the first patch), made on first use."""
    found = getattr(importlib.import_module(module), name)
    original = getattr(found, "_normbook_original", found)
    cls = _PATCHED.get((module, name, strict))
    if cls is None or cls._normbook_original is not original:
        cls = _PATCHED[(module, name, strict)] = _patched_class(
            _BY_CLASS[(module, name)], original, strict)
    return cls


def _rebuild(module: str, name: str, strict: bool) -> torch.nn.Module:
    """An empty instance of ``_patched(module, name, strict)``, which copy and pickle then
    fill with the state: how a patched norm is copied and unpickled, with or without a patch
    in force (a patched class's ``__reduce_ex__``)."""
    cls = _patched(module, name, strict)
    return cls.__new__(cls)


def _t5_mixed(norm: RMSNorm, x: torch.Tensor, original: Any) -> torch.Tensor:
    """T5's norm of rows of another dtype than its weight, y = weight * xhat.to(weight's dtype)
    for a half weight (the product in that dtype), weight * xhat in float32 for a float32 one,
    xhat = (rms-y) of the rows in float32: normbook's xhat without a weight, then T5's rounding
    and product (bitwise T5's for every pairing of float32, bfloat16 and float16 on the CPU). A
    float64 input or weight goes to T5's own forward, whose mixed float32/float64 order normbook
    has no mode for."""
    weight = norm.weight
    if x.dtype not in _HALVES or weight.dtype not in _HALVES:
        return original.forward(norm, x)
    h = x.float()                                                         # (*, D)
    if weight.dtype == torch.float32:
        return rms_norm(h, norm.normalized_shape, weight, norm.eps)
    return weight * rms_norm(h, norm.normalized_shape, None, norm.eps).to(weight.dtype)


def _patched_class(entry: HFNorm, original: Any, strict: bool) -> type:
    """A :class:`normbook.RMSNorm` (``normbook.LayerNorm``) that Hugging Face's model code
    builds in place of ``original``: the same constructor, the same ``weight`` Parameter (its
    state_dict key) and attributes (``variance_epsilon``), computed by normbook where it
    reproduces ``original`` (the weight's dtype in ``entry.exact``, or anywhere without
    ``strict``) and by ``original``'s own forward elsewhere, so a model is exact in every dtype.

    The class carries ``original``'s helper methods that normbook's lacks (Gemma's ``_norm``),
    which that forward calls; it is ``original``'s name and module, but pickles by
    :func:`_rebuild` (see the module docstring)."""

    base = LayerNorm if entry.kind == "layer" else RMSNorm

    def __new__(cls, *args, **kwargs):
        if not args and not kwargs:         # copy, pickle, nn.Module's replicas: state follows
            return base.__new__(cls)
        proto = original(*args, **kwargs)   # its parameters, as its model code asks for them
        if _why_not(proto, entry) is not None:
            return proto                    # (a per-head QK-norm): the original, as it is
        new = base.__new__(cls)
        new.__dict__["_normbook_proto"] = proto
        return new

    @functools.wraps(original.__init__)     # its signature, (hidden_size, eps=...), for inspect
    def __init__(self, *args, **kwargs):
        proto = self.__dict__.pop("_normbook_proto", None)
        _adopt(self, original(*args, **kwargs) if proto is None else proto, entry)

    def forward(self, hidden_states):
        dtype = hidden_states.dtype if entry.weight is None else self.weight.dtype
        if strict and dtype not in entry.exact:
            return original.forward(self, hidden_states)
        if entry.xhat_to_weight and hidden_states.dtype != dtype:
            return _t5_mixed(self, hidden_states, original)
        return base.forward(self, hidden_states)

    def __reduce_ex__(self, protocol):
        return _rebuild, (entry.module, entry.name, strict), self.__getstate__()

    helpers = {key: value for klass in reversed(original.__mro__)
               if issubclass(klass, torch.nn.Module) and klass is not torch.nn.Module
               for key, value in vars(klass).items()
               if not key.startswith("__") and not hasattr(base, key)}
    return type(original.__name__, (base,), {
        **helpers, "__new__": __new__, "__init__": __init__, "forward": forward,
        "__reduce_ex__": __reduce_ex__, "__module__": original.__module__,
        "__qualname__": original.__qualname__, "_normbook_original": original,
        "__doc__": f"normbook's {base.__name__} in place of {original.__module__}."
                   f"{original.__qualname__} "
                   f"(normbook.patch_hf): {entry.note}"})


def patch_hf(families: Optional[Union[str, Iterable[str]]] = None, *,
             strict: bool = True) -> HFPatch:
    """Make Hugging Face's model code build normbook's norms, before a model is loaded, as
    Liger's ``apply_liger_kernel_to_*``: each norm class of :data:`normbook.swap.HF_NORMS` (for
    ``families``, e.g. ``"llama"`` or ``["qwen2", "mistral"]``; None: every family it knows
    that the installed transformers has) is replaced in its modeling module by a
    :class:`normbook.RMSNorm` subclass of the same name and constructor, so that
    ``from_pretrained`` (or a model built from a config) holds normbook's norms, with the
    state_dict keys, parameters and attributes of Hugging Face's.

    Each patched norm computes (rms-y) or (ln-y) by normbook, with the entry's ``offset``,
    ``round_xhat`` or ``upcast``, where that is the class's forward op for op
    (:func:`normbook.swap_norms`'s rule: the weight's dtype in the entry's ``exact``, float32,
    bfloat16 and float16 for every entry, or every dtype with ``strict=False``) and by the
    original class's forward elsewhere (float64, with ``strict``), so the model's outputs are
    Hugging Face's either way; T5's norm also takes rows of another dtype than its weight as
    T5's does (the module docstring says how), so a T5 loaded in float16, whose ``wo`` stays
    in float32, runs and gives Hugging Face's logits.
    An entry without an exact dtype would be left, and named in the result's ``left``.

    The patched classes are made once per class and ``strict`` and kept in ``normbook.swap``:
    a model built under a patch deep-copies (``copy.deepcopy``, ``AveragedModel``) and pickles
    (``torch.save(model)``) with or without a patch in force, and unpickles as normbook's norms
    of the same class, patch or no patch (Cohere's per-head QK-norms, which stay Hugging Face's,
    pickle by their class's name: only while no patch of Cohere is in force). Patches nest:
    an inner ``patch_hf`` undone leaves an outer one in force, whichever is undone first.

    Returns:
        HFPatch: a ``normbook.swap.HFPatch``, whose ``undo()`` (or a ``with`` block)
            takes its classes out, leaving those of any other patch in force and otherwise the
            originals; models built meanwhile keep normbook's norms.

    Raises:
        ValueError: a family :data:`normbook.swap.HF_NORMS` does not know, named.
        ImportError: a family named explicitly whose modeling module transformers lacks.
    """
    _check_strict(strict)
    known = {_family(e) for e in HF_NORMS}
    if families is None:
        wanted, explicit = known, False
    else:
        names = (families,) if isinstance(families, str) else (
            tuple(families) if isinstance(families, Iterable) else None)
        if names is None or not all(isinstance(f, str) for f in names):
            raise TypeError(f"families: expected a family's name or an iterable of names, got "
                            f"{families!r}")
        wanted = set(names)
        explicit = True
        unknown = sorted(wanted - known)
        if unknown:
            raise ValueError(f"families: expected some of {sorted(known)}, got {unknown}")
    replaced, left = [], {}
    for entry in HF_NORMS:
        if _family(entry) not in wanted:
            continue
        if not entry.exact:
            left[f"{entry.module}.{entry.name}"] = entry.note
            continue
        try:
            module = importlib.import_module(entry.module)
        except ImportError:
            if explicit:
                raise
            continue             # an older transformers without this family
        replaced.append((module, entry.name, _patched(entry.module, entry.name, strict)))
    return HFPatch(replaced, left)
