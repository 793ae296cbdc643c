"""A local `kernels` layer repository (`kernels.LocalLayerRepository(repo_path=<this folder>, layer_name="RMSNorm")`):
`layers.RMSNorm` is `torch_api.hf.hub.XkernRMSNorm`, `layers.RMSNormGated` `torch_api.hf.gated.XkernRMSNormGated`.
`metadata.json` is what `kernels` reads to load it."""

import types

from torch_api.hf.gated import XkernRMSNormGated
from torch_api.hf.hub import XkernRMSNorm

layers = types.SimpleNamespace(RMSNorm=XkernRMSNorm, RMSNormGated=XkernRMSNormGated)
