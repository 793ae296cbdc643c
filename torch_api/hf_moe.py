"""Hugging Face MoE experts through xkern's dispatch and weighted combine (opt-in).

Transformers 5 builds its experts modules with `@use_experts_implementation` (Mixtral, Qwen2/3-MoE,
DeepSeek-V3, OLMoE, gpt-oss and more): `forward(hidden_states, top_k_index, top_k_weights)` dispatches on
`config._experts_implementation` through `transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`. This module
registers "xkern" there:

    permute_rows(x, idx, top_k=k)                      # expert-sorted rows straight from the token rows
    -> the grouped GEMMs (transformers' own `_grouped_linear`: torch._grouped_mm, or its fallback op)
    -> unpermute_rows(y, idx, T * k, top_k=k, probs=top_k_weights)   # FP32 weighted sum, rounded once

`idx` is the stable argsort of the expert ids: no padding, one slot per routed copy; expert-parallel
sentinel ids (>= num_experts) sort to the tail, count for no expert and are dropped (they add 0). No
data-dependent shapes and no host sync, so `torch.compile(fullgraph=True)` traces the layer.

    use_xkern_experts(model)            # every experts module of the model (its configs) -> "xkern"
    AutoModelForCausalLM.from_pretrained(name, experts_implementation="xkern")  # after register_xkern_experts()
"""

from __future__ import annotations

import torch

from torch_api.permute import permute_rows, unpermute_rows

NAME = "xkern"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def xkern_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' `grouped_mm_experts_forward` with xkern's dispatch and combine: the same module
    attributes (has_gate, has_bias, is_transposed, has_post_expert_norm, `_apply_gate`, `act_fn`)."""
    from transformers.integrations.moe import _grouped_linear

    num_tokens, top_k = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)
    sorted_ids, order = torch.sort(expert_ids, stable=True)
    real = sorted_ids < self.num_experts  # expert-parallel sentinels (>= num_experts) sort to the tail
    idx = torch.where(real, order, -1).to(torch.int32)
    clamped = sorted_ids.clamp(max=self.num_experts - 1)
    counts = torch.zeros(self.num_experts, dtype=torch.int32, device=expert_ids.device).index_add_(
        0, clamped, real.to(torch.int32))
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)

    x = permute_rows(hidden_states, idx, top_k=top_k)  # (S, H); sentinel slots are zero rows
    if self.has_gate:
        weights, biases = self.gate_up_proj, self.gate_up_proj_bias[clamped] if self.has_bias else None
    else:
        weights, biases = self.up_proj, self.up_proj_bias[clamped] if self.has_bias else None
    out = _grouped_linear(x, weights, offsets, bias=biases, is_transposed=self.is_transposed)
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)
    biases = self.down_proj_bias[clamped] if self.has_bias else None
    out = _grouped_linear(out, self.down_proj, offsets, bias=biases, is_transposed=self.is_transposed)
    if getattr(self, "has_post_expert_norm", False):  # transformers 5.x releases before it lack the flag
        out = self.post_expert_norm(out)
    # Rows past offsets[-1] (sentinels) are whatever the GEMM left there: idx never names them.
    probs = top_k_weights if top_k_weights.dtype in _FLOATS else top_k_weights.float()
    combined = unpermute_rows(out, idx, num_tokens * top_k, top_k=top_k, probs=probs)
    return combined.to(hidden_states.dtype)


def register_xkern_experts() -> None:
    """Make "xkern" an experts implementation of transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if ALL_EXPERTS_FUNCTIONS.get(NAME) is not xkern_experts_forward:
        ALL_EXPERTS_FUNCTIONS.register(NAME, xkern_experts_forward)


def _is_experts_module(module: torch.nn.Module) -> bool:
    # what `use_experts_implementation` adds to a class's instances
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "config")) and \
        hasattr(module, "down_proj")


def use_xkern_experts(model: torch.nn.Module, enable: bool = True, previous: str = "grouped_mm") -> int:
    """Route every experts module of `model` through xkern (`enable=False`: back to `previous`), by setting
    `_experts_implementation` on the configs they read. Returns how many experts modules that covers."""
    register_xkern_experts()
    modules = [m for m in model.modules() if _is_experts_module(m)]
    for m in modules:
        m.config._experts_implementation = NAME if enable else previous
    return len(modules)
