"""What every op's launch plan returns, and the helpers the plans share.

A plan is computed once here from shapes and dtypes (and the GPU's SM count and shared memory, `xkern.device`),
so the torch and JAX front ends launch the same kernel (the same PTX) with the same grid and get
bitwise-identical results. Kernel signatures are ordered `inputs, scalars, outputs, constexprs`: jax-triton
binds its positional arguments (arrays and runtime scalars) to the first parameters and appends the outputs (a
scalar passed by keyword would become a compile-time constant there, compiling other code than the torch
launch).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import dataclasses
import numbers
import operator
import os
import sys
import threading
import warnings
from typing import Any


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
POINTER_TYPES = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}  # Triton's pointer type per float


def promote(a: str, b: str) -> str:
    """Type promotion of two float dtypes, as torch.promote_types and jnp.promote_types (float16 with
    bfloat16 gives float32)."""
    return a if a == b else "float32"


def check_int(name: str, n, minimum: int = 0) -> int:
    """`n` as a Python int >= `minimum`, or a TypeError/ValueError naming `name`.

    The front ends call it (and `check_float`) on every scalar argument at their door, before any cache
    lookup: np.int64(5) == 5 and hashes alike, so a plan cached for a numpy integer (whose launch fails) would
    be reused for the plain one. numpy integers become ints (`operator.index`); bools, floats and 0-d
    tensors or arrays (which have `__index__` but are no `numbers.Integral`) are refused."""
    if type(n) is not int:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        n = operator.index(n)
    if n < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {n}")
    return n


def check_float(name: str, x) -> float:
    """`x` as a Python float (numpy floats and ints too), or a TypeError naming `name`: bools and 0-d
    tensors or arrays are refused (`float()` would take them). Why at the door: see `check_int`."""
    if type(x) is float:
        return x
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(x).__name__}")
    return float(x)


# Kernels number rows, slots and tiles in int32 lanes (`program_id * BLOCK + lane`; a persistent program
# also forms the tile after its last one): the most rows (or slots) a launch takes, with room for that
# overshoot (at most 2**20 = (programs + 1) * BLOCK_M of any plan). Memory offsets are int64 everywhere.
MAX_ROWS = 2**31 - 2**20
INT32_MAX = 2**31 - 1


def check_row_count(name: str, n: int, what: str = "rows") -> None:
    """ValueError naming `name` unless `n` rows (or slots) fit the kernels' int32 row numbering."""
    if n > MAX_ROWS:
        raise ValueError(f"{name} has {n} {what}; the kernels number {what} in int32 and take at most "
                         f"{MAX_ROWS}: split the call")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_align(n_cols: int, *row_strides: int) -> int:
    """Largest power of two (at most 16) dividing the width and every row stride, in elements.

    Kernels take it as the constexpr ROW_ALIGN and apply it as `n // ROW_ALIGN * ROW_ALIGN`, which lets
    the compiler prove 16-byte alignment of rows without specializing the integer arguments themselves
    (the torch and JAX launchers specialize integers differently; see xkern/rms_norm/kernels.py)."""
    align = 16
    while any(v % align for v in (n_cols, *row_strides)):
        align //= 2
    return align


# The CPU path: Triton's interpreter, which must be chosen before triton is first imported.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Triton's interpreter (TRITON_INTERPRET=1, the CPU path) is not thread-safe, and JAX runs host callbacks
# on its own threads: every interpreted launch, from either front end, takes this lock (JAX's run on the
# one interpreter thread, `run_interpreted`, which takes it there).
INTERPRETER_LOCK = threading.Lock()
_WORKER: concurrent.futures.ThreadPoolExecutor | None = None
_WORKER_START = threading.Lock()


def run_interpreted(fn, *args):
    """`fn(*args)` (an interpreted launch) on the one interpreter thread, under INTERPRETER_LOCK.

    The GPU never flushes subnormals, and is the reference. XLA:CPU runs host callbacks with FTZ and DAZ
    set (MXCSR bits 15 and 6 on x86: fp32 subnormals in and out read as 0), and a thread inherits the floating
    point environment of the thread that starts it; so the worker resets its own to the C default
    (`fesetenv(FE_DFL_ENV)`: no flushing) before it runs anything."""
    global _WORKER
    if threading.current_thread().name.startswith("xkern-interpreter"):
        with INTERPRETER_LOCK:
            return fn(*args)
    with _WORKER_START:
        if _WORKER is None:
            _WORKER = concurrent.futures.ThreadPoolExecutor(1, "xkern-interpreter", _default_fp_env)
    try:
        future = _WORKER.submit(_locked, fn, *args)
    except RuntimeError:  # at exit: Python shuts thread pools down before atexit handlers drain pending work
        return _locked(fn, *args)
    return future.result()


def _locked(fn, *args):
    with INTERPRETER_LOCK:
        return fn(*args)


def _default_fp_env() -> None:
    """Clear flush-to-zero / denormals-are-zero on this thread (glibc's FE_DFL_ENV is `(fenv_t *) -1`)."""
    import numpy as np

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6").fesetenv(ctypes.c_void_p(-1))
        except (OSError, AttributeError):
            pass
    if np.float32(1e-40) * np.float32(1.0) == 0:
        warnings.warn("xkern: the interpreter thread flushes fp32 subnormals to zero (could not reset its "
                      "floating-point environment); CPU results on subnormal inputs differ from the GPU's",
                      RuntimeWarning, stacklevel=1)


def patch_interpreter() -> None:
    """Four fixes to Triton 3.6's interpreter (CPU runs of the kernels):

    - fp32 -> bf16 casts round to nearest even, as the GPU does (`cast_impl` ignores the rounding mode and
      truncates, which moves bf16 results by up to an ULP away from the GPU's).
    - bf16 -> fp32 casts are exact for subnormals, as on the GPU (`_convert_float` renormalizes a
      subnormal's significand with the wrong exponent: 126 of the 127 positive bf16 subnormals came out
      wrong, some as 0). Every bf16 is an fp32 with 16 more zero bits, which is what ml_dtypes computes.
    - a scalar used as a loop bound converts with numpy >= 2.4 too (`int()` of a 1-element array, which
      numpy 2.4 refuses; the GPU image has it).
    - `tl.dot` on bf16 operands multiplies their values (`create_dot` multiplied the uint16 bit patterns the
      interpreter holds bf16 in): each operand widened to fp32 exactly, as the GPU's tensor cores read it."""
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
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:  # bf16 is held as uint16 bits
            data = src.data.view(ml_dtypes.bfloat16).astype(np.float32)
            return interpreter.TensorHandle(data, dst_type.scalar)
        return cast_impl(self, src, dst_type)

    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_with_index(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    create_dot = builder.create_dot

    def bf16_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (interpreter.TensorHandle(t.data.view(ml_dtypes.bfloat16).astype(np.float32), tl.float32)
                if t.dtype.scalar == tl.bfloat16 else t for t in (a, b))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.cast_impl = rounding_cast
    builder.create_dot = bf16_dot
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


if INTERPRET:
    patch_interpreter()
