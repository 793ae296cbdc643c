"""What the tests of both front ends share: device choice, input makers, conversions, the poison value."""

from __future__ import annotations

import numpy as np
import torch

from xkern import reference as R

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def rand(rng: np.random.Generator, shape, dtype: str, scale: float = 1.0, offset: float = 0.0) -> np.ndarray:
    """Fresh random values (never zeros), rounded to `dtype` (a numpy/ml_dtypes array)."""
    return (offset + scale * rng.standard_normal(shape)).astype(R.np_dtype(dtype))


def to_torch(a: np.ndarray, device: str = DEVICE) -> torch.Tensor:
    """numpy (ml_dtypes bfloat16 included) -> torch, bit for bit."""
    name = str(a.dtype)
    if name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def to_numpy(t) -> np.ndarray:
    """torch tensor or jax array -> numpy with the same dtype (bfloat16 via ml_dtypes), bit for bit."""
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(R.BF16)
        return t.numpy()
    return np.asarray(t)


def same_bits(a, b) -> bool:
    a, b = to_numpy(a), to_numpy(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))
