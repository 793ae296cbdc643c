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
import dataclasses
import functools
import inspect
import math
import operator

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
_is_compiling = torch.compiler.is_compiling
_legacy_batched = torch._C._functorch.is_legacy_batchedtensor
_grad_enabled = torch.is_grad_enabled


# How a call runs: every op's public function asks, in this order,
#   direct(...)  -> the cached executor alone (plain tensors, no autograd, no transform: one pass, the hot path
#                   of inference and of a backward's own launches);
#   traced(...)  -> the registered op (torch.compile, export, tensor subclasses such as DTensor, dispatch modes;
#                   its autograd is the op's autograd.Function's rules);
#   else         -> the op's autograd.Function, whose forward launches the executor.


def direct(*tensors: torch.Tensor | None) -> bool:
    """Whether an eager call may launch its executor with no autograd node: plain tensors (None: an absent
    optional input), none requiring grad under grad mode, not compiled or traced, no dispatch mode, no
    forward-mode AD or functorch transform. One pass: 0.7 µs on the CPU (2026-12-07)."""
    grad = _grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or grad and t.requires_grad):
            return False
    return not (_is_compiling() or _dispatch_modes() or forward_ad._current_level >= 0 or
                _peek_functorch() is not None)


def direct_or_batched(*tensors: torch.Tensor | None) -> bool:
    """`direct`, for calls a backward makes too: False also for gradients batched by
    autograd.grad(is_grads_batched=True), which have no storage of their own (`traced` takes them: the
    registered op's batching fallback runs it per example). 0.1 µs a tensor more than `direct`."""
    if not direct(*tensors):
        return False
    for t in tensors:
        if t is not None and _legacy_batched(t):
            return False
    return True


def traced(*tensors: torch.Tensor | None) -> bool:
    """Whether a call must go through the registered op: being compiled or traced, a dispatch mode active,
    or a tensor (None: an absent optional input) of a subclass (DTensor, FakeTensor, FunctionalTensor) or
    without storage of its own (autograd.grad(is_grads_batched=True) batches gradients so: the op's batching
    fallback then runs it per example)."""
    if _is_compiling() or _dispatch_modes():
        return True
    for t in tensors:
        # (a batched gradient requires no grad: the check, 0.1 µs, is skipped for a forward's leaves)
        if t is not None and (type(t) not in _PLAIN or not t.requires_grad and _legacy_batched(t)):
            return True
    return False


def functorch_active() -> bool:
    """Whether a torch.func transform (grad, vjp, jvp, vmap, jacrev, ...) is active."""
    return _peek_functorch() is not None


def forward_mode() -> bool:
    """Whether a Function applied now may have its `jvp` called: forward-mode AD or a functorch transform
    is active. Otherwise `setup_context` skips `save_for_forward` (~3 µs of an eager training step)."""
    return forward_ad._current_level >= 0 or _peek_functorch() is not None


def differentiable_backward() -> bool:
    """Whether a backward must itself be differentiable or batchable: create_graph (grad mode on inside the
    backward), a functorch transform (torch.func.grad, vmap of a backward, is_grads_batched), or forward-mode AD.
    Such backwards take the eager math's derivatives in torch ops instead of the kernels."""
    return _grad_enabled() or forward_mode()


def raw_apply(function: type[torch.autograd.Function]):
    """`function.apply` without its Python wrapper, for calls that give every argument with no functorch
    transform active (under one, call `function.apply`: functorch's `custom_function_call` needs the wrapper).
    The wrapper binds the arguments through inspect.signature on every call: RMSNormFunction's forward
    took 70 µs through it against 15 through the C++ apply (CPU, launches stubbed, 2026-12-07); a third of an
    eager training step's host time on the H200's host (2026-12-03). The wrapper where this torch has no such
    C++ entry point."""
    raw = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
    return raw.__get__(None, function) if raw is not None else function.apply


def loop_vmap(apply_fn, info, in_dims, *args):
    """A Function's `vmap` rule that runs it once per example and stacks the results on dim 0: for the
    batched forms no kernel takes (per-example indices or weights). Non-tensor arguments pass through."""
    size = info.batch_size
    per = [a.movedim(d, 0).unbind(0) if d is not None else (a,) * size for a, d in zip(args, in_dims)]
    outs = [apply_fn(*(p[i] for p in per)) for i in range(size)]
    if isinstance(outs[0], tuple):
        return tuple(None if o[0] is None else torch.stack([r[j] for r in outs]) for j, o in
                     enumerate(zip(*outs))), tuple(None if o[0] is None else 0 for o in zip(*outs))
    return torch.stack(outs), 0


# ---------------------------------------------------------------------------------------------------
# The eager fast path, the same for every op: one cache of executors keyed on the call signature (the op's
# name and everything its checks and its plan read: shapes, strides, dtypes, devices, scalars), the
# arguments checked once, on a miss, by the function that builds the executor. Bounded: a server that sees
# every sequence length keeps the last MAX_EXECUTORS signatures (first in, first out; a miss costs one
# plan lookup, the core's lru_caches, and one executor build).

MAX_EXECUTORS = 1024
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
    there, the oldest entry dropped beyond MAX_EXECUTORS. A key that cannot be hashed (an unhashable scalar)
    builds without caching: make's checks name it."""
    try:
        ex = _EXECUTORS.get(key)
    except TypeError:
        return make(*args)
    if ex is None:
        ex = make(*args)
        while len(_EXECUTORS) >= MAX_EXECUTORS:
            del _EXECUTORS[next(iter(_EXECUTORS))]
        _EXECUTORS[key] = ex
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


def symbolic(*args) -> bool:
    """Whether a tensor among `args` has a symbolic size or stride (torch.compile with dynamic shapes,
    mark_dynamic, torch.export with a Dim): its plan cannot be chosen while tracing."""
    for a in args:
        if isinstance(a, torch.Tensor) and not all(type(s) is int for s in (*a.shape, *a.stride())):
            return True
    return False


# Symbolic row counts (torch.compile with dynamic=True, mark_dynamic, torch.export with a Dim). A plan takes the
# row count as an int; past a width's saturation row count (tiles at full height, as many programs as the
# grid's cap) every row count gets the same launches, whose grids, scalars and buffer sizes are the row
# count, its ceiling division by a tile height, or constants. `rows_recipe` reads those forms off the recipe at
# two large row counts and finds the smallest power of two from which the recipe is that one; a traced call
# guards `rows >= it` (one graph for all of them, Inductor launching the kernels from its generated code, the
# eager call's plan exactly) and takes the opaque twin below it (`register_op`): at most two graphs.
_R1, _R2 = 1 << 22, 3 << 21


class NeedsConcreteRows(Exception):
    """A symbolic row count below the recipe's saturation (or a recipe of no such form): the twin runs it."""


@dataclasses.dataclass(frozen=True)
class _PerRows:
    """An int of a saturated recipe that is cdiv(rows, tile): the row count itself at tile 1."""

    tile: int

    def at(self, rows):
        return rows if self.tile == 1 else (rows + self.tile - 1) // self.tile


def _forms(a, b):
    """`a` (the recipe at _R1 rows) with each int that differs from its counterpart in `b` (the recipe at _R2
    rows) replaced by its `_PerRows` form; raises NeedsConcreteRows where the two differ otherwise."""
    if isinstance(a, int) and not isinstance(a, bool) and isinstance(b, int) and a != b:
        tile = _R1 // a if a > 0 and _R1 % a == 0 else 0
        if tile and _R2 % tile == 0 and _R2 // tile == b:
            return _PerRows(tile)
        raise NeedsConcreteRows
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(_forms(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return {k: _forms(a[k], b[k]) for k in a}
    if dataclasses.is_dataclass(a) and not isinstance(a, type) and type(a) is type(b):
        return dataclasses.replace(a, **{f.name: _forms(getattr(a, f.name), getattr(b, f.name))
                                         for f in dataclasses.fields(a)})
    if a is b or type(a) is type(b) and a == b:
        return a
    raise NeedsConcreteRows


def _at(forms, rows):
    """The recipe of `forms` at `rows` (an int or a SymInt)."""
    if isinstance(forms, _PerRows):
        return forms.at(rows)
    if isinstance(forms, tuple):
        return tuple(_at(f, rows) for f in forms)
    if isinstance(forms, dict):
        return {k: _at(v, rows) for k, v in forms.items()}
    if dataclasses.is_dataclass(forms) and not isinstance(forms, type):
        return dataclasses.replace(forms, **{f.name: _at(getattr(forms, f.name), rows)
                                             for f in dataclasses.fields(forms)})
    return forms


@functools.lru_cache(maxsize=256)
def _saturated(make, args: tuple, kwargs: tuple):
    """(forms, the smallest power of two from which make(rows, *args, **kwargs) is `forms` at rows), or None."""
    recipe = lambda rows: make(rows, *args, **dict(kwargs))  # noqa: E731
    try:
        forms = _forms(recipe(_R1), recipe(_R2))
    except NeedsConcreteRows:
        return None
    threshold = _R1
    while threshold > 1 and recipe(threshold // 2) == _at(forms, threshold // 2):
        threshold //= 2
    return forms, threshold


def rows_recipe(make, rows, *args, **kwargs):
    """make(rows, *args, **kwargs), the op's recipe; for a symbolic row count, the saturated recipe with the
    rows symbolic, after a guard that `rows` is at least its threshold (`NeedsConcreteRows` below it)."""
    if type(rows) is int:
        return make(rows, *args, **kwargs)
    found = _saturated(make, args, tuple(sorted(kwargs.items())))
    if found is None or not rows >= found[1]:  # (a guard on the symbolic row count)
        raise NeedsConcreteRows
    return _at(found[0], rows)


def register_op(name: str, fake, symbolic_rows: bool = False):
    """Decorator: `fn` as the op `name`, with `fake(*args)` giving its outputs' shapes and dtypes from the
    inputs' alone, so that a traced row count stays symbolic (plans are chosen per call, at run time).

    On the GPU a `torch.library.triton_op`, so that Inductor launches its kernels from the generated code; a
    call traced with symbolic sizes goes to its twin `name + "_any"` instead, an opaque custom op (`fake`
    traced, `fn` run with the concrete shapes): one graph for every row count. With `symbolic_rows` (`fn`
    plans through `rows_recipe`, reading no size as an int but the row count's) `fn` traces a saturated row
    count itself, the twin taking the rest. Under the interpreter, whose kernels torch cannot trace, the op
    itself is an opaque custom op with `fake`."""

    def wrap(fn):
        if INTERPRET:
            op = torch.library.custom_op(name, mutates_args=())(fn)
            op.register_fake(fake)
            return op
        from torch._library.triton import set_wrap_triton_enabled

        def run_any(*args):
            with set_wrap_triton_enabled(False):  # launched from Python, as triton_op's own eager calls
                return fn(*args)

        signature = inspect.signature(fn, eval_str=True)  # annotations resolved in fn's module
        run_any.__signature__ = signature
        twin = torch.library.custom_op(name + "_any", mutates_args=())(run_any)
        twin.register_fake(fake)

        @functools.wraps(fn)
        def body(*args):
            if not symbolic(*args):
                return fn(*args)
            if symbolic_rows:
                try:  # a saturated plan (`rows_recipe`): Inductor launches its kernels
                    return fn(*args)
                except NeedsConcreteRows:
                    pass
            return twin(*args)  # (other ops' plans read sizes as ints: traced, they would specialize)

        body.__signature__ = signature

        return torch.library.triton_op(name, mutates_args=())(body)

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
    Inductor), or the interpreter."""
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
    """A recipe bound for eager launches: cache one per call signature (shapes, strides, dtypes, device,
    scalars) and call it with the input tensors. `shapes` gives some buffers another shape of the same size
    (contiguous, so the same layout), e.g. a result in x's shape.

    Built once: every buffer's allocation (all made before the first launch, in the recipe's order) and every
    step's launcher with the positions of its arguments, so that a call is two flat loops. Where the inputs sit
    on the current CUDA device, buffers come from the allocation Inductor's generated code makes (`_ALLOC`: a
    third of torch.empty's host time, 2026-12-02). Unfilled 1-D buffers of one dtype (the index ops' tables and
    results) are carved from one allocation (`split_with_sizes`, each piece at a 16-byte boundary):
    generate_permute_indices makes 5 buffers from 1. `wrap` replaces each launcher by `wrap(launcher)` (the
    host benchmark's floor: empty kernels)."""

    def __init__(self, recipe: Recipe, input_names: tuple[str, ...], shapes: dict | None = None, wrap=None):
        self.recipe, self.input_names, self.shapes = recipe, input_names, shapes
        shapes = shapes or {}
        buffers = [b for step in recipe.steps for b in step.outputs]
        outs = [(tuple(int(d) for d in shapes.get(b.name, b.shape)), DTYPES[b.dtype], b.fill) for b in buffers]
        pools: dict = {}  # dtype -> positions (in `outs`) of its unfilled 1-D buffers
        for at, (shape, dtype, fill) in enumerate(outs):
            if fill is None and len(shape) == 1:
                pools.setdefault(dtype, []).append(at)
        pools = {dtype: members for dtype, members in pools.items() if len(members) > 1}
        pooled = {at for members in pools.values() for at in members}
        # The allocations, in the order a call makes them: each pool (its pieces, padding dropped), then the
        # other buffers one by one. `made`: which buffer each made tensor is.
        self._allocs, made = [], []
        for dtype, members in pools.items():
            align = 16 // torch.empty((), dtype=dtype).element_size()
            sizes, keep = [], []
            for at in members:
                size = outs[at][0][0]
                keep.append(len(sizes))
                sizes += [size, -size % align] if at != members[-1] and size % align else [size]
            self._allocs.append(((sum(sizes),), dtype, None, (sizes, tuple(keep))))
            made += members
        for at, (shape, dtype, fill) in enumerate(outs):
            if at not in pooled:
                self._allocs.append((shape, dtype, fill, None))
                made.append(at)
        n_in = len(input_names)
        where = {name: i for i, name in enumerate(input_names)}  # env: the inputs, then the made tensors
        where.update({buffers[at].name: n_in + k for k, at in enumerate(made)})
        self._launches = []
        for step in recipe.steps:
            if step.launch is not None:
                launcher = _Launcher(step.launch, len(step.inputs), len(step.outputs), step.scalars)
                args = tuple(where[n] for n in step.inputs) + tuple(where[b.name] for b in step.outputs)
                self._launches.append((launcher if wrap is None else wrap(launcher), operator.itemgetter(*args)))
        results = tuple(where[n] for n in recipe.results)
        # itemgetter: a C call where a list comprehension is a Python frame (~0.3 µs each); one result: a slice
        self._results = (operator.itemgetter(slice(results[0], results[0] + 1)) if len(results) == 1 else
                         operator.itemgetter(*results))
        self.launches, self.allocations = len(self._launches), len(self._allocs)
        self._pools = tuple((shape, dtype, *pool) for shape, dtype, fill, pool in self._allocs if pool is not None)
        self._singles = tuple((shape, tuple(math.prod(shape[i + 1:]) for i in range(len(shape))), dtype, fill)
                              for shape, dtype, fill, pool in self._allocs if pool is None)
        self._makers: dict = {}  # fast (bool) -> `_single_makers`
        if len(self._launches) == 1 and len(self._singles) == 1 and not self._pools and self._singles[0][3] is None \
                and results == (n_in,):
            self.run = self._run_one

    def _run_one(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        """`run` of a recipe of one launch writing one buffer (most forwards and every gather): no loops, 3.1
        against `run`'s 3.5 µs per call on the CPU (launches stubbed, 2026-12-07)."""
        device = inputs[0].device
        n = device.index
        shape, strides, dtype, _ = self._singles[0]
        out = _ALLOC(shape, strides, dtype) if _ALLOC is not None and n == _CURRENT_DEVICE() else \
            torch.empty(shape, dtype=dtype, device=device)
        launcher, args = self._launches[0]
        launcher(args((*inputs, out)), n)
        return [out]

    def _single_makers(self, device: torch.device, fast: bool) -> tuple:
        """The unpooled buffers' allocations on `device` as argument-free callables (C partials: no tuple
        unpacking per call)."""
        makers = []
        for shape, strides, dtype, fill in self._singles:
            if fill is not None:
                makers.append(functools.partial(torch.full, shape, fill, dtype=dtype, device=device))
            elif fast:
                makers.append(functools.partial(_ALLOC, shape, strides, dtype))
            else:
                makers.append(functools.partial(torch.empty, shape, dtype=dtype, device=device))
        return tuple(makers)

    def run(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        """Allocate every buffer, launch every step, return the results: two flat loops over prebuilt tuples."""
        device = inputs[0].device
        n = device.index
        env = [*inputs]
        fast = _ALLOC is not None and n == _CURRENT_DEVICE()  # the current CUDA device (a CPU index is None)
        if self._pools:
            for shape, dtype, sizes, keep in self._pools:
                whole = _ALLOC(shape, (1,), dtype) if fast else torch.empty(shape, dtype=dtype, device=device)
                pieces = whole.split_with_sizes(sizes)
                env += [pieces[i] for i in keep]
        makers = self._makers.get(fast)
        if makers is None:
            makers = self._makers[fast] = self._single_makers(device, fast)
        for make in makers:
            env.append(make())
        for launcher, args in self._launches:
            launcher(args(env), n)
        return self._results(env)

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return self.run(*inputs)
