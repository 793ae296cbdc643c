"""xkern: single-source Triton kernels and their launch plans, shared by `torch_api` and `jax_api`.

Nothing here imports torch or jax: kernels take raw pointers, plans take shapes and dtype names.
"""

__version__ = "0.1.0"
