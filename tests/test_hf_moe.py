"""Hugging Face MoE experts through xkern (`torch_api.hf_moe`, CPU: Triton's interpreter): tiny random
models of several families (no downloads), logits and every parameter's gradient against the model's own
eager experts, and torch.compile(fullgraph=True) of the whole model.

The xkern combine sums each token's k weighted expert rows in FP32 and rounds once; eager multiplies and
`index_add_`s in the hidden dtype. In fp32 the two agree to a few ULPs; in bf16 to bf16's rounding."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, GPU

from torch_api import hf_moe

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {  # model type -> its MoE config (small: a few experts, top 2 or 3)
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=6, num_experts_per_tok=3),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=0,
                        n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1, head_dim=8, rope_interleave=False),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"]),
}
IDS = torch.tensor([[3, 17, 99, 5, 64, 7, 9, 11]], device=DEVICE)


def _model(model_type: str, dtype=torch.float32):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**TINY, **FAMILIES[model_type]}))
    with torch.no_grad():  # experts' weights start at 0 in some classes: random, so every expert matters
        for m in model.modules():
            if hf_moe._is_experts_module(m):
                for p in m.parameters():
                    p.normal_(0.0, 0.2)
    model.config._experts_implementation = "eager"
    return model.to(DEVICE, dtype)


def _logits_and_grads(model, call=None):
    model.zero_grad()
    logits = (model if call is None else call)(IDS).logits
    torch.nn.functional.cross_entropy(logits[0, :-1].float(), IDS[0, 1:]).backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_xkern_experts_match_eager(model_type):
    model = _model(model_type)
    want, want_grads = _logits_and_grads(model)
    assert hf_moe.use_xkern_experts(model) == 1
    got, got_grads = _logits_and_grads(model)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    assert any("experts" in n for n in got_grads) and any("gate" in n or "router" in n for n in got_grads)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    # bf16: within bf16's rounding of eager (which rounds each weighted row and each partial sum)
    model = _model(model_type, torch.bfloat16)
    want = model(IDS).logits.float()
    hf_moe.use_xkern_experts(model)
    got = model(IDS).logits.float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    hf_moe.use_xkern_experts(model, enable=False)
    assert model.config._experts_implementation == "grouped_mm"


def test_torch_compile_fullgraph():
    # On a GPU in bf16: torch._grouped_mm takes no fp32 there, and transformers' fp32 fallback (a loop over
    # the experts) cannot be traced without a graph break.
    model = _model("qwen3_moe", torch.bfloat16 if GPU else torch.float32)
    hf_moe.use_xkern_experts(model)
    want, want_grads = _logits_and_grads(model)
    got, got_grads = _logits_and_grads(model, torch.compile(model, fullgraph=True, backend="aot_eager"))
    tol = dict(rtol=2e-2, atol=2e-2) if GPU else dict(rtol=1e-5, atol=1e-6)  # bf16: decompositions round apart
    torch.testing.assert_close(got.float(), want.float(), **tol)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name].float(), want_grads[name].float(), **tol, msg=name)


def test_expert_parallel_sentinels_add_nothing():
    """Ids >= num_experts (transformers' EP sentinels) count for no expert and add 0: the same as routing
    those copies to expert 0 with weight 0."""
    model = _model("mixtral")
    experts = next(m for m in model.modules() if hf_moe._is_experts_module(m))
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, TINY["hidden_size"], generator=g).to(DEVICE)
    ids = torch.tensor([[0, 2], [3, 4], [4, 1], [2, 3], [4, 4]], device=DEVICE)  # 4 == num_experts: sentinel
    w = torch.rand(5, 2, generator=g).to(DEVICE)
    got = hf_moe.xkern_experts_forward(experts, h, ids, w)
    sentinel = ids == experts.num_experts
    want = hf_moe.xkern_experts_forward(experts, h, ids.masked_fill(sentinel, 0), w.masked_fill(sentinel, 0.0))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_through_the_norm_patch_entry_points():
    """replace_rms_norm(model, experts=True) routes the experts too; patch_hf_classes(experts=True) registers
    "xkern", which from_config then takes by name."""
    from torch_api import hf

    model = _model("mixtral")
    want = model(IDS).logits
    assert hf.replace_rms_norm(model, experts=True) > 0
    assert model.config._experts_implementation == "xkern"
    torch.testing.assert_close(model(IDS).logits, want, rtol=1e-5, atol=1e-5)
    try:
        hf.patch_hf_classes("mixtral", experts=True)
        config = AutoConfig.for_model("mixtral", **{**TINY, **FAMILIES["mixtral"]})
        torch.manual_seed(0)
        built = AutoModelForCausalLM.from_config(config, experts_implementation="xkern")
        assert built.config._experts_implementation == "xkern"
    finally:
        hf.unpatch_hf_classes()
