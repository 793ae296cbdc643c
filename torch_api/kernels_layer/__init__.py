"""A local `kernels` layer repository (`kernels.LocalLayerRepository(repo_path=<this folder>, layer_name="RMSNorm")`):
`layers.RMSNorm` is `torch_api.hf.hub.XkernRMSNorm`. `metadata.json` is what `kernels` reads to load it."""

import types

from torch_api.hf.hub import XkernRMSNorm

layers = types.SimpleNamespace(RMSNorm=XkernRMSNorm)
