"""`torch_api.replace_rms_norm` on tiny randomly initialised Hugging Face models (CPU: Triton's interpreter).

Each patched norm's output is judged by the FP64 oracle's ULP contract; logits and gradients of the whole
model are compared with the unpatched model.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from helpers import DEVICE, to_numpy

import torch_api
from torch_api import hf
from xkern import reference as R

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128)


def _llama(dtype=torch.float32):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).to(DEVICE, dtype)


def _qwen3(dtype=torch.float32):
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=16)).to(DEVICE, dtype)


def _rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _logits_and_grads(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _norm_outputs_under_contract(model):
    """Hooks that judge every patched norm's output against the oracle."""
    def hook(m, args, out):
        x = to_numpy(args[0])
        R.check(to_numpy(out), R.rms_norm_fwd(x, to_numpy(m.weight), m.variance_epsilon), "fwd")
    return [m.register_forward_hook(hook) for m in model.modules() if isinstance(m.forward, hf._Forward)]


@pytest.mark.parametrize("make, n_norms, dtype, tol", [
    (_llama, 3, torch.float32, 1e-5),    # input, post-attention, final
    (_qwen3, 5, torch.bfloat16, 2e-2),   # + q_norm, k_norm (head_dim 16)
], ids=["llama-fp32", "qwen3-bf16"])
def test_patched_model_matches_eager(make, n_norms, dtype, tol):
    ref, model = make(dtype), make(dtype)
    calls = []
    real = hf.rms_norm
    hf.rms_norm = lambda *a: calls.append(1) or real(*a)
    try:
        assert torch_api.replace_rms_norm(model) == n_norms
        assert torch_api.replace_rms_norm(model) == 0  # second call replaces nothing
        hooks = _norm_outputs_under_contract(model)
        ids = torch.tensor([[3, 17, 99, 5]], device=DEVICE)
        logits_ref, grads_ref = _logits_and_grads(ref, ids)
        logits, grads = _logits_and_grads(model, ids)
    finally:
        hf.rms_norm = real
    assert len(calls) == n_norms and len(hooks) == n_norms  # every norm went through xkern
    assert _rel_l2(logits, logits_ref) <= tol
    for name, g in grads.items():
        assert _rel_l2(g, grads_ref[name]) <= (1e-4 if dtype == torch.float32 else 5e-2), name
    assert model.state_dict().keys() == ref.state_dict().keys()


def test_leaves_other_modules_alone():
    class Sub(LlamaRMSNorm):
        pass

    wrapped = LlamaRMSNorm(8)
    wrapped.forward = lambda x: LlamaRMSNorm.forward(wrapped, x)  # already wrapped by someone else
    mods = [Sub(8), wrapped, torch.nn.LayerNorm(8)]
    try:  # Gemma's `1 + w` math is not in the list
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        mods.append(GemmaRMSNorm(8))
    except ImportError:
        pass
    model = torch.nn.Sequential(*mods, LlamaRMSNorm(8))
    assert torch_api.replace_rms_norm(model) == 1
    assert isinstance(model[-1].forward, hf._Forward)
    assert all("forward" not in m.__dict__ for m in mods if m is not wrapped)


def test_save_load_and_copies():
    model = _llama()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert torch_api.replace_rms_norm(model) == 3
    assert model.state_dict().keys() == sd.keys()
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())

    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    norms = [m for m in loaded.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 3 and not any(isinstance(m.forward, hf._Forward) for m in norms)  # eager
    assert torch_api.replace_rms_norm(loaded) == 3  # and patchable again

    fresh = _llama()
    fresh.load_state_dict(model.state_dict())
    assert torch_api.replace_rms_norm(fresh) == 3

    # A deep copy stays patched, bound to itself: its own weight and eps.
    norm = model.model.norm
    twin = copy.deepcopy(norm)
    assert isinstance(twin.forward, hf._Forward) and twin.forward.module is twin
    twin.variance_epsilon = 0.5
    x = torch.randn(2, 64, device=DEVICE)
    torch.testing.assert_close(twin(x), LlamaRMSNorm.forward(twin, x))
    torch.testing.assert_close(norm(x), LlamaRMSNorm.forward(norm, x))
    assert not torch.allclose(twin(x), norm(x))
