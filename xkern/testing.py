"""Input makers and bit-exact conversions shared by the tests and the benchmarks.

Imports no framework at module level (like the rest of `xkern`): torch is imported where a torch tensor
is made, and arrays of either framework are recognised by what they are, not by importing them.
"""

from __future__ import annotations

import numpy as np

from xkern import reference as R
from xkern.launch import INTERPRET, Launch, bind, run_interpreted


def launch(plan: Launch, *arrays, **scalars) -> None:
    """Launch one plan directly on framework arrays (inputs, then outputs) and runtime scalars: for tests of
    single kernels and for the tuning sweep. Under Triton's interpreter it runs as the front ends run it."""
    kwargs = bind(plan, arrays, scalars)
    if INTERPRET:
        run_interpreted(lambda: plan.kernel[plan.grid](**kwargs))
    else:
        plan.kernel[plan.grid](**kwargs, num_warps=plan.num_warps, num_stages=plan.num_stages)


def rand(rng: np.random.Generator, shape, dtype: str, scale: float = 1.0, offset: float = 0.0) -> np.ndarray:
    """Fresh random values (never zeros), rounded to `dtype` (a numpy/ml_dtypes array)."""
    return (offset + scale * rng.standard_normal(shape)).astype(R.np_dtype(dtype))


def torch_dtype(name: str):
    """'bfloat16' -> torch.bfloat16 (and the other float dtypes by name)."""
    import torch

    return getattr(torch, name)


def to_torch(a: np.ndarray, device: str):
    """numpy (ml_dtypes bfloat16 included) -> torch on `device`, bit for bit."""
    import torch

    if str(a.dtype) == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def _is_torch(t) -> bool:
    return type(t).__module__.startswith("torch")


def to_numpy(t) -> np.ndarray:
    """torch tensor or jax array -> numpy with the same dtype (bfloat16 via ml_dtypes), bit for bit."""
    if _is_torch(t):
        import torch

        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(R.BF16)
        return t.numpy()
    return np.asarray(t)


def same_bits(a, b) -> bool:
    """Same dtype, shape and bytes (torch tensors, jax arrays or numpy arrays, in any mix)."""
    a, b = to_numpy(a), to_numpy(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))
