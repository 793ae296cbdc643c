"""What every op's launch plan returns, and the helpers the plans share.

A plan is computed once here from shapes and dtypes only, so the torch and JAX front ends launch the
same binary with the same grid and get bitwise-identical results. Kernel signatures are ordered
`inputs, scalars, outputs, constexprs`: jax-triton binds its positional arguments (arrays and runtime
scalars) to the first parameters and appends the outputs (a scalar passed by keyword would become a
compile-time constant there, compiling other code than the torch launch).
"""

from __future__ import annotations

import dataclasses
import numbers
import threading
from typing import Any

# Programs a persistent kernel launches at most. Fixed (the H100/H200 SM count times a small occupancy
# factor applied by each plan) rather than read from the device, so that reductions over per-program
# partials are summed in the same order on every machine and every front end.
NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](**bind(launch, arrays, scalars), num_warps=..., num_stages=...)``;
    `constexprs` holds every constexpr parameter of the kernel."""

    kernel: Any
    grid: tuple[int, ...]
    num_warps: int
    constexprs: dict[str, Any]
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class Buffer:
    """An array a recipe step allocates: `fill` (a number) or uninitialised (None, a kernel writes it)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy-style name: "bfloat16", "float32", "int32", ...
    fill: float | None = None


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of an op: allocate `outputs`, then (unless `launch` is None) launch on the named `inputs`
    (the op's arguments or earlier steps' outputs) followed by the outputs, with the runtime `scalars`."""

    launch: Launch | None
    inputs: tuple[str, ...]
    outputs: tuple[Buffer, ...]
    scalars: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What a front end executes for one call of an op: the steps in order, and the buffers it returns.
    Computed (and cached) by the op's module from shapes, dtypes and scalars alone."""

    steps: tuple[Step, ...]
    results: tuple[str, ...]


FLOATS = ("float16", "bfloat16", "float32")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4, "int64": 8}


def promote(a: str, b: str) -> str:
    """Type promotion of two float dtypes, as torch.promote_types and jnp.promote_types (float16 with
    bfloat16 gives float32)."""
    return a if a == b else "float32"


def check_int(name: str, n, minimum: int = 0) -> int:
    """`n` as a Python int >= `minimum`, or a TypeError/ValueError naming `name`."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(n).__name__}")
    if n < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {n}")
    return int(n)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_align(n_cols: int, *row_strides: int) -> int:
    """Largest power of two (at most 16) dividing the width and every row stride, in elements.

    Kernels take it as the constexpr ROW_ALIGN and apply it as `n // ROW_ALIGN * ROW_ALIGN`, which lets
    the compiler prove 16-byte alignment of rows without specializing the integer arguments themselves
    (the torch and JAX launchers specialize integers differently; see xkern/rms_norm.py)."""
    align = 16
    while any(v % align for v in (n_cols, *row_strides)):
        align //= 2
    return align


# Triton's interpreter (TRITON_INTERPRET=1, the CPU path) is not thread-safe, and JAX runs host callbacks
# on its own threads: every interpreted launch, from either front end, takes this lock.
INTERPRETER_LOCK = threading.Lock()


def patch_interpreter() -> None:
    """Two fixes to Triton 3.6's interpreter (CPU runs of the kernels):

    - fp32 -> bf16 casts round to nearest even, as the GPU does (`cast_impl` ignores the rounding mode and
      truncates, which moves bf16 results by up to an ULP away from the GPU's).
    - a scalar used as a loop bound converts with numpy >= 2.4 too (`int()` of a 1-element array, which
      numpy 2.4 refuses; the GPU image has it)."""
    import ml_dtypes
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_xkern_patched", False):
        return
    cast_impl = builder.cast_impl

    def rounding_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = src.data.astype(ml_dtypes.bfloat16).view(np.uint16)
            return interpreter.TensorHandle(data, dst_type.scalar)
        return cast_impl(self, src, dst_type)

    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_with_index(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    builder.cast_impl = rounding_cast
    interpreter._patch_lang_tensor = patch_with_index
    builder._xkern_patched = True


def bind(launch: Launch, arrays, scalars: dict) -> dict:
    """Keyword arguments for `launch.kernel`: `arrays` (inputs, then outputs) bound in order to its pointer
    parameters, those of `scalars` it takes by name (the launches of one op share one dict), and the
    plan's constexprs."""
    scalars = {name: scalars[name] for name in launch.kernel.arg_names if name in scalars}
    fixed = scalars.keys() | launch.constexprs.keys()
    pointers = [name for name in launch.kernel.arg_names if name not in fixed]
    if len(pointers) != len(arrays):
        raise TypeError(f"{launch.kernel.__name__} takes arrays {pointers}, got {len(arrays)}")
    return {**dict(zip(pointers, arrays)), **scalars, **launch.constexprs}


def ordered_scalars(launch: Launch, scalars: dict) -> list:
    """The runtime scalars in the kernel's parameter order (they follow its inputs)."""
    return [scalars[name] for name in launch.kernel.arg_names if name in scalars]
