"""The CPU path as an XLA custom call: Triton's interpreter behind a C function pointer (ctypes).

`jax.pure_callback` finds its Python function through an index into the executable's list of host
callbacks. Inside `custom_partitioning` the per-shard function is lowered into a separate module while XLA
partitions, after that list was fixed, so a pure_callback there names no callback (a segfault in jax
0.10.2). This custom call carries its own key instead (the backend config), so it works wherever XLA
puts it. It is used only for the per-shard functions of `jax_api.sharding`; elsewhere the CPU path stays
`pure_callback`.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import threading
import time

import jax
import numpy as np
from jax._src import core, dispatch
from jax._src.interpreters import mlir

_TARGET = "xkern_interpret"
_LAUNCHES: dict[bytes, tuple] = {}  # backend config -> (run, input avals, output avals)
_LOCK = threading.Lock()

# XLA's "status returning, unified" custom call ABI on CPU (API_VERSION_STATUS_RETURNING_UNIFIED):
# void f(void* out, const void** in, const char* opaque, size_t opaque_len, XlaCustomCallStatus* status)
_ABI = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_size_t,
                        ctypes.c_void_p)


def _view(ptr: int, aval) -> np.ndarray:
    dtype = np.dtype(aval.dtype)
    size = int(np.prod(aval.shape, dtype=np.int64)) * dtype.itemsize
    buf = (ctypes.c_char * max(size, 1)).from_address(ptr)
    return np.frombuffer(buf, dtype=np.uint8, count=size).view(dtype).reshape(aval.shape)


_ACTIVE = [0, 0.0]  # host calls running now, and when one last started or ended (time.monotonic())
QUIET_S = 1.0       # at exit: no host call for this long means no computation is left running them


def _mark(delta: int) -> None:
    with _LOCK:
        _ACTIVE[0] += delta
        _ACTIVE[1] = time.monotonic()


def _entry(out, ins, opaque, opaque_len, status):
    _mark(1)
    try:
        _run(out, ins, opaque, opaque_len)
    finally:
        _mark(-1)


def _run(out, ins, opaque, opaque_len):
    key = ctypes.string_at(opaque, opaque_len)
    run, in_avals, out_avals = _LAUNCHES[key]
    inputs = [_view(ins[i], a) for i, a in enumerate(in_avals)]
    if len(out_avals) == 1:
        outs = [_view(out, out_avals[0])]
    else:
        ptrs = ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))
        outs = [_view(ptrs[i], a) for i, a in enumerate(out_avals)]
    try:
        results = run(*inputs)
        for o, r in zip(outs, results):
            o[...] = r
    except BaseException:
        # An exception cannot cross the C boundary (ctypes would print it and carry on with garbage outputs)
        # and XLA's status setter is not exported: report it and end the process, loudly.
        import os
        import sys
        import traceback

        traceback.print_exc()
        print("xkern: a kernel launch failed inside a partitioned CPU computation (see above); exiting",
              file=sys.stderr, flush=True)
        os._exit(70)


_ENTRY = _ABI(_entry)


@functools.cache
def _register() -> None:
    capsule = jax.ffi.pycapsule(ctypes.cast(_ENTRY, ctypes.c_void_p).value)
    jax.ffi.register_ffi_target(_TARGET, capsule, platform="cpu", api_version=0)


@atexit.register
def _drain() -> None:
    """Finish pending computations before the interpreter shuts down: a custom call that runs then would
    wait for the GIL forever (and the shutdown for it). Registered after jax's own exit hook, so runs first.
    Computations whose results were all dropped have no array to wait on: then wait until no host call has
    run for QUIET_S (at most two minutes)."""
    if _LAUNCHES:
        for array in jax.live_arrays():
            try:
                array.block_until_ready()
            except Exception:  # deleted or failed arrays: nothing pending
                pass
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (_ACTIVE[0] or time.monotonic() - _ACTIVE[1] < QUIET_S):
            time.sleep(0.05)


host_call_p = core.Primitive("xkern_host_call")
host_call_p.multiple_results = True
host_call_p.def_impl(functools.partial(dispatch.apply_primitive, host_call_p))
host_call_p.def_abstract_eval(lambda *avals, key, out_avals: list(out_avals))


def _lowering(ctx, *args, key, out_avals):
    _register()
    layouts = lambda avals: [tuple(range(len(a.shape) - 1, -1, -1)) for a in avals]  # row-major
    op = mlir.custom_call(_TARGET, result_types=[mlir.aval_to_ir_type(ctx.module_context, a) for a in out_avals],
                          operands=list(args), backend_config=key, api_version=3,  # "status returning, unified"
                          operand_layouts=layouts(ctx.avals_in), result_layouts=layouts(out_avals))
    return op.results


mlir.register_lowering(host_call_p, _lowering, platform="cpu")


def host_call(run, inputs, out_types) -> list:
    """`run(*numpy inputs) -> numpy outputs` as one custom call; `out_types`: ShapeDtypeStructs."""
    in_avals = tuple(core.ShapedArray(a.shape, a.dtype) for a in inputs)
    out_avals = tuple(core.ShapedArray(t.shape, t.dtype) for t in out_types)
    with _LOCK:
        key = f"{len(_LAUNCHES)}".encode()
        _LAUNCHES[key] = (run, in_avals, out_avals)
    return host_call_p.bind(*inputs, key=key, out_avals=out_avals)
