"""xkern: single-source Triton kernels and their launch plans, shared by `torch_api` and `jax_api`.

Nothing here imports torch or jax: kernels take raw pointers, plans take shapes and dtype names (and, where a
number depends on the GPU, its SM count and shared memory: `xkern.device`).
"""

__version__ = "0.1.0"
