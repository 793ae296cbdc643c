"""Launching an xkern plan from JAX.

GPU: `jax_triton.triton_call` (imported lazily: only the GPU path needs it). CPU: the same @triton.jit
kernel runs under Triton's interpreter (TRITON_INTERPRET=1) inside `jax.pure_callback`, on numpy
buffers handed to the interpreter through `_HostArray`.
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_api._ptxas import use_triton_ptxas
from xkern.launch import INTERPRET, Launch, Recipe, bind, ordered_scalars, run_interpreted

_FORCE_GPU = False  # set by gpu_lowering(): take the jax-triton branch on any backend
_HOST_CALL = False  # set by host_custom_call(): the CPU path as a custom call (jax_api/_host_call.py)


@contextlib.contextmanager
def gpu_lowering():
    """Trace `call` down the GPU (jax-triton) path whatever the backend, so a CPU machine with a CUDA
    plugin can `jax.export(..., platforms=["cuda"])` it. Nothing runs: it only lowers."""
    global _FORCE_GPU
    saved, _FORCE_GPU = _FORCE_GPU, True
    try:
        yield
    finally:
        _FORCE_GPU = saved


# Both front ends launch the same machine code unless the user asks for jaxlib's own ptxas search.
if not INTERPRET and os.environ.get("XKERN_JAX_PTXAS", "triton") != "jaxlib":
    with contextlib.suppress(FileNotFoundError):  # no ptxas to route to: jaxlib's search stays
        use_triton_ptxas()


def check_array(name: str, a) -> None:
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"{name} must be a jax array, got {type(a).__name__}")


def concrete(name: str, a) -> np.ndarray:
    """`a` on the host for validate=True: it must be concrete (not traced under jit)."""
    try:
        return np.asarray(a)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        raise ValueError(f"validate=True needs a concrete {name} (call it outside jit)") from None


def execute(recipe: Recipe, **inputs) -> list[jax.Array]:
    """Run `recipe` on `inputs` (by name): each step's kernel through `call`, filled buffers as constants."""
    env = dict(inputs)
    for step in recipe.steps:
        if step.launch is None:
            outs = [jnp.full(b.shape, 0 if b.fill is None else b.fill, b.dtype) for b in step.outputs]
        else:  # an output with a fill (only 0) is zeroed before the launch (a memset, as torch.zeros)
            zeroed = tuple(i for i, b in enumerate(step.outputs) if b.fill is not None)
            assert all(step.outputs[i].fill == 0 for i in zeroed), "kernel outputs can only be zero-filled"
            outs = call(step.launch, [env[n] for n in step.inputs],
                        [jax.ShapeDtypeStruct(b.shape, jnp.dtype(b.dtype)) for b in step.outputs],
                        zeroed=zeroed, **step.scalars)
        env.update(zip((b.name for b in step.outputs), outs))
    return [env[n] for n in recipe.results]


@contextlib.contextmanager
def host_custom_call():
    """Trace the CPU path as `jax_api._host_call.host_call` instead of `jax.pure_callback`: for functions
    lowered while XLA partitions (custom_partitioning), where a pure_callback has no callback to call."""
    global _HOST_CALL
    saved, _HOST_CALL = _HOST_CALL, True
    try:
        yield
    finally:
        _HOST_CALL = saved


def call(plan: Launch, inputs, out_types, zeroed: tuple[int, ...] = (), **scalars) -> list[jax.Array]:
    """Launch `plan` on `inputs`, returning new arrays shaped like `out_types` (ShapeDtypeStructs); the
    outputs numbered in `zeroed` hold zeros before the launch."""
    if jax.default_backend() == "cpu" and not _FORCE_GPU:
        if not INTERPRET:
            raise RuntimeError("jax_api runs on CPU only under Triton's interpreter: set TRITON_INTERPRET=1 "
                               "before triton is first imported")
        run = functools.partial(_interpret, plan, out_types, scalars, zeroed)
        if _HOST_CALL:
            from jax_api._host_call import host_call

            return list(host_call(run, inputs, out_types))
        return list(jax.pure_callback(run, list(out_types), *inputs))
    jt = _jax_triton()
    # jax-triton 0.3.x calls the outputs `out_shape`, 0.4.x `out_type`.
    key = "out_shape" if jt.__version__.startswith("0.3") else "out_type"
    # Without a GPU there is no device to ask for its compute capability: lower for the H100/H200's sm_90.
    target = {"compute_capability": 90} if _FORCE_GPU else {}
    # Runtime scalars go positionally, after the inputs (the kernels' parameter order): by keyword,
    # jax-triton would bake them into the binary and compile other code than the torch launch.
    outs = jt.triton_call(*inputs, *ordered_scalars(plan, scalars), kernel=plan.kernel, grid=plan.grid,
                          num_warps=plan.num_warps, num_stages=plan.num_stages, **{key: list(out_types)},
                          **({"zeroed_outputs": zeroed} if zeroed else {}), **target, **plan.constexprs)
    return list(outs)


@functools.cache
def _jax_triton():
    # jax-triton 0.3.1 sets TRITON_CACHE_DIR="" on import, which breaks every later Triton compile in the
    # process (torch-side launches included): put the variable back as it was.
    saved = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if saved is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = saved
    return jax_triton


class _HostArray:
    """A numpy buffer as Triton's interpreter wants a tensor: a data pointer, a dtype and the storage
    hooks it uses to copy arguments to and from the host (here they are already there: no copies)."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def new_empty(self, *args, **kwargs):
        return _HostArray(self.array)

    def set_(self, storage, *args):
        self.array = storage.array
        return self

    def copy_(self, other):
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)


def _interpret(plan: Launch, out_types, scalars, zeroed, *inputs):
    # Not on the callback's own thread: XLA runs it with subnormals flushed (see run_interpreted).
    outs = [(np.zeros if i in zeroed else np.empty)(t.shape, t.dtype) for i, t in enumerate(out_types)]
    args = [_HostArray(np.ascontiguousarray(a)) for a in inputs] + [_HostArray(o) for o in outs]
    run_interpreted(lambda: plan.kernel[plan.grid](**bind(plan, args, scalars)))
    return outs


def varying(a) -> frozenset:
    """The shard_map axes `a` varies over (empty outside shard_map: then the array is not one shard)."""
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)  # jax 0.10; older releases call it `vma`
    return frozenset(mat.varying if mat is not None else getattr(t, "vma", ()))


def vary_like(a, like):
    """Inside shard_map: give `a` the varying manual axes of `like` (kernel call outputs carry none)."""
    missing = tuple(sorted(varying(like) - varying(a)))
    return jax.lax.pcast(a, missing, to="varying") if missing else a


def map_batched(op, axis_size, in_batched, *args):
    """vmap rule fallback for what cannot be folded into one launch: run `op` once per example."""
    args = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(args, in_batched)]
    return jax.lax.map(lambda a: op(*a), args)
