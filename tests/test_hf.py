"""Hugging Face models through xkern (CPU: Triton's interpreter): which classes, and whole tiny models.

- Every norm class in the installed transformers is probed; the counts go into the test log (the summary
  at its end), and every class the probe accepts is run through xkern against its own eager forward, bit
  for bit.
- Tiny randomly initialised models of several families (no downloads): logits bit for bit equal to eager in
  bf16, gradients bit for bit where every patched norm has the Llama math (the other variants' backward sums
  in another fp32 order: checked by the oracle per norm, and close), generate, save/load, gradient
  checkpointing, torch.compile(fullgraph=True); instance patching, class patching and the `kernels` layer.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import io
import sys
import warnings

import pytest
import torch
from helpers import DEVICE, GPU, graph_ops, to_numpy

import torch_api
from torch_api import hf
from torch_api.hf import classes, norm_forward, probe, replace
from xkern import reference as R

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# model type -> (extra config, the variants of its norms)
FAMILIES = {
    "llama": ({}, {"llama"}),
    "granite": ({}, {"llama"}),
    "glm4": ({}, {"llama"}),
    "smollm3": ({}, {"llama"}),
    "llama4_text": ({"intermediate_size_mlp": 128, "num_local_experts": 2}, {"llama", "none"}),
    "qwen3": ({}, {"llama"}),
    "gemma": ({}, {"gemma"}),
    "gemma3_text": ({}, {"gemma"}),
    "olmo2": ({}, {"olmo2"}),
}
IDS = torch.tensor([[3, 17, 99, 5, 64, 7]], device=DEVICE)


def _model(model_type: str, dtype=torch.bfloat16):
    """A tiny model with random norm weights (gemma's start at 0, the others' at 1: too easy a test)."""
    extra, _ = FAMILIES[model_type]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY, **extra))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(getattr(m, "weight", None), torch.Tensor) and hf.NORM_NAME.search(type(m).__name__):
                m.weight.normal_(0.0 if "Gemma" in type(m).__name__ else 1.0, 0.5)
    return model.to(DEVICE, dtype)


def _norms(model) -> list:
    return [m for m in model.modules() if hf.norm_math(type(m)) is not None]


def _logits_and_grads(model, ids=IDS):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.reshape(-1).view(torch.uint8))


def _rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@contextlib.contextmanager
def _hub_names(*classes):
    """The `@use_kernel_forward_from_hub("RMSNorm")` marks transformers puts on its norm classes, which it
    leaves off unless the installed `kernels` is the version it pins (5.24: 0.18.x; the CPU registry has
    0.17.2). Put on `classes` for the duration, when missing."""
    kernels = pytest.importorskip("kernels")
    added = [cls for cls in classes if "kernel_layer_name" not in cls.__dict__]
    for cls in added:
        kernels.replace_kernel_forward_from_hub(cls, "RMSNorm")
    try:
        yield
    finally:
        for cls in added:
            del cls.kernel_layer_name, cls.kernel_condition


def _judged_by_the_oracle(model):
    """Hooks that judge every xkern norm's output against its variant's FP64 oracle; returns the calls."""
    calls = []

    def hook(m, args, out):
        math = hf.norm_math(type(m))
        x = to_numpy(args[0])
        w = None if math.variant == "none" else to_numpy(m.weight)
        variant = "llama" if math.variant == "none" else math.variant
        eps = getattr(m, math.eps_attr)
        R.check(to_numpy(out), R.rms_norm_fwd(x, w, eps, variant), "fwd", R.rms_norm_fwd_tol(x, w, eps, variant))
        calls.append(type(m).__name__)

    handles = [m.register_forward_hook(hook) for m in _norms(model)]
    return calls, handles


# --- which classes ----------------------------------------------------------------------------------


def test_every_norm_class_in_transformers(record_property):
    """Probe every norm class of the installed transformers; put the counts in the log (conftest's summary);
    run each accepted class through xkern against its own eager forward (bf16, bit for bit)."""
    classes = hf.hf_norm_classes()
    maths = {cls: hf.norm_math(cls) for cls in classes}
    variants = collections.Counter(m.variant if m else "left alone" for m in maths.values())
    eps_attrs = collections.Counter(m.eps_attr for m in maths.values() if m)
    record_property("summary", f"transformers {transformers.__version__}: {len(classes)} norm classes; by math: "
                               f"{dict(variants)}; eps attribute: {dict(eps_attrs)}")
    gated = {c: hf.gated_norm_math(c) for c, m in maths.items() if m is None}  # forward(hidden_states, gate)
    taken = sum(m is not None for m in maths.values()) + sum(m is not None for m in gated.values())
    record_property("summary", f"gated norms: {taken - sum(m is not None for m in maths.values())} more; "
                               f"{taken} of {len(classes)} classes through xkern")
    record_property("summary", "left alone: " + ", ".join(sorted(c.__name__ for c, m in gated.items() if m is None)))
    assert len(classes) >= 150 and variants["llama"] >= 100 and variants["gemma"] and variants["olmo2"]
    assert variants["none"] and eps_attrs["eps"] and eps_attrs["variance_epsilon"]

    by_name = {c.__name__: m for c, m in maths.items()}
    assert by_name["LlamaRMSNorm"] == hf.NormMath("llama", "variance_epsilon")
    assert by_name["GemmaRMSNorm"] == hf.NormMath("gemma", "eps")
    assert by_name["Olmo2RMSNorm"].variant == "olmo2"
    # Classes come and go between releases (5.25 dropped Llama4TextL2Norm, renamed Llama4TextRMSNorm's eps):
    # these are checked where the installed release has them.
    expected = {"Llama4TextRMSNorm": "llama", "Llama4TextL2Norm": "none", "GraniteRMSNorm": "llama",
                "Glm4RMSNorm": "llama", "SmolLM3RMSNorm": "llama", "MinistralRMSNorm": "llama",
                "Exaone4RMSNorm": "llama"}
    for name, variant in expected.items():
        if name in by_name:
            assert by_name[name].variant == variant, name
    assert sum(name in by_name for name in expected) >= 4
    for name in ("MambaRMSNormGated", "DeepseekV4UnweightedRMSNorm"):  # a gate input; rstd rounded to x.dtype
        if name in by_name:
            assert by_name[name] is None, name
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    # Variants the probe takes where they hide: an eps argument without a default, a width that defaults to None,
    # an unused dummy weight buffer, F.rms_norm; and in some dtypes only (where the class rounds elsewhere in
    # the others: Idefics to the weight's dtype, MuseSpark's centered norm `1 + w` in the weight's dtype).
    variants = {"ErgoRMSNorm": hf.NormMath("olmo2", "eps", eps_none=True),
                "MuseSparkRMSNorm": hf.NormMath("olmo2", "variance_epsilon"),
                "FalconMambaWeightlessRMSNorm": hf.NormMath("none", "variance_epsilon"),
                "IdeficsRMSNorm": hf.NormMath("llama", "variance_epsilon", dtypes=frozenset(
                    {(bf16, bf16), (fp16, fp16), (fp32, fp32)})),
                "MuseSparkTextCenteredRMSNorm": hf.NormMath("gemma", "eps", dtypes=frozenset(
                    {(bf16, fp32), (fp32, fp32)}))}
    for name, math in variants.items():  # (eps attribute names move between releases)
        if name in by_name:
            assert (by_name[name].variant, by_name[name].dtypes) == (math.variant, math.dtypes), name

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 64, generator=gen).to(DEVICE, torch.bfloat16)
    checked = 0
    for cls, math in maths.items():
        if math is None:
            continue
        module = probe._construct(cls).to(DEVICE)
        if math.variant != "none":  # bf16, or the weight dtype the class is taken with for a bf16 input
            w_dtype = bf16 if math.takes(bf16, bf16) else fp32
            module.weight = torch.nn.Parameter((1.0 + 0.5 * torch.randn(64, generator=gen)).to(DEVICE, w_dtype))
        setattr(module, math.eps_attr, 1e-5)
        out = hf.xkern_norm_forward(module, x, math)
        assert _same(out, hf.original_forward(cls)(module, x)), cls.__name__
        checked += 1
    record_property("summary", f"{checked} classes run through xkern: bitwise equal to their eager forward (bf16)")


def test_probe_rejects_other_math():
    """Near misses of the Llama expression are left alone: the probe can fail."""
    class HardCodedEps(LlamaRMSNorm):
        def forward(self, hidden_states):
            xf = hidden_states.float()
            return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(hidden_states.dtype)

    class SqrtNotRsqrt(LlamaRMSNorm):
        def forward(self, hidden_states):
            xf = hidden_states.float()
            normed = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * normed.to(hidden_states.dtype)

    class GatedRMSNorm(LlamaRMSNorm):
        def forward(self, hidden_states, gate=None):
            return super().forward(hidden_states)

    class SameMathRMSNorm(LlamaRMSNorm):  # a subclass with the same math is patched
        pass

    class EpsNamedRMSNorm(torch.nn.Module):  # the same math with the eps stored as `eps`
        def __init__(self, hidden_size=64, eps=1e-6):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.ones(hidden_size)), eps

        def forward(self, hidden_states):
            xf = hidden_states.float()
            return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(hidden_states.dtype)

    class ReadsItsBufferRMSNorm(torch.nn.Module):  # a buffer weight: the probe fills it with random values
        def __init__(self, hidden_size=64, eps=1e-6):
            super().__init__()
            self.weight, self.eps = torch.nn.Buffer(torch.ones(hidden_size)), eps

        def forward(self, hidden_states):
            xf = hidden_states.float()
            return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(hidden_states.dtype)

    class Fp32OnlyRMSNorm(LlamaRMSNorm):  # Llama's bits in fp32 only, where the roundings tell nothing apart
        def forward(self, hidden_states):
            xf = hidden_states.float()
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * (hidden_states * rstd.to(hidden_states.dtype))

    for cls in (HardCodedEps, SqrtNotRsqrt, GatedRMSNorm, ReadsItsBufferRMSNorm, Fp32OnlyRMSNorm):
        assert hf.norm_math(cls) is None, cls.__name__
    assert hf.norm_math(SameMathRMSNorm) == hf.NormMath("llama", "variance_epsilon")
    assert hf.norm_math(EpsNamedRMSNorm) == hf.NormMath("llama", "eps")
    assert hf.norm_math(torch.nn.LayerNorm) is None  # (torch.nn.RMSNorm is taken: its own test below)


def test_dtype_restricted_math_falls_back_elsewhere():
    """A class taken in some dtype pairs only (`NormMath.dtypes`) runs through xkern there and its own forward
    in the others: bit for bit its own forward either way."""
    class WeightDtypeRMSNorm(LlamaRMSNorm):  # Idefics' rounding: normed to the weight's dtype where it is half
        def forward(self, hidden_states):
            xf = hidden_states.float()
            normed = hidden_states * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            if self.weight.dtype in (torch.float16, torch.bfloat16):
                normed = normed.to(self.weight.dtype)
            return self.weight * normed

    math = hf.norm_math(WeightDtypeRMSNorm)
    assert math.variant == "llama" and not math.takes(torch.bfloat16, torch.float32)
    assert math.takes(torch.bfloat16, torch.bfloat16) and math.takes(torch.float16, torch.float16)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 64, generator=gen).to(DEVICE, torch.bfloat16)
    calls = []
    for w_dtype in (torch.bfloat16, torch.float32):
        norm = WeightDtypeRMSNorm(64).to(DEVICE, w_dtype)
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.5, generator=None)
        ref = WeightDtypeRMSNorm.forward(norm, x)
        torch_api.replace_rms_norm(norm)
        with _counting_rms_norm(calls):
            assert _same(norm(x), ref), w_dtype
    assert len(calls) == 1  # bf16 weight: xkern; fp32 weight: the class's own forward (an fp32 output)


# --- instance patching on tiny models ---------------------------------------------------------------


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_patched_model_matches_eager(model_type, monkeypatch):
    ref, model = _model(model_type), _model(model_type)
    n_norms = len(_norms(model))
    assert n_norms >= 3 and {hf.norm_math(type(m)).variant for m in _norms(model)} == FAMILIES[model_type][1]
    assert torch_api.replace_rms_norm(model) == n_norms
    assert torch_api.replace_rms_norm(model) == 0  # second call replaces nothing
    calls, handles = _judged_by_the_oracle(model)
    xkern_calls, real = [], norm_forward.rms_norm
    monkeypatch.setattr(norm_forward, "rms_norm", lambda *a, **k: xkern_calls.append(1) or real(*a, **k))
    try:
        logits_ref, grads_ref = _logits_and_grads(ref)
        logits, grads = _logits_and_grads(model)
    finally:
        for h in handles:
            h.remove()
    # every call of a norm (Llama4's L2 norm serves q and k): xkern, judged by the oracle
    assert len(calls) >= n_norms and len(xkern_calls) == len(calls)
    assert _same(logits, logits_ref)
    llama_only = FAMILIES[model_type][1] == {"llama"}
    for name, g in grads.items():
        assert _same(g, grads_ref[name]) if llama_only else _rel_l2(g, grads_ref[name]) <= 2e-2, name
    assert model.state_dict().keys() == ref.state_dict().keys()
    assert "xkern=" in repr(model) and "xkern=" not in repr(ref)


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_generate_and_gradient_checkpointing(model_type):
    ref, model = _model(model_type), _model(model_type)
    torch_api.replace_rms_norm(model)
    out = model.generate(IDS, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, ref.generate(IDS, max_new_tokens=4, do_sample=False))
    model.train()
    _, grads = _logits_and_grads(model)
    model.gradient_checkpointing_enable()
    _, grads_ckpt = _logits_and_grads(model)
    assert all(_same(g, grads[n]) for n, g in grads_ckpt.items())


def test_save_load_and_copies(tmp_path):
    model = _model("llama", torch.float32)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert torch_api.replace_rms_norm(model) == 3
    assert model.state_dict().keys() == sd.keys()
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())

    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    norms = [m for m in loaded.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 3 and not any(isinstance(m.forward, replace._Forward) for m in norms)  # eager
    assert "xkern" not in repr(loaded)
    assert torch_api.replace_rms_norm(loaded) == 3 and "xkern=llama" in repr(loaded)  # and patchable again

    model.save_pretrained(tmp_path)
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path).to(device=model.device, dtype=model.dtype)
    assert torch_api.replace_rms_norm(fresh) == 3
    assert torch.equal(fresh(input_ids=IDS).logits, model(input_ids=IDS).logits)

    # A deep copy stays patched, bound to itself: its own weight and eps.
    norm = model.model.norm
    twin = copy.deepcopy(norm)
    assert isinstance(twin.forward, replace._Forward) and twin.forward.module is twin
    twin.variance_epsilon = 0.5
    x = torch.randn(2, 64, device=DEVICE)
    torch.testing.assert_close(twin(x), LlamaRMSNorm.forward(twin, x))
    torch.testing.assert_close(norm(x), LlamaRMSNorm.forward(norm, x))
    assert not torch.allclose(twin(x), norm(x))


def test_leaves_other_modules_alone():
    wrapped = LlamaRMSNorm(8)
    wrapped.forward = lambda x: LlamaRMSNorm.forward(wrapped, x)  # already wrapped by someone else
    mods = [wrapped, torch.nn.LayerNorm(8)]  # (torch.nn.RMSNorm is taken: test_torch_nn_rms_norm_patched...)
    model = torch.nn.Sequential(*mods, LlamaRMSNorm(8))
    assert torch_api.replace_rms_norm(model) == 1
    assert isinstance(model[-1].forward, replace._Forward)
    assert all("forward" not in m.__dict__ for m in mods if m is not wrapped)


# --- torch.compile ----------------------------------------------------------------------------------


def _compiles(model) -> bool:
    torch._dynamo.reset()
    try:
        torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=IDS)
        return True
    except Exception:
        return False


@pytest.mark.parametrize("model_type", ["llama", "olmo2"])
def test_torch_compile_fullgraph(model_type):
    """fullgraph=True (aot_eager on CPU: the graph, autograd and the fake ops are traced; inductor's CPU
    code generation is not what is tested)."""
    ref = _model(model_type)
    if not _compiles(ref):
        pytest.skip(f"unpatched {model_type} does not compile with fullgraph=True here")
    for patch in ("instance", "kernels"):
        model = _model(model_type)
        if patch == "instance":
            torch_api.replace_rms_norm(model)
        else:
            kernels = pytest.importorskip("kernels")
            with _hub_names(*{type(m) for m in _norms(model)}), \
                    kernels.use_kernel_mapping(hf.kernel_mapping(), inherit_mapping=False):
                kernels.kernelize(model, mode=kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE, device=DEVICE)
            assert all(m.forward.__func__ is hf.XkernRMSNorm.forward for m in _norms(model))
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        logits = compiled(input_ids=IDS).logits
        assert _same(logits, ref(input_ids=IDS).logits), patch
        logits.float().square().mean().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad), patch


# --- class patching ---------------------------------------------------------------------------------


def test_class_patching_before_construction(tmp_path):
    _model("llama").save_pretrained(tmp_path)
    try:
        patched = torch_api.patch_hf_classes("llama", "gemma", "olmo2")
        assert {c.__name__ for c in patched} == {"LlamaRMSNorm", "GemmaRMSNorm", "Olmo2RMSNorm"}
        assert torch_api.patch_hf_classes("llama") == []  # idempotent
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
        built = _model("gemma")
        for model in (loaded, built):
            assert all(type(m).forward is classes.class_forward for m in _norms(model))
            assert "xkern=" in repr(model)
            assert torch_api.replace_rms_norm(model) == 0  # the class is patched: nothing to do per instance
        calls, handles = _judged_by_the_oracle(built)
        logits = built(input_ids=IDS).logits
        assert len(calls) == len(_norms(built))
        for h in handles:
            h.remove()
    finally:
        restored = torch_api.unpatch_hf_classes()
    assert {c.__name__ for c in restored} == {"LlamaRMSNorm", "GemmaRMSNorm", "Olmo2RMSNorm"}
    assert "forward" in LlamaRMSNorm.__dict__ and LlamaRMSNorm.forward is not classes.class_forward
    eager = _model("gemma")
    assert "xkern" not in repr(eager) and _same(eager(input_ids=IDS).logits, logits)
    assert torch_api.unpatch_hf_classes() == []


def test_class_patching_keeps_unprobed_subclasses_eager(monkeypatch):
    class SubRMSNorm(LlamaRMSNorm):  # inherits the patched forward, but its own math was never probed
        pass

    try:
        torch_api.patch_hf_classes("llama")
        assert SubRMSNorm not in probe.PROBED
        calls, real = [], norm_forward.rms_norm
        monkeypatch.setattr(norm_forward, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
        x = torch.randn(2, 8, device=DEVICE)
        sub = SubRMSNorm(8).to(DEVICE)
        assert _same(sub(x), hf.original_forward(LlamaRMSNorm)(sub, x)) and not calls  # eager
    finally:
        torch_api.unpatch_hf_classes()


# --- the `kernels` package --------------------------------------------------------------------------


def test_kernels_layer_kernelize(tmp_path):
    kernels = pytest.importorskip("kernels")
    _model("olmo2").save_pretrained(tmp_path / "olmo2")
    _model("llama").save_pretrained(tmp_path / "llama")

    class OtherMathRMSNorm(LlamaRMSNorm):  # decorated "RMSNorm" like transformers' classes, other math
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    kernels.replace_kernel_forward_from_hub(OtherMathRMSNorm, "RMSNorm")
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    with _hub_names(LlamaRMSNorm, Olmo2RMSNorm), \
            kernels.use_kernel_mapping(hf.kernel_mapping(), inherit_mapping=False):
        for model_type in ("olmo2", "llama"):
            ref = AutoModelForCausalLM.from_pretrained(tmp_path / model_type, dtype=torch.bfloat16)
            model = AutoModelForCausalLM.from_pretrained(tmp_path / model_type, dtype=torch.bfloat16)
            kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device=DEVICE)
            assert all(m.forward.__func__ is hf.XkernRMSNorm.forward for m in _norms(model))
            calls, _ = _judged_by_the_oracle(model)
            assert _same(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)
            assert len(calls) == len(_norms(model))
        other = torch.nn.Sequential(OtherMathRMSNorm(8)).to(DEVICE)
        kernels.kernelize(other, mode=kernels.Mode.INFERENCE, device=DEVICE)
        x = torch.randn(2, 8, device=DEVICE)
        assert other[0].forward.__func__ is hf.XkernRMSNorm.forward  # picked by name, but its math is refused:
        assert _same(other[0](x), LlamaRMSNorm.forward(other[0], x) * 2)  # its own forward runs



def _from_pretrained_with_kernels(path, **kwargs):
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, use_kernels=True, **kwargs)
    except ValueError as e:  # transformers 5.24 takes kernels 0.18.x only; the CPU registry has up to 0.17.2
        if "Kernels are not available" in str(e):
            pytest.skip(f"use_kernels=True refused by transformers: {e}")
        raise


@pytest.mark.skipif(GPU, reason="the CPU path; on CUDA see test_use_kernels_with_kernel_config_on_gpu")
def test_use_kernels_true_with_a_registered_mapping(tmp_path):
    """use_kernels=True: transformers registers its own mapping (Liger's, for CUDA) and kernelizes; a mapping
    registered for the device (here the CPU) is picked. On CUDA pass kernel_config() instead."""
    kernels = pytest.importorskip("kernels")
    _model("llama").save_pretrained(tmp_path)
    with _hub_names(LlamaRMSNorm), kernels.use_kernel_mapping(hf.kernel_mapping(devices=("cpu",))):
        model = _from_pretrained_with_kernels(tmp_path)
    assert all(m.forward.__func__ is hf.XkernRMSNorm.forward for m in _norms(model))


@pytest.mark.skipif(not GPU, reason="KernelConfig takes CUDA-like devices only")
def test_use_kernels_with_kernel_config_on_gpu(tmp_path):
    pytest.importorskip("kernels")
    _model("llama").save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).to(DEVICE)
    model = _from_pretrained_with_kernels(tmp_path, device_map=DEVICE, kernel_config=hf.kernel_config())
    assert all(m.forward.__func__ is hf.XkernRMSNorm.forward for m in _norms(model))
    assert _same(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)


# --- the residual add fused into post_attention_layernorm (opt-in) ------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_fused_residual_norm_layers_match_eager(model_type, monkeypatch):
    ref, model = _model(model_type), _model(model_type)
    torch_api.replace_rms_norm(model)
    assert torch_api.fuse_residual_norms(model) == TINY["num_hidden_layers"]
    assert torch_api.fuse_residual_norms(model) == 0
    module = sys.modules["torch_api.add_rms_norm"]
    fused_calls, real = [], module.add_rms_norm
    monkeypatch.setattr(module, "add_rms_norm", lambda *a, **k: fused_calls.append(1) or real(*a, **k))
    logits_ref, grads_ref = _logits_and_grads(ref)
    logits, grads = _logits_and_grads(model)
    assert len(fused_calls) == TINY["num_hidden_layers"] and _same(logits, logits_ref)
    assert grads.keys() == grads_ref.keys() and all(_same(g, grads_ref[n]) for n, g in grads.items())


def test_fused_residual_norms_by_class_patching():
    ref = _model("llama")
    try:
        patched = torch_api.patch_hf_classes("llama", fuse_residual=True)
        assert {c.__name__ for c in patched} == {"LlamaDecoderLayer", "LlamaRMSNorm"}
        model = _model("llama")
        assert torch_api.fuse_residual_norms(model) == 0  # already fused through its class
        assert _same(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)
    finally:
        torch_api.unpatch_hf_classes()
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    assert "forward" in LlamaDecoderLayer.__dict__ and hf.fused_layer_forward(LlamaDecoderLayer) is not \
        LlamaDecoderLayer.forward


def test_fused_residual_norms_leave_other_layers_alone():
    class Layer(torch.nn.Module):  # the add after the norm: not the Llama pattern
        def __init__(self):
            super().__init__()
            self.post_attention_layernorm = LlamaRMSNorm(8)

        def forward(self, hidden_states):
            return self.post_attention_layernorm(hidden_states) + hidden_states

    assert hf.fused_layer_forward(Layer) is None
    assert torch_api.fuse_residual_norms(torch.nn.Sequential(Layer(), torch.nn.Linear(8, 8))) == 0
    assert torch_api.fuse_residual_norms(_model("gemma3_text")) == 0  # its layer has four norms


def test_compile_fusion_on_a_patched_model():
    """`fuse_add_rms_norm` (what `enable_compile_fusion` installs) on Dynamo's graph of a patched Llama: the
    norm of each residual sum (post-attention, and the final norm) becomes the fused op, forward and backward;
    logits and gradients bitwise eager's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from torch_api.compile_fusion import fuse_add_rms_norm

    ref, model = _model("llama"), _model("llama")
    torch_api.replace_rms_norm(model)
    rewrites, graphs = [], []

    def keep(gm, _):
        graphs.append(graph_ops(gm.graph))
        return make_boxed_func(gm)

    def backend(gm, example_inputs):
        rewrites.append(fuse_add_rms_norm(gm.graph))
        gm.recompile()
        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, example_inputs)

    torch._dynamo.reset()
    logits, grads = _logits_and_grads(torch.compile(model, backend=backend, fullgraph=True))
    logits_ref, grads_ref = _logits_and_grads(ref)
    assert rewrites == [2]
    assert graphs[0].count("xkern.add_rms_norm_fwd.default") == 2 and graphs[0].count("xkern.rms_norm_fwd.default") == 1
    # The final norm's sum has no other use: its backward has no residual gradient to add, and on a GPU (where
    # the graph names kernels, not ops) it launches the plain backward kernel. Three norm backwards either way.
    bwd = graphs[1].count("xkern.add_rms_norm_bwd.default")
    assert bwd >= 1 and bwd + graphs[1].count("xkern.rms_norm_bwd.default") == 3
    assert _same(logits, logits_ref)
    assert all(_same(g, grads_ref[n.removeprefix("_orig_mod.")]) for n, g in grads.items())


# --- compile with the fused residual, dynamic sequence lengths, autocast, torch.nn.RMSNorm ------------


@pytest.mark.parametrize("fullgraph", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_fused_residual_model_compiles(fullgraph):
    """`replace_rms_norm(fuse_residual=True)` under torch.compile (aot_eager): eager's logits and gradients."""
    ref, model = _model("llama"), _model("llama")
    torch_api.replace_rms_norm(model, fuse_residual=True)
    torch._dynamo.reset()
    logits, grads = _logits_and_grads(torch.compile(model, backend="aot_eager", fullgraph=fullgraph))
    logits_ref, grads_ref = _logits_and_grads(ref)
    assert _same(logits, logits_ref)
    assert all(_same(g, grads_ref[n.removeprefix("_orig_mod.")]) for n, g in grads.items())


@pytest.mark.slow  # ~45 s in the interpreter
def test_patched_model_dynamic_sequence_lengths():
    """A patched Llama (norms and fused residual) compiled with dynamic=True over 20 sequence lengths: at most
    two graphs (torch specializes a length of 1 and may start static), eager's logits at every length."""
    ref, model = _model("llama"), _model("llama")
    torch_api.replace_rms_norm(model, fuse_residual=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n in range(2, 22):
            ids = torch.randint(3, TINY["vocab_size"], (1, n), generator=gen).to(DEVICE)
            assert _same(compiled(input_ids=ids).logits, ref(input_ids=ids).logits), n
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_autocast_takes_the_fused_path(monkeypatch):
    """fp32 weights under bf16 autocast: the residual stream is fp32, the attention output bf16; the fused op
    takes the fp32 operand as x (the norm of the fp32 sum): the layer's logits bit for bit; fp32 gradients
    through the kernels' backward (not autograd's op by op), to within fp32 rounding."""
    ref, model = _model("llama", torch.float32), _model("llama", torch.float32)
    torch_api.replace_rms_norm(model, fuse_residual=True)
    module = sys.modules["torch_api.add_rms_norm"]
    fused_calls, real = [], module.add_rms_norm
    monkeypatch.setattr(module, "add_rms_norm", lambda *a, **k: fused_calls.append(1) or real(*a, **k))
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        logits_ref, grads_ref = _logits_and_grads(ref)
        logits, grads = _logits_and_grads(model)
    assert len(fused_calls) == TINY["num_hidden_layers"] and _same(logits, logits_ref)
    assert grads.keys() == grads_ref.keys() and all(_rel_l2(g, grads_ref[n]) < 1e-5 for n, g in grads.items())


def test_unfused_residual_add_warns_once():
    from torch_api.hf import fuse

    norm = LlamaRMSNorm(8).to(DEVICE)
    h, r = torch.randn(2, 8, device=DEVICE, dtype=torch.float16), torch.randn(2, 8, device=DEVICE,
                                                                             dtype=torch.bfloat16)
    fuse._WARNED.clear()
    with pytest.warns(UserWarning, match="runs unfused"):
        y, s = fuse._add_norm(norm, h, r)
    assert _same(s, r + h) and _same(y, norm(r + h))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fuse._add_norm(norm, h, r)


def test_torch_nn_rms_norm_patched_by_its_math():
    """torch.nn.RMSNorm computes olmo2's math (eps None: FP32's epsilon); an instance over two dims stays eager."""
    assert hf.norm_math(torch.nn.RMSNorm) == hf.NormMath("olmo2", "eps", eps_none=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.RMSNorm(16), torch.nn.RMSNorm(16, eps=1e-5, elementwise_affine=False),
                                torch.nn.RMSNorm([2, 8])).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        model[0].weight.normal_(1.0, 0.5)
    ref = copy.deepcopy(model)
    assert torch_api.replace_rms_norm(model) == 3
    x = torch.randn(5, 16, device=DEVICE, dtype=torch.bfloat16)
    calls = []
    with _counting_rms_norm(calls):
        outs = [model[0](x), model[1](x), model[2](x.view(5, 2, 8))]
    assert len(calls) == 2
    assert all(_same(a, b) for a, b in zip(outs, [ref[0](x), ref[1](x), ref[2](x.view(5, 2, 8))]))


@contextlib.contextmanager
def _counting_rms_norm(calls: list):
    real = norm_forward.rms_norm
    norm_forward.rms_norm = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        yield
    finally:
        norm_forward.rms_norm = real


@pytest.mark.skipif(GPU, reason="GPU: `python -m benchmarks.gated_model_step` itself runs there")
def test_gated_model_step_benchmark_tiny(tmp_path):
    """`benchmarks.gated_model_step` on the CPU (its tiny model, one linear-attention and one full-attention
    layer): both paths train a step, the gated norm and the others go through xkern, the logits are eager's
    bit for bit; the JSON and the markdown row are written."""
    import json

    from benchmarks import gated_model_step

    assert gated_model_step.main(["--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "cpu-gated-model-step.json").read_text())["rows"]
    assert [r["path"] for r in rows] == list(gated_model_step.PATHS)
    assert all(r["status"] == "ok" and r["step_ms"] > 0 for r in rows), rows
    assert rows[1]["gated_norms_patched"] == 1 and rows[1]["norms_patched"] > 1
    assert rows[1]["logits_vs_eager"]["bitwise"]
    assert "| xkern |" in (tmp_path / "cpu-gated-model-step.md").read_text()
