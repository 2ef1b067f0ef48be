"""normbook.swap_norms: torch's and Hugging Face's norms replaced in place, the model unchanged.

The Hugging Face tests build tiny random models from configs (nothing is downloaded) and compare
a swapped copy with the original in fp32. Forward: a Llama-style RMSNorm swapped is the same
operations in the same order, so Llama's logits are bitwise equal; torch's LayerNorm and
normbook's order the same sums differently (torch's fused kernel against the formulas that a
recorded graph takes), so GPT-2's logits agree to rounding. Backward: the swapped model runs
normbook's (rms-dx) / (ln-dx) where the original runs autograd's chain through the forward's
ops: the same terms in another order, a few units of rounding apart in each norm's dx, and that
difference travels through the layers around it. The tolerance, 16 units of fp32 rounding of the
largest entry of each tensor, is about ten times the difference measured on these models.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import warnings

import pytest
import torch

import normbook
from normbook import swap

ULPS = 16


def assert_rounding_close(got, want, what=""):
    """got == want within ULPS units of fp32 rounding of want's largest entry (see the module
    docstring for why this many)."""
    atol = ULPS * torch.finfo(torch.float32).eps * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=lambda m: f"{what}: {m}")


def norm_modules(model, cls):
    return [m for m in model.modules() if type(m) is cls]


# ------------------------------------------------------------------------------ torch's norms

def test_torch_norms_in_a_sequential_become_normbooks_and_keep_everything():
    torch.manual_seed(0)
    shared = torch.nn.LayerNorm(16)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), shared, torch.nn.Linear(16, 16), torch.nn.RMSNorm(16, eps=1e-6),
        torch.nn.LayerNorm(16, elementwise_affine=False), shared)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.eval()
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    calls = []
    shared.register_forward_hook(lambda *args: calls.append(1))
    x = torch.randn(4, 8)
    want = model(x)
    assert len(calls) == 2

    assert normbook.swap_norms(model) == 3          # the shared norm is one module
    assert type(model[1]) is normbook.LayerNorm and model[5] is model[1] is shared
    assert type(model[3]) is normbook.RMSNorm and type(model[4]) is normbook.LayerNorm
    assert model[3].eps == 1e-6 and not model.training
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    got = model(x)
    assert len(calls) == 4                            # the hook stayed with the module
    assert_rounding_close(got, want, "output")
    assert normbook.swap_norms(model) == 0            # idempotent


def test_a_subclass_of_a_torch_norm_is_left_alone_with_a_warning():
    class MyLayerNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return super().forward(x.float()).type_as(x)

    model = torch.nn.Sequential(MyLayerNorm(8), MyLayerNorm(8), torch.nn.LayerNorm(8))
    with pytest.warns(UserWarning, match="MyLayerNorm as it is") as record:
        assert normbook.swap_norms(model) == 1
    assert len([w for w in record if "MyLayerNorm" in str(w.message)]) == 1
    assert type(model[0]) is MyLayerNorm


def test_meta_device_model():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                                    torch.nn.RMSNorm(8))
    assert normbook.swap_norms(model) == 2
    assert all(p.is_meta for p in model.parameters())
    assert model(torch.empty(2, 8, device="meta")).shape == (2, 8)


# ------------------------------------------------------------------------------ Hugging Face

transformers = pytest.importorskip(
    "transformers", reason="transformers (the dev extra) is not installed: no Hugging Face models")


def tiny(kind):
    """A tiny random model of the family ``kind``, built from a config (no download)."""
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100,
                                      n_positions=16, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       vocab_size=100)
        model = transformers.GemmaForCausalLM(cfg)
    with torch.no_grad():                        # norms initialised to 1 (or 0) test too little
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()                          # GPT-2's dropout off; gradients still flow


def logits_and_grads(model, ids):
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind, norm_class, expected", [
    ("llama", "transformers.models.llama.modeling_llama.LlamaRMSNorm", 5),   # 2 a layer, 1 final
    ("gpt2", "torch.nn.LayerNorm", 5),                                       # ln_1, ln_2; ln_f
])
def test_swapped_model_gives_the_originals_logits_and_gradients(kind, norm_class, expected):
    module, name = norm_class.rsplit(".", 1)
    norm_class = getattr(importlib.import_module(module), name)
    original = tiny(kind)
    model = copy.deepcopy(original)
    assert len(norm_modules(model, norm_class)) == expected
    params = dict(model.named_parameters())
    keys = list(model.state_dict())

    assert normbook.swap_norms(model) == expected
    assert not norm_modules(model, norm_class)
    swapped = norm_modules(model, normbook.RMSNorm) + norm_modules(model, normbook.LayerNorm)
    assert len(swapped) == expected
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())    # the Parameters themselves
    assert all(not m.training for m in swapped)
    assert normbook.swap_norms(model) == 0

    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    want, want_grads = logits_and_grads(original, ids)
    got, got_grads = logits_and_grads(model, ids)
    if kind == "llama":
        assert torch.equal(got, want)            # the same operations in the same order
    else:
        assert_rounding_close(got, want, "logits")
    for name, g in want_grads.items():
        assert_rounding_close(got_grads[name], g, name)


def test_a_norm_held_under_several_names_becomes_one_module_everywhere():
    """Aliases in one parent (two attributes; a ModuleList of one norm three times) and across
    parents: every name holds the same replacement, torch's norms and Hugging Face's alike (a
    torch norm keeps its identity; a Hugging Face one is replaced by one module, not one per
    name)."""
    llama = tiny("llama")
    hf = llama.model.norm
    ln = torch.nn.LayerNorm(32)
    model = torch.nn.Module()
    model.a, model.b = hf, hf
    model.many = torch.nn.ModuleList([hf] * 3)
    model.inner = torch.nn.Sequential(hf, ln)
    model.ln, model.lns = ln, torch.nn.ModuleList([ln, ln])
    assert normbook.swap_norms(model) == 2
    new = model.a
    assert type(new) is normbook.RMSNorm and new.weight is hf.weight
    assert model.b is new and all(m is new for m in model.many) and model.inner[0] is new
    assert type(ln) is normbook.LayerNorm
    assert model.ln is ln and model.inner[1] is ln and all(m is ln for m in model.lns)
    assert not [m for m in model.modules() if type(m) is type(hf)]


def test_llama_norm_maps_weight_and_eps_and_keeps_hooks():
    model = tiny("llama")
    old = model.model.norm
    calls = []
    handle = old.register_forward_hook(lambda *args: calls.append(1))
    model.train()
    normbook.swap_norms(model)
    new = model.model.norm
    assert type(new) is normbook.RMSNorm and new.weight is old.weight
    assert new.eps == old.variance_epsilon and new.normalized_shape == (32,) and new.training
    model(torch.zeros(1, 3, dtype=torch.long))
    assert calls == [1]
    handle.remove()                              # the handle still reaches the hook
    model(torch.zeros(1, 3, dtype=torch.long))
    assert calls == [1]


def test_a_swapped_llama_norm_keeps_its_own_attributes_and_survives_init_weights():
    """The replacement keeps the attributes the Hugging Face module carried
    (``_is_hf_initialized``, ``variance_epsilon``): without the first, ``init_weights`` reset a
    trained norm weight to ones after the swap."""
    model = tiny("llama")
    normbook.swap_norms(model)
    norm = model.model.norm
    assert norm.variance_epsilon == norm.eps
    with torch.no_grad():
        norm.weight.fill_(5.0)
    model.init_weights()
    assert torch.equal(norm.weight, torch.full_like(norm.weight, 5.0))


def test_a_write_to_variance_epsilon_reaches_the_swapped_and_the_patched_norm():
    """Hugging Face's name for eps is the modules' alias of it, read and written: a swapped or
    patched Llama norm kept a copy of its own, which a later write changed while the norm went
    on with the old eps (2.3 apart at x ~ 1e-3), and the patched class's strict fallback read
    the copy."""
    from transformers.models.llama import modeling_llama as ML

    x = torch.randn(2, 32) * 1e-3
    ref = ML.LlamaRMSNorm(32, eps=1e-6)
    swapped = torch.nn.Sequential(copy.deepcopy(ref))
    normbook.swap_norms(swapped)
    with normbook.patch_hf("llama"):
        patched = ML.LlamaRMSNorm(32, eps=1e-6)
    for norm in (swapped[0], patched):
        ref.variance_epsilon = norm.variance_epsilon = 0.5
        assert norm.eps == 0.5 and "variance_epsilon" not in vars(norm)
        torch.testing.assert_close(norm(x), ref(x))
    plain = normbook.LayerNorm(4)
    plain.variance_epsilon = 1e-3
    assert plain.eps == 1e-3
    torch.jit.script(plain)                     # (TorchScript leaves the property out)

def test_norms_with_an_instance_forward_or_a_parametrization_are_left_with_the_reason():
    """A forward replaced on the instance (as accelerate's hooks do) would still run instead
    of normbook's, and a parametrized weight is computed where it is read: such norms are left
    as they are, with a warning that says so; normbook's own parametrized norms stay silent."""
    from torch.nn.utils import parametrize

    class Scale(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    hooked = torch.nn.LayerNorm(8)
    hooked.forward = lambda x: torch.nn.LayerNorm.forward(hooked, x)
    param = torch.nn.LayerNorm(8)
    parametrize.register_parametrization(param, "weight", Scale())
    ours = normbook.RMSNorm(8)
    parametrize.register_parametrization(ours, "weight", Scale())
    model = torch.nn.Sequential(hooked, param, ours)
    with pytest.warns(UserWarning) as record:
        assert normbook.swap_norms(model) == 0
    messages = " ".join(str(w.message) for w in record)
    assert "replaced on the instance" in messages and "parametrized" in messages
    assert len(record) == 2 and type(hooked) is torch.nn.LayerNorm


def test_an_optimizer_built_before_the_swap_still_trains_the_norms():
    model = tiny("llama")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    normbook.swap_norms(model)
    before = model.model.norm.weight.detach().clone()
    ids = torch.randint(0, 100, (2, 5))
    model(ids, labels=ids).loss.backward()
    opt.step()
    assert not torch.equal(model.model.norm.weight, before)


def test_gemma_is_swapped_exactly_with_offset_one():
    """Gemma's norms, y = (xhat * (1.0 + weight.float())).type_as(x), become normbook's with
    offset 1: the same weight Parameter (a checkpoint's values, without the 1), the same logits
    to the bit in float32 and bfloat16, no warning."""
    for dtype in (torch.float32, torch.bfloat16):
        ref = tiny("gemma").to(dtype)
        with torch.no_grad():
            for m in ref.modules():
                if type(m).__name__ == "GemmaRMSNorm":
                    m.weight.normal_()      # Gemma initialises them to 0: make them count
        model = copy.deepcopy(ref)
        weights = [m.weight for m in model.modules() if type(m).__name__ == "GemmaRMSNorm"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert normbook.swap_norms(model) == 5
        norms = norm_modules(model, normbook.RMSNorm)
        assert [m.weight for m in norms] == weights and all(m._modes == (1.0, False) for m in norms)
        ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
        assert torch.equal(model(ids).logits, ref(ids).logits), dtype


def _same_logits_close_grads(model, ref, ids, tol):
    """The swapped model's logits bitwise the reference's, each parameter's gradient (of the
    mean square logit) within ``tol`` of the largest entry of the reference's; the logits."""
    got, want = model(ids).logits, ref(ids).logits
    assert torch.equal(got, want)
    got.float().square().mean().backward()
    want.float().square().mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        scale = q.grad.abs().max().item()
        assert (p.grad - q.grad).abs().max().item() <= tol * scale, name
    return want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_llama_is_swapped_exactly(dtype):
    """In bf16 and fp16 a Llama norm rounds xhat before the weight multiplies; its replacement
    does too (round_xhat): swapped under strict, the logits bitwise the unswapped model's, the
    gradients within a unit of the half dtype's rounding (each norm's backward is normbook's;
    on this machine they came out bitwise equal)."""
    ref = tiny("llama").to(dtype)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert normbook.swap_norms(model) == 5
    norms = norm_modules(model, normbook.RMSNorm)
    assert all(m.weight.dtype == dtype and m._modes == (0.0, True) for m in norms)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    _same_logits_close_grads(model, ref, ids, torch.finfo(dtype).eps)


def test_float64_llama_is_left_under_strict():
    """Hugging Face's Llama norm computes a float64 model's norm in float32; normbook's would
    in float64: left with the reason under strict, swapped without it."""
    model = tiny("llama").to(torch.float64)
    with pytest.warns(UserWarning, match=r"LlamaRMSNorm as it is: in torch.float64"):
        assert normbook.swap_norms(model) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert normbook.swap_norms(model, strict=False) == 5


def test_meta_device_llama():
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100))
    assert normbook.swap_norms(model) == 5
    assert all(m.weight.is_meta for m in norm_modules(model, normbook.RMSNorm))


def test_the_root_cannot_be_a_hugging_face_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    with pytest.raises(TypeError, match="itself a LlamaRMSNorm"):
        normbook.swap_norms(LlamaRMSNorm(8))


@pytest.mark.parametrize("entry", swap.HF_NORMS, ids=lambda e: e.name)
def test_every_registry_entry_is_a_real_class_that_the_swap_reproduces(entry):
    """Each entry names a class of the installed transformers; where it is swapped, the
    replacement's forward is bitwise the class's in its exact dtypes, its gradients agree to
    rounding; where it is not, the swap leaves it and says why."""
    cls = getattr(importlib.import_module(entry.module), entry.name)
    torch.manual_seed(0)
    D = 48
    takes_eps = "eps" in inspect.signature(cls.__init__).parameters
    for dtype in entry.exact or (torch.float32,):
        norm = torch.nn.Sequential(cls(D, eps=1e-5) if takes_eps else cls(D)).to(dtype)
        params = [] if entry.weight is None else [getattr(norm[0], entry.weight)]
        with torch.no_grad():
            for p in params:
                p.normal_()
        x = (3 * torch.randn(4, 5, D) + 1).to(dtype).requires_grad_()
        dy = torch.randn(4, 5, D).to(dtype)
        want = norm(x)
        want_grads = torch.autograd.grad(want, (x, *params), dy)
        if not entry.exact:
            with pytest.warns(UserWarning, match=f"left {entry.module}.{entry.name} as it is"):
                assert normbook.swap_norms(norm) == 0
            return
        assert normbook.swap_norms(norm) == 1
        kind = normbook.LayerNorm if entry.kind == "layer" else normbook.RMSNorm
        # (T5's: the class patch_hf builds, a subclass that looks at each input's dtype)
        assert (isinstance(norm[0], kind) if entry.xhat_to_weight else type(norm[0]) is kind)
        assert norm[0].eps == 1e-5
        got = norm(x)
        assert got.dtype == want.dtype and torch.equal(got, want), (entry.name, dtype)
        params = [] if entry.weight is None else [norm[0].weight]
        got_grads = torch.autograd.grad(got, (x, *params), dy)
        if dtype == torch.float32:
            for g, w, what in zip(got_grads, want_grads, ("dx", "dweight")):
                assert_rounding_close(g, w, what)


# ------------------------------------------------------------------ patching before loading

def test_patch_hf_makes_models_build_normbooks_norms_until_undone(tmp_path):
    """patch_hf("llama"): a model built from a config, and one from from_pretrained, hold
    normbook's RMSNorm under Hugging Face's class name, with Hugging Face's state_dict keys and
    bitwise its fp32 logits; bf16 under strict runs the original forward (exact, not faster);
    undo puts the class back, and models built before keep normbook's norms."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaRMSNorm
    ref = tiny("llama")
    ref.save_pretrained(tmp_path)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with normbook.patch_hf("llama") as patch:
        assert patch.classes == ("transformers.models.llama.modeling_llama.LlamaRMSNorm",)
        built = tiny("llama")
        loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
        half = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
        assert modeling_llama.LlamaRMSNorm is not original
    assert modeling_llama.LlamaRMSNorm is original
    ref_half = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for model in (built, loaded, half):
        norms = [m for m in model.modules() if "RMSNorm" in type(m).__name__]
        assert norms and all(isinstance(m, normbook.RMSNorm) for m in norms)
        assert sorted(model.state_dict()) == sorted(ref.state_dict())
    assert built.model.norm.variance_epsilon == built.model.norm.eps == ref.model.norm.variance_epsilon
    assert torch.equal(built(ids).logits, ref(ids).logits)
    assert torch.equal(loaded(ids).logits, ref(ids).logits)
    assert torch.equal(half(ids).logits, ref_half(ids).logits)
    assert not any(isinstance(m, normbook.RMSNorm) for m in tiny("llama").modules())


def test_patch_hf_every_family_and_its_refusals():
    """None patches every family the registry swaps (and names those it leaves: Gemma's);
    patching twice and undoing both restores the original; a family it does not know is a
    ValueError naming it."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3

    originals = modeling_llama.LlamaRMSNorm, modeling_qwen3.Qwen3RMSNorm
    first = normbook.patch_hf()
    second = normbook.patch_hf(["llama", "qwen3"])
    try:
        swapped = {e.name for e in swap.HF_NORMS if e.exact}
        assert {c.rsplit(".", 1)[1] for c in first.classes} == swapped
        assert {c.rsplit(".", 1)[1] for c in first.left} == {e.name for e in swap.HF_NORMS if not e.exact}
        assert issubclass(modeling_qwen3.Qwen3RMSNorm, normbook.RMSNorm)
    finally:
        second.undo()
        first.undo()
    assert (modeling_llama.LlamaRMSNorm, modeling_qwen3.Qwen3RMSNorm) == originals
    with pytest.raises(ValueError, match=r"families: expected .* got \['gpt7'\]"):
        normbook.patch_hf(["llama", "gpt7"])


def test_cohere_and_olmo_layernorms_are_swapped_and_per_head_norms_left():
    """Cohere's and OLMo's LayerNorms without bias become normbook.LayerNorm (OLMo's without
    parameters): fp32 logits to the bit. Cohere's QK-norm holds a weight per head, (heads,
    head_dim), normalized over the last dim only: left, with the reason."""
    cohere = transformers.CohereForCausalLM(transformers.CohereConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, use_qk_norm=True, eos_token_id=0, pad_token_id=0,
        bos_token_id=0))
    olmo = transformers.OlmoForCausalLM(transformers.OlmoConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, eos_token_id=0, pad_token_id=0, bos_token_id=0))
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    # Cohere: a norm per layer (attention and MLP in parallel) and the final one; OLMo: two
    # per layer and the final one
    for model, swapped in ((cohere, 3), (olmo, 5)):
        want = model(ids).logits
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert normbook.swap_norms(model) == swapped
        assert torch.equal(model(ids).logits, want)
        if model is cohere:
            (message,) = [str(w.message) for w in record]
            assert "CohereLayerNorm as it is: its weight has several dims" in message
            assert sum(type(m).__name__ == "CohereLayerNorm" for m in model.modules()) == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_olmo_and_cohere_are_swapped_exactly(dtype):
    """OLMo's LayerNorm is torch's float32 LayerNorm of a float32 copy: normbook's with
    ``upcast=True``, swapped under strict in half precision, the logits bitwise the unswapped
    model's (hidden 256: a width where torch's kernel for half rows would round some values
    differently), the gradients within a few units of rounding of each parameter's largest
    (norms' backwards that round differently by a unit, carried back through attention: over
    12 random models, the worst was 2.8 units in fp16, 1.0 in bf16; the bound is 4, and the
    models are seeded). Cohere's writes its equations in
    torch ops: normbook's with ``upcast="ops"``, swapped under strict, logits and gradients
    bitwise (the same ops, so autograd's same chain), with and without autograd recording."""
    torch.manual_seed(0)
    ref = transformers.OlmoForCausalLM(transformers.OlmoConfig(
        hidden_size=256, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, eos_token_id=0, pad_token_id=0,
        bos_token_id=0)).to(dtype)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert normbook.swap_norms(model) == 5
    assert all(m._upcast for m in norm_modules(model, normbook.LayerNorm))
    ids = torch.randint(0, 100, (4, 33), generator=torch.Generator().manual_seed(0))
    want = _same_logits_close_grads(model, ref, ids, 4 * torch.finfo(dtype).eps)
    with normbook.patch_hf("olmo"):           # built by Hugging Face's code: the same bits
        patched = transformers.OlmoForCausalLM(ref.config).to(dtype)
    patched.load_state_dict(ref.state_dict())
    assert all(isinstance(m, normbook.LayerNorm) and m._upcast for m in patched.modules()
               if type(m).__name__ == "OlmoLayerNorm")
    assert torch.equal(patched(ids).logits, want)
    ref = transformers.CohereForCausalLM(transformers.CohereConfig(
        hidden_size=256, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, eos_token_id=0, pad_token_id=0,
        bos_token_id=0)).to(dtype)
    with torch.no_grad():                     # weights that are not all 1
        for m in ref.modules():
            if type(m).__name__ == "CohereLayerNorm":
                m.weight.normal_(1.0, 0.5)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert normbook.swap_norms(model) == 3
    assert all(m._upcast == "ops" for m in norm_modules(model, normbook.LayerNorm))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    _same_logits_close_grads(model, ref, ids, 0.0)
    for norm, ref_norm in zip(norm_modules(model, normbook.LayerNorm),
                              [m for m in ref.modules() if type(m).__name__ == "CohereLayerNorm"]):
        assert torch.equal(norm.weight.grad, ref_norm.weight.grad)


# ------------------------------------------- dtype pairings, float64, copies, pickles, nesting

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _registry_norm(entry, cls, D=48):
    """A norm of ``entry``'s class ``cls`` (Hugging Face's or the patched one), its weight
    random (the classes initialise it to 1 or 0, which would hide a wrong offset)."""
    hf_cls = getattr(cls, "_normbook_original", cls)
    norm = cls(D, eps=1e-5) if "eps" in inspect.signature(hf_cls.__init__).parameters else cls(D)
    if entry.weight is not None:
        with torch.no_grad():
            getattr(norm, entry.weight).normal_(generator=torch.Generator().manual_seed(0))
    return norm


@pytest.mark.parametrize("entry", [e for e in swap.HF_NORMS if e.exact], ids=lambda e: e.name)
def test_every_registry_class_is_hugging_faces_in_every_dtype_pairing_and_in_float64(entry):
    """Swapped and patched, each class gives Hugging Face's dtype and bits for every (weight,
    input) pairing of float32, bfloat16 and float16 (T5's, whose output takes a half weight's
    dtype, too), and, patched under strict, for float64, by the original forward (which for
    Gemma's calls its helper ``_norm``)."""
    module = importlib.import_module(entry.module)
    original = getattr(module, entry.name)
    with normbook.patch_hf(swap._family(entry)):
        patched_cls = getattr(module, entry.name)
    x = 3 * torch.randn(4, 5, 48, generator=torch.Generator().manual_seed(1)) + 1
    for w_dtype, x_dtype in [(w, i) for w in _DTYPES for i in _DTYPES] + [(torch.float64,) * 2]:
        ref = torch.nn.Sequential(_registry_norm(entry, original)).to(w_dtype)
        swapped = copy.deepcopy(ref)
        if w_dtype in _DTYPES:
            assert normbook.swap_norms(swapped) == 1
        patched = torch.nn.Sequential(_registry_norm(entry, patched_cls)).to(w_dtype)
        assert isinstance(patched[0], (normbook.RMSNorm, normbook.LayerNorm))
        want = ref(x.to(x_dtype))
        for got in (swapped(x.to(x_dtype)), patched(x.to(x_dtype))):
            assert got.dtype == want.dtype and torch.equal(got, want), (w_dtype, x_dtype)


def test_t5_loaded_in_float16_runs_and_gives_hugging_faces_logits(tmp_path):
    """T5 keeps ``wo`` in float32, so in a model loaded in float16 most norms get float32 rows
    with a float16 weight: Hugging Face's returns float16, and so must the patched and the
    swapped norms (a float32 output fails in the next float16 Linear)."""
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        decoder_start_token_id=0)).save_pretrained(tmp_path)
    ids = torch.randint(2, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    load = transformers.T5ForConditionalGeneration.from_pretrained
    ref = load(tmp_path, dtype=torch.float16)
    want = ref(input_ids=ids, labels=ids).logits
    with normbook.patch_hf("t5"):
        patched = load(tmp_path, dtype=torch.float16)
    swapped = copy.deepcopy(ref)
    assert normbook.swap_norms(swapped) == 12           # 2 + 3 a layer, a final one each side
    for model in (patched, swapped):
        assert sum(isinstance(m, normbook.RMSNorm) for m in model.modules()) == 12
        got = model(input_ids=ids, labels=ids).logits
        assert got.dtype == torch.float16 and torch.equal(got, want)


def _tiny_family(family):
    """A tiny model of ``family`` built by Hugging Face's code (so under a patch, with the
    patched classes)."""
    torch.manual_seed(0)
    kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=100, eos_token_id=0, pad_token_id=0,
              bos_token_id=0)
    config, model = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                     "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
                     "olmo": (transformers.OlmoConfig, transformers.OlmoForCausalLM),
                     "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM)}[family]
    return model(config(**kw)).eval()


def _norms(model):
    return [m for m in model.modules() if isinstance(m, (normbook.RMSNorm, normbook.LayerNorm))]


@pytest.mark.parametrize("family", ["llama", "gemma", "olmo", "cohere"])
def test_models_built_under_patch_hf_copy_and_pickle_with_or_without_the_patch(family,
                                                                                 monkeypatch):
    """A model built under patch_hf deep-copies (and AveragedModel copies it) and pickles
    while the patch is in force and after it is undone: each copy holds normbook's norms of
    the very class, new Parameters, the same logits; a blob pickled under the patch loads
    after undo as normbook's norms, not as Hugging Face's class, and loads in a process that
    has not made the class yet (the cache emptied here) as the class made afresh."""
    import pickle

    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with normbook.patch_hf(family):
        model = _tiny_family(family)
        want = model(ids).logits
        classes = {type(m) for m in _norms(model)}
        assert len(classes) == 1 and all(issubclass(c, normbook.RMSNorm if family in (
            "llama", "gemma") else normbook.LayerNorm) for c in classes)
        blob = pickle.dumps(model)
        copies = [copy.deepcopy(model), pickle.loads(blob)]
    copies += [copy.deepcopy(model), pickle.loads(blob), pickle.loads(pickle.dumps(model)),
               torch.optim.swa_utils.AveragedModel(model).module]
    for other in copies:
        assert {type(m) for m in _norms(other)} == classes
        assert all(p is not q for p, q in zip(other.parameters(), model.parameters()))
        assert torch.equal(other(ids).logits, want)
    monkeypatch.setattr(swap, "_PATCHED", {})
    fresh = pickle.loads(blob)
    (cls,) = {type(m) for m in _norms(fresh)}
    assert cls not in classes and cls.__name__ == classes.pop().__name__
    assert torch.equal(fresh(ids).logits, want)


def test_nested_patches_each_undo_only_their_own():
    """An inner patch_hf of a family already patched restores what it found, the outer's
    class, on leaving; undone out of order, each takes only its own classes out, and the
    original comes back when none is left."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    originals = modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm
    with normbook.patch_hf("llama"):
        outer = modeling_llama.LlamaRMSNorm
        with normbook.patch_hf(["llama", "qwen2"]):
            assert issubclass(modeling_qwen2.Qwen2RMSNorm, normbook.RMSNorm)
        assert modeling_llama.LlamaRMSNorm is outer is not originals[0]
        assert modeling_qwen2.Qwen2RMSNorm is originals[1]
    assert (modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm) == originals

    first = normbook.patch_hf("llama")
    second = normbook.patch_hf(["llama", "qwen2"], strict=False)
    lenient = modeling_llama.LlamaRMSNorm
    assert lenient is not first and issubclass(lenient, normbook.RMSNorm)
    first.undo()                                     # out of order: the second stays in force
    assert modeling_llama.LlamaRMSNorm is lenient
    assert issubclass(modeling_qwen2.Qwen2RMSNorm, normbook.RMSNorm)
    second.undo()
    first.undo()                                     # a second undo does nothing
    assert (modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm) == originals
    assert not swap._LAYERS


def test_reset_parameters_of_a_swapped_gemma_norm_is_torchs_and_hugging_faces_init_zeroes_it():
    """What the docs say: ``reset_parameters()`` sets weight = 1 whatever the offset (gamma 2 for
    Gemma's offset 1), for normbook.RMSNorm(D, offset=1.0) and for a swapped or patched Gemma
    norm; Hugging Face's Gemma initialisation zeroes either (the identity)."""
    swapped = tiny("gemma")
    normbook.swap_norms(swapped)
    with normbook.patch_hf("gemma"):
        patched = tiny("gemma")
    x = torch.randn(3, 32)
    for norm in (normbook.RMSNorm(32, offset=1.0), swapped.model.norm, patched.model.norm):
        norm.reset_parameters()
        assert torch.equal(norm.weight, torch.ones(32))
        torch.testing.assert_close(norm(x), 2 * normbook.rms_norm(x, (32,), None, norm.eps))
        if norm is not swapped.model.norm and norm is not patched.model.norm:
            continue
        swapped._init_weights(norm)
        assert torch.equal(norm.weight, torch.zeros(32))


def test_swap_and_patch_name_a_wrong_argument():
    """swap_norms(None) raised "'NoneType' object has no attribute 'modules'", patch_hf(123)
    "'int' object is not iterable", and strict="no" was taken as true."""
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got NoneType"):
        swap.swap_norms(None)
    with pytest.raises(TypeError, match="strict: expected a bool, got 'no'"):
        swap.swap_norms(torch.nn.Linear(2, 2), strict="no")
    with pytest.raises(TypeError, match="families: expected a family's name or an iterable "
                                        "of names, got 123"):
        swap.patch_hf(123)
    with pytest.raises(TypeError, match="strict: expected a bool, got 1"):
        swap.patch_hf(strict=1)
    with pytest.raises(ValueError, match="families: expected some of"):
        swap.patch_hf(f for f in ["no such family"])      # a generator is read once
