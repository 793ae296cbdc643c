"""Executing xkern's recipes from PyTorch: allocate each step's outputs, launch its kernel.

Three ways to launch one plan, all the same binary:
- eager on CUDA (`Executor`): the compiled kernel is looked up once per (device, pointer alignment) and
  then launched through Triton's low-level launcher with a prebuilt argument list (no per-call argument
  binding or specialization);
- inside the registered ops (`run_recipe`, used under torch.compile, export, DTensor, fake tensors):
  `torch.library.wrap_triton`, so Inductor emits the kernel launch in its generated code;
- on CPU under TRITON_INTERPRET=1: the interpreter, one launch at a time.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import threading

import torch
from torch.autograd import forward_ad
from triton import knobs

from xkern.launch import INTERPRET, Launch, Recipe, bind, row_align, run_interpreted

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32,
          "int64": torch.int64}
NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The numpy-style name the core's contracts take ("bfloat16"); other dtypes by their torch name."""
    return NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def check_device(name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
    if like is not None and t.device != like.device:
        raise ValueError(f"{name} must be on {like.device} like the other inputs, got {t.device}")
    if t.device.type != "cuda" and not (INTERPRET and t.device.type == "cpu"):
        raise ValueError(f"{name} must be a CUDA tensor (CPU tensors run only with TRITON_INTERPRET=1), "
                         f"got {t.device}")


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
_peek_functorch = torch._C._functorch.peek_interpreter_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack


# How an eager call runs (`eager`). Not eager is 0 (falsy): `if eager(...)` reads "may launch directly".
REGISTERED = 0  # the registered op: compiled or traced, a tensor subclass, a dispatch mode
DIRECT = 1      # the executor, no autograd: nothing requires grad, no transform
AUTOGRAD = 2    # the op's autograd.Function through the C++ apply (`fast_apply`)
TRANSFORM = 3   # forward-mode AD or a functorch transform is active: the Function's `jvp` or `vmap` may run
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def eager(*tensors: torch.Tensor | None) -> int:
    """How an eager call runs, in one pass over its tensors (None: an absent optional input): REGISTERED
    (falsy) unless they are plain tensors, not being compiled or traced, no dispatch mode active; then
    TRANSFORM under forward-mode AD or a functorch transform (the op's autograd.Function takes the call: its
    forward then sees plain tensors), AUTOGRAD where grad mode is on and a tensor requires grad, else DIRECT
    (a cached `Executor`)."""
    grad = _grad_enabled()
    needs = False
    for t in tensors:
        if t is not None:
            if type(t) not in _PLAIN:
                return REGISTERED
            if grad and t.requires_grad:
                needs = True
    if _is_compiling() or _dispatch_modes():
        return REGISTERED
    if forward_mode():
        return TRANSFORM
    return AUTOGRAD if needs else DIRECT


def functorch_active() -> bool:
    return _peek_functorch() is not None


def forward_mode() -> bool:
    """Whether a Function applied now may have its `jvp` called: forward-mode AD or a functorch transform
    is active. Otherwise `setup_context` skips `save_for_forward` (~3 µs of an eager training step)."""
    return forward_ad._current_level >= 0 or _peek_functorch() is not None


def fast_apply(function: type[torch.autograd.Function]):
    """`function.apply` without its Python wrapper (which re-binds default arguments through
    inspect.signature on every call), for calls with every argument given and no functorch transform
    active; the wrapper where this torch has no such C++ entry point."""
    raw = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
    return raw.__get__(None, function) if raw is not None else function.apply


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether an eager call must go through its autograd.Function: a tensor (None: absent) requires grad,
    forward-mode AD is on, or a functorch transform (torch.func.grad/jvp/vmap) is active."""
    if torch.is_grad_enabled():
        for t in tensors:
            if t is not None and t.requires_grad:
                return True
    return forward_mode()


# ---------------------------------------------------------------------------------------------------
# The eager fast path, the same for every op: one cache of executors keyed on the call signature (the op's
# name and everything its checks and its plan read: shapes, strides, dtypes, devices, scalars), the
# arguments checked once, on a miss, by the function that builds the executor.

_EXECUTORS: dict = {}


@contextlib.contextmanager
def executor_cache(cache: dict | None = None):
    """Eager calls inside the block keep their executors in `cache` (a new dict by default), which it yields:
    a tuning tool that swaps a plan sees executors built on it, and can count their launches."""
    global _EXECUTORS
    saved, _EXECUTORS = _EXECUTORS, ({} if cache is None else cache)
    try:
        yield _EXECUTORS
    finally:
        _EXECUTORS = saved


def clear_executors() -> None:
    """Drop every cached eager executor (after a plan was swapped)."""
    _EXECUTORS.clear()


def cached(key: tuple, make, *args):
    """The executor cached under `key`, else `make(*args)` (which checks the arguments, then builds it) cached
    there. A key that cannot be hashed (an unhashable scalar) builds without caching: make's checks name it."""
    try:
        ex = _EXECUTORS.get(key)
    except TypeError:
        return make(*args)
    if ex is None:
        ex = _EXECUTORS[key] = make(*args)
    return ex


def signature(t: torch.Tensor | None) -> tuple | None:
    """What an eager executor depends on in a tensor (None: an absent optional input). A contiguous tensor's
    strides are its shape's wherever one addresses memory (a size-1 dim's never does): no stride tuple."""
    return None if t is None else (t.shape, t.dtype, t.device, None if t.is_contiguous() else t.stride())


def rows_layout(t: torch.Tensor) -> tuple[bool, int]:
    """Whether the eager path copies `t` (contiguous) rather than reading it in place, and the row stride it
    then reads. In place: rows that collapse to one row stride with the alignment of a contiguous array's
    (JAX's layout: another ROW_ALIGN would compile another binary, with other sum orders)."""
    t2 = rows_view(t)
    n_cols = t.shape[-1]
    copy = t.numel() > 0 and (t2.data_ptr() != t.data_ptr() or row_align(n_cols, t2.stride(0)) != row_align(n_cols))
    return copy, n_cols if copy else t2.stride(0)


def readable(t: torch.Tensor | None, copy: bool) -> torch.Tensor | None:
    """`t` as the kernels read it (`rows_layout`'s `copy`; None stays None): a contiguous copy, or t itself at a
    16-byte-aligned address (as JAX's buffers always are; Triton compiles misaligned pointers to another
    binary), else an aligned copy with t's strides."""
    if t is None or not copy and t.data_ptr() & 15 == 0:  # the common case: read in place
        return t
    if copy:
        return t.contiguous() if t.data_ptr() & 15 == 0 else t.clone(memory_format=torch.contiguous_format)
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def aligned(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor given (None: absent) starts at a 16-byte-aligned address: the in-place check of an
    executor hit, one for all of a call's tensors (`readable` says why alignment matters)."""
    bits = 0
    for t in tensors:
        if t is not None:
            bits |= t.data_ptr()
    return not bits & 15


def flat_weight(weight: torch.Tensor | None) -> torch.Tensor | None:
    """A norm's weight as the kernels read it, contiguous: one copy for strided or expanded weights."""
    return weight if weight is None or weight.stride(0) == 1 or weight.shape[0] <= 1 else weight.contiguous()


def aligned_weight(weight: torch.Tensor | None) -> torch.Tensor | None:
    """A norm's weight as the eager path reads it: contiguous and 16-byte aligned (see `readable`)."""
    if weight is None:
        return None
    weight = flat_weight(weight)
    return weight if weight.data_ptr() & 15 == 0 else weight.clone()


def dtype_or_none(t: torch.Tensor | None) -> str | None:
    """An optional input's dtype name (None: absent)."""
    return None if t is None else dtype_name(t.dtype)


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, last]: a view when the last dim is contiguous and the leading dims collapse to one
    row stride (head-major views, slices of a fused tensor), otherwise a contiguous copy."""
    width = t.shape[-1] if t.dim() else 1
    rows = math.prod(t.shape[:-1])
    if t.dim() >= 1 and (t.stride(-1) == 1 or width == 1):
        try:
            return t.view(rows, width)
        except (RuntimeError, ValueError):  # fake tensors raise ValueError
            pass
    return t.reshape(rows, width).contiguous()


def _alloc(buffer, device) -> torch.Tensor:
    dtype = DTYPES[buffer.dtype]
    if buffer.fill is None:
        return torch.empty(buffer.shape, dtype=dtype, device=device)
    return torch.full(buffer.shape, buffer.fill, dtype=dtype, device=device)


_TRACING = threading.local()


def register_op(name: str):
    """Decorator: `fn` as the op `name`, a `torch.library.triton_op`, so that Inductor launches its kernels
    from the generated code. Under the interpreter, whose kernels torch cannot trace, an opaque custom op
    whose fake implementation is `fn` with its launches skipped."""

    def wrap(fn):
        if not INTERPRET:
            return torch.library.triton_op(name, mutates_args=())(fn)
        op = torch.library.custom_op(name, mutates_args=())(fn)

        def fake(*args, **kwargs):
            _TRACING.active = True
            try:
                return fn(*args, **kwargs)
            finally:
                _TRACING.active = False

        op.register_fake(fake)
        return op

    return wrap


def run_recipe(recipe: Recipe, device, **inputs: torch.Tensor) -> list[torch.Tensor]:
    """Execute `recipe` on `inputs` (by name) through `wrap_triton`: the registered ops' bodies."""
    env = dict(inputs)
    for step in recipe.steps:
        outs = [_alloc(b, device) for b in step.outputs]
        if step.launch is not None:
            launch(step.launch, *[env[n] for n in step.inputs], *outs, **step.scalars)
        env.update(zip((b.name for b in step.outputs), outs))
    return [env[n] for n in recipe.results]


def launch(plan: Launch, *arrays: torch.Tensor, **scalars) -> None:
    """Launch one plan on `arrays` (its inputs, then its outputs) through `wrap_triton` (traceable by
    Inductor), or the interpreter; skipped while an interpreted op's fake implementation runs."""
    if getattr(_TRACING, "active", False):
        return
    kwargs = bind(plan, arrays, scalars)
    if INTERPRET:
        run_interpreted(lambda: plan.kernel[plan.grid](**kwargs))
    else:
        torch.library.wrap_triton(plan.kernel)[plan.grid](**kwargs, num_warps=plan.num_warps,
                                                          num_stages=plan.num_stages)


_RUNTIME = knobs.runtime


def _hooks_set() -> bool:
    """Whether a profiler set Triton's launch hooks (they run only on Triton's own launch path)."""
    enter, exit_ = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(exit_, "calls", exit_))


class _Launcher:
    """One step's kernel, ready to launch on data pointers: the scalar and constexpr arguments laid out
    once in the kernel's parameter order (inputs, scalars, outputs, constexprs), and the compiled binary
    per device for 16-byte-aligned pointers. Other alignments (offset views) go through Triton's launcher,
    which picks the binary specialized for them."""

    def __init__(self, plan: Launch, n_inputs: int, n_outputs: int, scalars: dict):
        names = plan.kernel.arg_names
        order = [n for n in names if n in scalars]
        consts = [n for n in names if n in plan.constexprs]
        n_ptrs = len(names) - len(order) - len(consts)
        if n_ptrs != n_inputs + n_outputs or names[n_inputs:n_inputs + len(order)] != order or \
                names[len(names) - len(consts):] != consts:
            raise TypeError(f"{plan.kernel.__name__}{tuple(names)} is not ordered inputs, scalars, outputs, "
                            f"constexprs for {n_inputs} inputs and {n_outputs} outputs")
        self.plan, self.scalars, self.n_inputs = plan, scalars, n_inputs
        self.middle = tuple(scalars[n] for n in order)
        self.tail = tuple(plan.constexprs[n] for n in consts)
        self.grid = tuple(plan.grid) + (1,) * (3 - len(plan.grid))
        self.binaries = {}

    def __call__(self, arrays: list[torch.Tensor], device: int) -> None:
        ptrs = [a.data_ptr() for a in arrays]
        entry = self.binaries.get(device)
        aligned = not functools.reduce(operator.or_, ptrs) & 15
        if entry is None or not aligned or INTERPRET or _hooks_set():
            self._slow(arrays, device, aligned)
            return
        launch, head, meta = entry
        n = self.n_inputs
        launch(*self.grid, torch._C._cuda_getCurrentRawStream(device), *head, meta, None, None, None, *ptrs[:n],
               *self.middle, *ptrs[n:], *self.tail)

    def _slow(self, arrays, device, aligned) -> None:
        plan = self.plan
        kwargs = bind(plan, arrays, self.scalars)
        if INTERPRET:
            run_interpreted(lambda: plan.kernel[plan.grid](**kwargs))
            return
        with torch.cuda.device(device):
            binary = plan.kernel[plan.grid](**kwargs, num_warps=plan.num_warps, num_stages=plan.num_stages)
        if aligned:
            self.binaries[device] = _entry(binary)


def _entry(binary):
    """How to launch a compiled kernel: `(launch, leading arguments, packed metadata)`. Triton 3.6's CUDA
    launcher object allocates scratch space, then calls its C `launch` with the cooperative-grid and PDL
    flags and the two scratch pointers; kernels that need no scratch are launched through `launch`
    directly. Anything else goes through the launcher object (`binary.run`)."""
    run = binary.run
    if getattr(run, "global_scratch_size", None) == 0 and getattr(run, "profile_scratch_size", None) == 0 and \
            hasattr(run, "launch") and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl"):
        return run.launch, (binary.function, run.launch_cooperative_grid, run.launch_pdl, None, None), \
            binary.packed_metadata
    return run, (binary.function,), binary.packed_metadata


# The allocation Inductor's generated code makes (the current CUDA device, no argument parsing): a third of
# torch.empty's host time. Absent (an older or CPU-only torch, the interpreter): torch.empty throughout.
_ALLOC = None if INTERPRET else getattr(getattr(torch._C, "_dynamo", None), "guards", None)
_ALLOC = getattr(_ALLOC, "_empty_strided_cuda", None)
_CURRENT_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


class Executor:
    """A recipe bound for eager launches: cache one per call signature (shapes, strides, dtypes, scalars)
    and call it with the input tensors. `shapes` gives some buffers another shape of the same size
    (contiguous, so the same layout), e.g. a result in x's shape.

    The launchers are built once and the call is generated as straight-line Python (allocate, launch, in
    the recipe's order): a loop over the steps cost the host ~2.6 µs more per two-step call. Unfilled 1-D
    buffers of one dtype (the index ops' tables and results) are carved from one allocation
    (`split_with_sizes`, each piece at a 16-byte boundary): generate_permute_indices makes 5 buffers from 1.
    `wrap` replaces each launcher by `wrap(launcher)` (the host benchmark's floor: empty kernels)."""

    def __init__(self, recipe: Recipe, input_names: tuple[str, ...], shapes: dict | None = None, wrap=None):
        self.recipe, self.input_names, self.shapes = recipe, input_names, shapes
        shapes = shapes or {}
        # int(): the shapes are written into the generated code (a numpy integer would print as np.int64(8))
        outs = [(tuple(int(d) for d in shapes.get(b.name, b.shape)), DTYPES[b.dtype], b.fill)
                for step in recipe.steps for b in step.outputs]
        pools: dict = {}  # dtype -> positions (in `outs`) of its unfilled 1-D buffers
        for at, (shape, dtype, fill) in enumerate(outs):
            if fill is None and len(shape) == 1:
                pools.setdefault(dtype, []).append(at)
        pools = {dtype: members for dtype, members in pools.items() if len(members) > 1}
        env = {"empty": torch.empty, "full": torch.full, "alloc": _ALLOC, "current": _CURRENT_DEVICE}
        for k, (_, dtype, fill) in enumerate(outs):
            env[f"D{k}"], env[f"F{k}"] = dtype, fill
        launches = []
        for j, step in enumerate(recipe.steps):
            if step.launch is not None:
                launcher = _Launcher(step.launch, len(step.inputs), len(step.outputs), step.scalars)
                env[f"L{j}"] = launcher if wrap is None else wrap(launcher)
                launches.append(j)
        self.launches = len(launches)
        self.allocations = len(pools) + sum(1 for at in range(len(outs)) if all(at not in m for m in pools.values()))
        args = ", ".join(f"a{i}" for i in range(len(input_names)))
        code = [f"def run({args}):", "    dev = a0.device", "    n = dev.index",
                f"    if n != current():  # not the current CUDA device (or CPU): through torch.empty\n"
                f"        return run_any({args})"]
        for fast in (True, False):
            if not fast:
                code += [f"def run_any({args}):", "    dev = a0.device", "    n = dev.index"]
            code += self._body(recipe, input_names, outs, pools, env, launches, fast)
        exec("\n".join(code), env)  # noqa: S102 - our own code, from the recipe's names and shapes
        self.run = env["run"] if _ALLOC is not None and _CURRENT_DEVICE is not None else env["run_any"]

    @staticmethod
    def _body(recipe, input_names, outs, pools, env, launches, fast: bool) -> list[str]:
        """The generated call's statements: allocations (`alloc`: the current device's caching allocator
        without torch.empty's argument parsing, as Inductor's generated code allocates), then the launches."""
        def new(shape, dtype):
            strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            return f"alloc({shape}, {strides}, {dtype})" if fast else f"empty({shape}, dtype={dtype}, device=dev)"

        code, source = [], {}
        for k, (dtype, members) in enumerate(pools.items()):
            sizes = []
            align = 16 // torch.empty((), dtype=dtype).element_size()
            for at in members:
                source[at] = f"p{k}[{len(sizes)}]"
                size = outs[at][0][0]
                sizes += [size, -size % align] if at != members[-1] and size % align else [size]
            env[f"S{k}"] = sizes
            code.append(f"    p{k} = {new((sum(sizes),), f'D{members[0]}')}.split_with_sizes(S{k})")
        var = {name: f"a{i}" for i, name in enumerate(input_names)}
        at = 0
        for j, step in enumerate(recipe.steps):
            names = []
            for b in step.outputs:
                var[b.name] = name = f"b{at}"
                shape, _, fill = outs[at]
                code.append(f"    {name} = " + (source.get(at) or (new(shape, f"D{at}") if fill is None else
                                                                f"full({shape}, F{at}, dtype=D{at}, device=dev)")))
                names.append(name)
                at += 1
            if j in launches:
                code.append(f"    L{j}([{', '.join([var[n] for n in step.inputs] + names)}], n)")
        code.append(f"    return [{', '.join(var[n] for n in recipe.results)}]")
        return code

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return self.run(*inputs)
