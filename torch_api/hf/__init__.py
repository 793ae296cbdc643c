"""Hugging Face RMSNorms through xkern, chosen by their math, not by their names.

Which classes: every `nn.Module` class named like an RMS or L2 norm (`*RMSNorm`, `*RmsNorm`, `*L2Norm`)
whose forward, probed once per class on a small random input, gives bit for bit one of the expressions
xkern computes (`norm_math`):

    llama:  w * normed.to(x.dtype)            (output dtype: promote(x, w))
    gemma:  (normed * (1 + w.float())).to(x.dtype)
    olmo2:  (w * normed).to(x.dtype)
    none:   normed.to(x.dtype)                (no weight: Llama4's L2 norm)
    normed = x.float() * rsqrt(mean(x.float()**2, -1) + eps), eps read from `variance_epsilon` or `eps`

in bf16, fp16, fp32, and bf16 with an fp32 weight (or in some of those pairs only, one with a 16-bit input:
then for those pairs only; Idefics rounds to the weight's dtype). A class whose forward takes more than the
hidden states, holds other parameters, reads its buffers (they are filled with random values first), or
differs in a single bit is left alone, so new models are covered when their math is one of these and skipped
when it is not, without a list to maintain.

The gated norms of the hybrid models (`forward(hidden_states, gate)`: Qwen3-Next, Kimi Linear, Mamba2,
Nemotron-H, Falcon-H1, ...) are probed the same way against the forms of `torch_api.gated_rms_norm`
(`gated_norm_math`, `torch_api.hf.gated`) and patched by the first two ways in.

Three ways in:
- `replace_rms_norm(model)`: instance patching, an instance-level `forward` on each module (nothing is
  added to the state dict; pickling stores the module unpatched; `copy.deepcopy` keeps the patch).
- `patch_hf_classes(*model_types)` before `from_pretrained`/`from_config`: the classes' `forward` and
  `extra_repr` replaced, so every model built afterwards gets xkern; `unpatch_hf_classes()` restores them.
- the `kernels` package: `kernels_layer_repository()`, `kernel_mapping()`, `kernel_config()` map the hub
  name "RMSNorm" to `XkernRMSNorm` (a stateless layer that computes the math of the class it replaces,
  and falls back to the class's own forward for math it does not compute).
A patched module shows `xkern=<variant>` in `print(model)` (instance and class patching). Opt-in,
`fuse_residual_norms(model)` fuses the residual add before `post_attention_layernorm` into that norm in
Llama-pattern decoder layers.

The modules, each importing only those above it:
- `originals`: the forward a class had before class patching; whether a module's own forward is unset.
- `probe`: which classes, and their math (`norm_math`, `hf_norm_classes`).
- `norm_forward`: a norm module's output through xkern (`xkern_norm_forward`), shared by the three ways in.
- `hub`: the `kernels` layer and its mappings.
- `fuse`: decoder layers with the residual add fused into the norm, rebuilt from their source's AST.
- `classes`: class patching.
- `replace`: instance patching.
"""

from torch_api.hf.classes import patch_hf_classes, unpatch_hf_classes
from torch_api.hf.fuse import DECODER_LAYER_NAME, fuse_residual_norms, fused_layer_forward
from torch_api.hf.gated import GatedNormMath, gated_norm_math
from torch_api.hf.hub import LAYER_REPOSITORY, XkernRMSNorm, kernel_config, kernel_mapping, kernels_layer_repository
from torch_api.hf.norm_forward import xkern_norm_forward
from torch_api.hf.originals import original_forward
from torch_api.hf.probe import EPS_ATTRS, NORM_NAME, VARIANTS, NormMath, expected_output, hf_norm_classes, norm_math
from torch_api.hf.replace import replace_rms_norm

__all__ = [
    "DECODER_LAYER_NAME",
    "EPS_ATTRS",
    "GatedNormMath",
    "LAYER_REPOSITORY",
    "NORM_NAME",
    "VARIANTS",
    "NormMath",
    "XkernRMSNorm",
    "expected_output",
    "fuse_residual_norms",
    "fused_layer_forward",
    "gated_norm_math",
    "hf_norm_classes",
    "kernel_config",
    "kernel_mapping",
    "kernels_layer_repository",
    "norm_math",
    "original_forward",
    "patch_hf_classes",
    "replace_rms_norm",
    "unpatch_hf_classes",
    "xkern_norm_forward",
]
