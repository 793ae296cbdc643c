"""Grouped GEMM over MoE's padded expert-major layout in PyTorch: `grouped_mm` and the `xkern::grouped_mm*` ops.

Three forms, each a registered op (torch.compile, export, fake tensors) and an eager executor path
(`torch_api._launch.cached`, checked on a miss): the forward y = x @ w[e] per expert block, the x gradient
(the forward's rows kernel on dy with w read transposed, no copy) and the w gradient. Each form's derivatives
are the forms themselves (all three are bilinear), so gradients of any order and forward-mode AD are these
ops. Contract and kernels: see `xkern/grouped_mm/`.
"""

from __future__ import annotations

import torch

from torch_api._launch import (
    Executor,
    cached,
    check_device,
    check_tensor,
    direct_or_batched,
    dtype_name,
    forward_mode,
    functorch_active,
    loop_vmap,
    raw_apply,
    register_op,
    run_recipe,
    signature,
    traced,
)
from xkern.grouped_mm import (
    check_grouped_mm,
    check_grouped_mm_dw,
    check_grouped_mm_dx,
    check_offsets,
    grouped_mm_dw_recipe,
    grouped_mm_dx_recipe,
    grouped_mm_recipe,
    variant,
    weight_layout,
)

FWD, DX, DW = "grouped_mm", "grouped_mm_dx", "grouped_mm_dw"
NAMES = {FWD: ("x", "w", "m_offsets"), DX: ("dy", "w", "m_offsets"), DW: ("x", "dy", "m_offsets")}
CHECKS = {FWD: check_grouped_mm, DX: check_grouped_mm_dx, DW: check_grouped_mm_dw}
INPUTS = {FWD: ("x", "w", "offs"), DX: ("dy", "w", "offs"), DW: ("x", "dy", "offs")}  # the recipes' names


def _rows(t: torch.Tensor) -> torch.Tensor:
    # Rows need a contiguous last dim; any row stride is fine.
    return t.contiguous() if t.stride(1) != 1 and t.shape[1] > 1 else t


def _weight(w: torch.Tensor) -> torch.Tensor:
    # One of the matrix dims contiguous (w, or w.transpose(1, 2) of a contiguous one), else a contiguous copy.
    return w if weight_layout(w.shape[1], w.shape[2], tuple(w.stride())) is not None else w.contiguous()


def _prepare(form: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands as the kernels read them: rows with a contiguous last dim, weights with a contiguous matrix
    dim (copies only where not)."""
    return _rows(a), (_rows(b) if form == DW else _weight(b))


def _recipe(form: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor):
    """The core's recipe of `form` on prepared operands (int(): a compiled graph specializes on the shapes)."""
    n_experts, dtype = int(offs.shape[0]), dtype_name(a.dtype)
    if form == DW:
        return grouped_mm_dw_recipe(int(a.shape[0]), int(a.shape[1]), int(b.shape[1]), n_experts, dtype,
                                    int(a.stride(0)), int(b.stride(0)))
    strides = tuple(int(s) for s in b.stride())
    make = grouped_mm_recipe if form == FWD else grouped_mm_dx_recipe
    return make(int(a.shape[0]), int(b.shape[1]), int(b.shape[2]), n_experts, dtype, int(a.stride(0)), strides)


def _check(form: str, a, b, offs) -> None:
    names = NAMES[form]
    for name, t in zip(names, (a, b, offs), strict=True):
        check_tensor(name, t)
    CHECKS[form](dtype_name(a.dtype), tuple(a.shape), dtype_name(b.dtype), tuple(b.shape), dtype_name(offs.dtype),
                 tuple(offs.shape))
    check_device(names[0], a)
    check_device(names[1], b, like=a)
    check_device(names[2], offs, like=a)


def _run(form: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    a, b = _prepare(form, a, b)
    (out,) = run_recipe(_recipe(form, a, b, offs), a.device, **dict(zip(INPUTS[form], (a, b, offs.contiguous()))))
    return out


# ---------------------------------------------------------------------------------------------------
# Registered ops: torch.compile, export, fake tensors.


@register_op("xkern::grouped_mm", lambda x, w, m_offsets: x.new_empty((x.shape[0], w.shape[2])))
def _fwd_op(x: torch.Tensor, w: torch.Tensor, m_offsets: torch.Tensor) -> torch.Tensor:
    return _run(FWD, x, w, m_offsets)


@register_op("xkern::grouped_mm_dx", lambda dy, w, m_offsets: dy.new_empty((dy.shape[0], w.shape[1])))
def _dx_op(dy: torch.Tensor, w: torch.Tensor, m_offsets: torch.Tensor) -> torch.Tensor:
    return _run(DX, dy, w, m_offsets)


@register_op("xkern::grouped_mm_dw",
             lambda x, dy, m_offsets: x.new_empty((m_offsets.shape[0], x.shape[1], dy.shape[1])))
def _dw_op(x: torch.Tensor, dy: torch.Tensor, m_offsets: torch.Tensor) -> torch.Tensor:
    return _run(DW, x, dy, m_offsets)


OPS = {FWD: _fwd_op, DX: _dx_op, DW: _dw_op}


# ---------------------------------------------------------------------------------------------------
# Autograd, one set of rules for the registered ops and the eager Functions: every form is bilinear in its two
# operands, and its derivatives are the forms again.
#   y = x w_e:         dx = DX(g, w),   dw = DW(x, g)
#   dx = dy w_e^T:     d dy = FWD(g, w), dw = DW(g, dy)
#   dw_e = x_e^T dy_e: dx = DX(dy, g),  d dy = FWD(x, g)


def _save(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)
    if forward_mode():
        ctx.save_for_forward(*inputs)


# (form, operand, operand) of the gradients of <g, form(a, b)> with respect to a and to b
GRADS = {FWD: ((DX, "g", "b"), (DW, "a", "g")), DX: ((FWD, "g", "b"), (DW, "g", "a")),
         DW: ((DX, "b", "g"), (FWD, "a", "g"))}


def _backward(form: str):
    def backward(ctx, g):
        a, b, offs = ctx.saved_tensors
        env = {"a": a, "b": b, "g": g}
        return (*(_call(grad, env[p], env[q], offs) if need else None
                  for need, (grad, p, q) in zip(ctx.needs_input_grad[:2], GRADS[form], strict=True)), None)
    return backward


def _jvp(form: str):
    def jvp(ctx, ta, tb, _):
        # bilinear: d form(a, b) = form(ta, b) + form(a, tb)
        a, b, offs = ctx.saved_tensors
        parts = [] if ta is None else [_call(form, ta, b, offs)]
        if tb is not None:
            parts.append(_call(form, a, tb, offs))
        return sum(parts[1:], parts[0])
    return jvp


for _form, _op in OPS.items():
    _op.register_autograd(_backward(_form), setup_context=_save)


# ---------------------------------------------------------------------------------------------------
# Eager: executors cached per call signature (`torch_api._launch.cached`: checked once, on a miss).


def _executor(form: str, a, b, offs) -> Executor:
    _check(form, a, b, offs)
    pa, pb = _prepare(form, a, b)
    ex = Executor(_recipe(form, pa, pb, offs), INPUTS[form])
    ex.in_place = pa is a and pb is b and offs.is_contiguous()
    return ex


def _eager(form: str, a, b, offs) -> torch.Tensor:
    ex = cached((form, variant(), signature(a), signature(b), signature(offs)), _executor, form, a, b, offs)
    if ex.in_place:
        return ex.run(a, b, offs)[0]
    return ex.run(*_prepare(form, a, b), offs.contiguous())[0]


def _function(form: str) -> type[torch.autograd.Function]:
    class Function(torch.autograd.Function):
        @staticmethod
        def forward(a, b, offs):
            return _eager(form, a, b, offs)

        setup_context = staticmethod(_save)
        backward = staticmethod(_backward(form))
        jvp = staticmethod(_jvp(form))

        @staticmethod
        def vmap(info, in_dims, a, b, offs):
            return loop_vmap(Function.apply, info, in_dims, a, b, offs)

    Function.__name__ = Function.__qualname__ = f"_{form}"
    return Function


FUNCTIONS = {form: _function(form) for form in OPS}
# The C++ apply without the Python wrapper (`raw_apply`), where no functorch transform is active.
_APPLY = {form: raw_apply(f) for form, f in FUNCTIONS.items()}


def _call(form: str, a, b, offs) -> torch.Tensor:
    """Eager calls take the executors, through the Functions where autograd is needed (forward mode too);
    compiled and traced code, the ops (checked on every call: tracing is not the hot path)."""
    if direct_or_batched(a, b, offs):
        return _eager(form, a, b, offs)
    if traced(a, b, offs):
        _check(form, a, b, offs)
        return OPS[form](a, b, offs)
    return (FUNCTIONS[form].apply if functorch_active() else _APPLY[form])(a, b, offs)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, m_offsets: torch.Tensor, validate: bool = False) -> torch.Tensor:
    """The experts' GEMMs over the padded expert-major layout: y [S, N] in x's dtype, `y[r] = x[r] @ w[e]` for
    the rows of expert e (slots m_offsets[e-1] to m_offsets[e], from 0 for e = 0), zero rows from
    m_offsets[-1] on. FP32 accumulation, rounded once; fp32 inputs multiply in IEEE FP32 (no TF32).

    x: [S, K] float16/bfloat16/float32 (any row stride, last dim contiguous; else copied). w: [E, K, N] of x's
    dtype, contiguous or a transpose of the last two dims of a contiguous tensor (read in place; other strides
    are copied). m_offsets: [E] int32, the cumulative ends of the experts' blocks (torch._grouped_mm's `offs`),
    non-decreasing and at most S: `validate=True` checks that (one host sync); unchecked offsets are clamped to
    [0, S], never read or written out of bounds. Differentiable in x and w: dx[r] = dy[r] @ w[e].T (zero rows
    past the last offset), dw[e] = x_e.T @ dy_e (zeros for an expert without rows), each summed in FP32 by one
    program (no atomics: the same bits run to run)."""
    if validate:
        _check(FWD, x, w, m_offsets)
        check_offsets(m_offsets.detach().cpu().numpy(), x.shape[0])
    return _call(FWD, x, w, m_offsets)


def grouped_mm_dx(dy: torch.Tensor, w: torch.Tensor, m_offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_mm`'s x gradient on its own (the kernel its backward runs): dx [S, K], dx[r] = dy[r] @ w[e].T
    for the rows of expert e, zero rows past m_offsets[-1]. dy [S, N]; w and m_offsets as `grouped_mm`'s."""
    return _call(DX, dy, w, m_offsets)


def grouped_mm_dw(x: torch.Tensor, dy: torch.Tensor, m_offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_mm`'s weight gradient on its own (the kernel its backward runs): dw [E, K, N] contiguous,
    dw[e] = x_e.T @ dy_e, zeros for an expert without rows. x [S, K], dy [S, N] of x's dtype."""
    return _call(DW, x, dy, m_offsets)
