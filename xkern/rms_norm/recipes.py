"""RMSNorm's contract, shared by both front ends: the argument rules, then the launch recipes (the plans'
launches with their named inputs, the buffers they allocate and the runtime scalars)."""

from __future__ import annotations

import functools
import math
import numbers

from xkern.launch import FLOATS, ITEMSIZE, Buffer, Launch, Recipe, Step
from xkern.rms_norm.plans import VARIANTS, BwdPlan, plan_rms_norm_bwd, plan_rms_norm_fwd


def check_variant(variant, has_weight: bool) -> str:
    """The kernel variant of a call: `variant` ("llama", "gemma" or "olmo2"), or "none" without a weight
    (every variant then computes `normed.to(x.dtype)`). Raises TypeError/ValueError naming `variant`."""
    if not isinstance(variant, str):
        raise TypeError(f"variant must be a str, one of {sorted(VARIANTS)}, got {type(variant).__name__}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    return variant if has_weight else "none"


def out_dtype_name(x_dtype: str, w_dtype: str | None, variant: str) -> str:
    """Output dtype (a name: "bfloat16", ...) of `variant` from check_variant: x's, except LLAMA with a weight
    of another dtype (float32), where eager promotion makes it float32."""
    return "float32" if variant == "llama" and w_dtype != x_dtype else x_dtype


def check_rms_norm(x_dtype: str, x_shape: tuple[int, ...], w_dtype: str | None, w_shape: tuple[int, ...] | None,
                   eps, variant="llama") -> tuple[str, str]:
    """Validate an `rms_norm(x, weight, eps, variant=)` call from dtype names and shapes (w None: no weight);
    returns the output dtype (`out_dtype_name`) and the kernel variant (`check_variant`)."""
    variant = check_variant(variant, w_dtype is not None)
    if x_dtype not in FLOATS:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x_dtype}")
    if w_dtype is not None and w_dtype not in FLOATS:
        raise TypeError(f"weight must be float16, bfloat16 or float32, got {w_dtype}")
    if len(x_shape) == 0:
        raise ValueError("x must have at least one dimension [..., N], got a scalar")
    if w_shape is not None and tuple(w_shape) != (x_shape[-1],):
        raise ValueError(f"weight must have shape [{x_shape[-1]}] (x's last dim), got {list(w_shape)}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not 0 <= eps < math.inf:
        raise ValueError(f"eps must be >= 0 and finite, got {eps}")
    return out_dtype_name(x_dtype, w_dtype, variant), variant


@functools.lru_cache(maxsize=4096, typed=True)
def rms_norm_fwd_recipe(n_rows: int, n_cols: int, eps: float, x_dtype: str, w_dtype: str | None,
                        x_row_stride: int | None = None, variant: str = "llama") -> Recipe:
    """Inputs x [n_rows, n_cols] (rows `x_row_stride` apart, default contiguous) and w [n_cols]
    (contiguous; w_dtype None: no weight, variant "none", x is bound in its place and never read as w);
    result y [n_rows, n_cols] contiguous."""
    y_dtype = out_dtype_name(x_dtype, w_dtype, variant)
    y = Buffer("y", (n_rows, n_cols), y_dtype)
    if n_rows * n_cols == 0:
        return Recipe((Step(None, (), (y,)),), ("y",))
    x_row_stride = n_cols if x_row_stride is None else x_row_stride
    itemsize = max(ITEMSIZE[d] for d in (x_dtype, w_dtype or x_dtype, y_dtype))
    plan = plan_rms_norm_fwd(n_rows, n_cols, eps, (x_row_stride, n_cols), itemsize, variant)
    scalars = dict(n_rows=n_rows, n_cols=n_cols, x_row_stride=x_row_stride, y_row_stride=n_cols)
    return Recipe((Step(plan, ("x", "x" if w_dtype is None else "w"), (y,), scalars),), ("y",))


@functools.lru_cache(maxsize=4096, typed=True)
def rms_norm_bwd_recipe(n_rows: int, n_cols: int, eps: float, x_dtype: str, w_dtype: str | None,
                        x_row_stride: int | None = None, dy_row_stride: int | None = None,
                        n_batch: int = 1, dw_dtype: str | None = None, variant: str = "llama") -> Recipe:
    """Inputs x and dy [n_batch * n_rows, n_cols] (rows `*_row_stride` apart, default contiguous; dy of the
    forward's output dtype) and w [n_cols] (w_dtype None: no weight, as in the forward); results dx
    [n_batch * n_rows, n_cols] contiguous and dw [n_batch, n_cols] (one per problem: n_batch > 1 only under
    jax.vmap) in `dw_dtype` (default w's; float32 where shards' dw are summed before one rounding). Without
    a weight dw is [n_batch, 0]."""
    dw_dtype = dw_dtype or w_dtype or x_dtype
    dx = Buffer("dx", (n_batch * n_rows, n_cols), x_dtype)
    dw_cols = 0 if w_dtype is None else n_cols
    if n_rows * n_cols == 0:
        return Recipe((Step(None, (), (dx, Buffer("dw", (n_batch, dw_cols), dw_dtype, fill=0))),), ("dx", "dw"))
    x_row_stride = n_cols if x_row_stride is None else x_row_stride
    dy_row_stride = n_cols if dy_row_stride is None else dy_row_stride
    itemsize = max(ITEMSIZE[d] for d in (x_dtype, out_dtype_name(x_dtype, w_dtype, variant)))  # x's and dy's
    plan = plan_rms_norm_bwd(n_rows, n_cols, eps, (x_row_stride, dy_row_stride, n_cols), n_batch, variant,
                             itemsize=itemsize)
    scalars = dict(n_rows=n_rows, n_cols=n_cols, x_row_stride=x_row_stride, dy_row_stride=dy_row_stride,
                   dx_row_stride=n_cols)
    return bwd_recipe(plan, plan.stats, plan.bwd, ("x", "x" if w_dtype is None else "w", "dy"), (), dx, scalars,
                      n_batch, n_rows, n_cols, dw_dtype)


def bwd_recipe(plan: BwdPlan, stats: Launch | None, bwd: Launch, inputs: tuple[str, ...], extra: tuple[str, ...],
               dx: Buffer, scalars: dict, n_batch: int, n_rows: int, n_cols: int, dw_dtype: str) -> Recipe:
    """The backward's steps: [stats on `inputs`,] `bwd` on `inputs + extra` [+ stats], the dw reduction (none
    where `bwd` writes dw itself: `plan.dw_direct`)."""
    steps = []
    if stats is not None:
        steps.append(Step(stats, inputs, (Buffer("stats", (n_batch * n_rows, 2), "float32"),), scalars))
    inputs = inputs + extra + (("stats",) if stats is not None else ())
    if plan.dw_direct:
        steps.append(Step(bwd, inputs, (dx, Buffer("dw", (n_batch, n_cols), dw_dtype)), scalars))
        return Recipe(tuple(steps), ("dx", "dw"))
    if plan.reduce is None:  # no weight: the kernel writes no dw partials
        steps.append(Step(bwd, inputs, (dx, Buffer("partial", (1,), "float32")), scalars))
        steps.append(Step(None, (), (Buffer("dw", (n_batch, 0), dw_dtype),)))
        return Recipe(tuple(steps), ("dx", "dw"))
    partial = Buffer("partial", (n_batch * plan.n_partials, n_cols), "float32")
    steps.append(Step(bwd, inputs, (dx, partial), scalars))
    steps.append(Step(plan.reduce, ("partial",), (Buffer("dw", (n_batch, n_cols), dw_dtype),),
                      dict(n_partials=plan.n_partials, n_cols=n_cols)))
    return Recipe(tuple(steps), ("dx", "dw"))
