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

import math
import os

import torch
from triton import knobs

from xkern.launch import INTERPRETER_LOCK, Launch, Recipe, bind, patch_interpreter

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    patch_interpreter()

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


def eager(*tensors: torch.Tensor) -> bool:
    """Whether an eager call may launch directly (an `Executor`) rather than through the registered op:
    plain tensors, not being compiled or traced, no dispatch mode active. Under a functorch transform the
    op's autograd.Function takes the call (its forward then sees plain tensors)."""
    return (not torch.compiler.is_compiling()
            and all(type(t) is torch.Tensor or type(t) is torch.nn.Parameter for t in tensors)
            and torch._C._len_torch_dispatch_stack() == 0)


def needs_autograd(*tensors: torch.Tensor) -> bool:
    """Whether an eager call must go through its autograd.Function: a tensor requires grad, forward-mode
    AD is on, or a functorch transform (torch.func.grad/jvp/vmap) is active."""
    return (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
            or torch.autograd.forward_ad._current_level >= 0
            or torch._C._functorch.peek_interpreter_stack() is not None)


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, last]: a view when the last dim is contiguous and the leading dims collapse to one
    row stride (head-major views, slices of a fused tensor), otherwise a contiguous copy."""
    width = t.shape[-1] if t.dim() else 1
    rows = math.prod(t.shape[:-1])
    if t.dim() >= 1 and (t.stride(-1) == 1 or width == 1):
        try:
            return t.view(rows, width)
        except RuntimeError:
            pass
    return t.reshape(rows, width).contiguous()


def _alloc(buffer, device) -> torch.Tensor:
    dtype = DTYPES[buffer.dtype]
    if buffer.fill is None:
        return torch.empty(buffer.shape, dtype=dtype, device=device)
    return torch.full(buffer.shape, buffer.fill, dtype=dtype, device=device)


def run_recipe(recipe: Recipe, device, **inputs: torch.Tensor) -> list[torch.Tensor]:
    """Execute `recipe` on `inputs` (by name) through `wrap_triton`: the registered ops' bodies."""
    env = dict(inputs)
    for step in recipe.steps:
        outs = [_alloc(b, device) for b in step.outputs]
        if step.launch is not None:
            _launch_wrapped(step.launch, [env[n] for n in step.inputs] + outs, step.scalars)
        env.update(zip((b.name for b in step.outputs), outs))
    return [env[n] for n in recipe.results]


def launch(plan: Launch, *arrays: torch.Tensor, **scalars) -> None:
    """Launch one plan on `arrays` (its inputs, then its outputs) and the runtime `scalars`."""
    _launch_wrapped(plan, arrays, scalars)


def _launch_wrapped(plan: Launch, arrays, scalars) -> None:
    kwargs = bind(plan, arrays, scalars)
    if INTERPRET:
        with INTERPRETER_LOCK:
            plan.kernel[plan.grid](**kwargs, num_warps=plan.num_warps, num_stages=plan.num_stages)
    else:
        torch.library.wrap_triton(plan.kernel)[plan.grid](**kwargs, num_warps=plan.num_warps,
                                                          num_stages=plan.num_stages)


class _Launcher:
    """One step's kernel, ready to launch on pointers: the argument list in the kernel's parameter order
    with the scalars and constexprs filled in, and the compiled binaries by (device, pointer alignment)."""

    def __init__(self, plan: Launch, n_arrays: int, scalars: dict):
        names = plan.kernel.arg_names
        self.plan = plan
        self.args = [scalars.get(n, plan.constexprs.get(n)) for n in names]
        self.slots = [i for i, n in enumerate(names) if n not in scalars and n not in plan.constexprs]
        assert len(self.slots) == n_arrays, (plan.kernel.__name__, names)
        self.scalars = scalars
        self.binaries = {}
        grid = tuple(plan.grid) + (1,) * (3 - len(plan.grid))
        self.grid = grid

    def __call__(self, arrays: list[torch.Tensor], device: int) -> None:
        if INTERPRET:
            with INTERPRETER_LOCK:
                self.plan.kernel[self.plan.grid](**bind(self.plan, arrays, self.scalars),
                                                 num_warps=self.plan.num_warps, num_stages=self.plan.num_stages)
            return
        ptrs = [a.data_ptr() for a in arrays]
        # Triton specializes pointers on 16-byte alignment: one binary per alignment pattern.
        key = (device, *(p & 15 == 0 for p in ptrs))
        binary = self.binaries.get(key)
        if binary is None or knobs.runtime.launch_enter_hook is not None or knobs.runtime.launch_exit_hook:
            # First launch (compiles, or finds Triton's cached binary), or a profiler's hooks are set.
            with torch.cuda.device(device):
                self.binaries[key] = self.plan.kernel[self.plan.grid](
                    **bind(self.plan, arrays, self.scalars), num_warps=self.plan.num_warps,
                    num_stages=self.plan.num_stages)
            return
        args = self.args.copy()
        for slot, p in zip(self.slots, ptrs):
            args[slot] = p
        g0, g1, g2 = self.grid
        binary.run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(device), binary.function,
                   binary.packed_metadata, None, None, None, *args)


class Executor:
    """A recipe bound for eager launches: buffers by position, launchers built once. Cache one per call
    signature (shapes, strides, dtypes, scalars) and call it with the input tensors."""

    def __init__(self, recipe: Recipe, input_names: tuple[str, ...]):
        index = {n: i for i, n in enumerate(input_names)}
        self.steps = []
        for step in recipe.steps:
            ins = [index[n] for n in step.inputs]
            for b in step.outputs:
                index[b.name] = len(index)
            launcher = None if step.launch is None else _Launcher(step.launch, len(ins) + len(step.outputs),
                                                                  step.scalars)
            self.steps.append((launcher, ins, [(b.shape, DTYPES[b.dtype], b.fill) for b in step.outputs]))
        self.results = [index[n] for n in recipe.results]

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        device = inputs[0].device
        bufs = list(inputs)
        for launcher, ins, outs in self.steps:
            new = [torch.empty(shape, dtype=dtype, device=device) if fill is None
                   else torch.full(shape, fill, dtype=dtype, device=device) for shape, dtype, fill in outs]
            if launcher is not None:
                launcher([bufs[i] for i in ins] + new, device.index if device.type == "cuda" else -1)
            bufs += new
        return [bufs[i] for i in self.results]
