"""What every op's launch plan returns, and the helpers the plans share.

A plan is computed once here from shapes and dtypes only, so the torch and JAX front ends launch the
same binary with the same grid and get bitwise-identical results. Kernel signatures put array inputs
first and outputs after them (jax-triton appends outputs to the inputs), scalars go by keyword.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

# Programs a persistent kernel launches at most. Fixed (the H100/H200 SM count times a small occupancy
# factor applied by each plan) rather than read from the device, so that reductions over per-program
# partials are summed in the same order on every machine and every front end.
NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](*inputs, *outputs, **scalars, **constexprs, num_warps=...)``."""

    kernel: Any
    grid: tuple[int, ...]
    num_warps: int
    constexprs: dict[str, Any]
    num_stages: int = 2


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Triton's interpreter (TRITON_INTERPRET=1, the CPU path) is not thread-safe, and JAX runs host callbacks
# on its own threads: every interpreted launch, from either front end, takes this lock.
INTERPRETER_LOCK = threading.Lock()


def patch_interpreter_bf16_rounding() -> None:
    """Make the interpreter round fp32 -> bf16 casts to nearest even, as the GPU does.

    Triton 3.6's interpreter truncates them (`cast_impl` ignores the rounding mode), which moves every
    bf16 result of the CPU path by up to an ULP away from what the same kernel gives on the GPU."""
    import ml_dtypes
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_xkern_rtne", False):
        return
    cast_impl = builder.cast_impl

    def rounding_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = src.data.astype(ml_dtypes.bfloat16).view(np.uint16)
            return interpreter.TensorHandle(data, dst_type.scalar)
        return cast_impl(self, src, dst_type)

    builder.cast_impl = rounding_cast
    builder._xkern_rtne = True
