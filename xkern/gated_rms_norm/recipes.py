"""Gated RMSNorm's contract, shared by both front ends: the argument rules, then the launch recipes."""

from __future__ import annotations

import functools

from xkern.gated_rms_norm.plans import ACTIVATIONS, plan_gated_rms_norm_bwd, plan_gated_rms_norm_fwd
from xkern.launch import FLOATS, Buffer, Recipe, Step, check_int, promote
from xkern.rms_norm.recipes import check_rms_norm

ROUNDINGS = ("llama", "fp32")

# The four families of Hugging Face's gated norms, as (norm_before_gate, activation, rounding); FalconH1 is
# "norm-fp32-then-gate" or, with norm_before_gate=False, "gate-then-fp32-group-norm", with groups.
FAMILIES = {
    "norm-llama-then-gate": (True, "silu", "llama"),       # Qwen3-Next, Qwen3.5, OLMo hybrid
    "norm-fp32-then-gate": (True, "silu", "fp32"),         # Kimi Linear (sigmoid), GLM-5 Next, Bailing hybrid
    "gate-then-group-norm": (False, "silu", "llama"),      # Mamba2, Bamba, Nemotron-H, Granite 4, Zamba2
    "gate-then-fp32-group-norm": (False, "silu", "fp32"),  # FalconH1 with norm_before_gate=False
}


def out_dtype_name(x_dtype: str, w_dtype: str, norm_before_gate: bool, rounding: str) -> str:
    """y's dtype: x's, but promote(x, w) with the gate first and Llama's rounding (Mamba2 returns
    `w * normed.to(x.dtype)` unconverted)."""
    return promote(x_dtype, w_dtype) if not norm_before_gate and rounding == "llama" else x_dtype


def check_gated_rms_norm(x_dtype: str, x_shape: tuple[int, ...], z_dtype: str, z_shape: tuple[int, ...],
                         w_dtype: str, w_shape: tuple[int, ...], eps, group_size=None, norm_before_gate=True,
                         activation="silu", rounding="llama") -> tuple[str, int]:
    """Validate a `gated_rms_norm(x, gate, weight, eps, group_size=, norm_before_gate=, activation=,
    rounding=)` call from dtype names and shapes; returns y's dtype and the group size (None: the width).
    TypeError for a dtype or an argument's type, ValueError for a shape or value, naming the argument."""
    check_rms_norm(x_dtype, x_shape, w_dtype, w_shape, eps)
    if z_dtype not in FLOATS:
        raise TypeError(f"gate must be float16, bfloat16 or float32, got {z_dtype}")
    if z_dtype != x_dtype:
        raise TypeError(f"gate must have x's dtype {x_dtype}, got {z_dtype}")
    if tuple(z_shape) != tuple(x_shape):
        raise ValueError(f"gate must have x's shape {list(x_shape)}, got {list(z_shape)}")
    n_cols = x_shape[-1]
    if group_size is None:
        group_size = n_cols
    group_size = check_int("group_size", group_size, 1 if n_cols else 0)
    if group_size == 0 and n_cols or group_size and n_cols % group_size:
        raise ValueError(f"group_size must divide x's last dim {n_cols}, got {group_size}")
    if not isinstance(norm_before_gate, bool):
        raise TypeError(f"norm_before_gate must be a bool, got {type(norm_before_gate).__name__}")
    for name, value, allowed in (("activation", activation, ACTIVATIONS), ("rounding", rounding, ROUNDINGS)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, one of {list(allowed)}, got {type(value).__name__}")
        if value not in allowed:
            raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return out_dtype_name(x_dtype, w_dtype, norm_before_gate, rounding), group_size


@functools.lru_cache(maxsize=4096, typed=True)
def gated_rms_norm_fwd_recipe(n_rows: int, n_cols: int, group_size: int, eps: float, x_dtype: str, w_dtype: str,
                              x_row_stride: int | None = None, z_row_stride: int | None = None,
                              norm_before_gate: bool = True, activation: str = "silu",
                              rounding: str = "llama") -> Recipe:
    """Inputs x and z [n_rows, n_cols] (rows `*_row_stride` apart, default contiguous) and w [n_cols]
    (contiguous); result y [n_rows, n_cols] contiguous (out_dtype_name)."""
    y = Buffer("y", (n_rows, n_cols), out_dtype_name(x_dtype, w_dtype, norm_before_gate, rounding))
    if n_rows * n_cols == 0:
        return Recipe((Step(None, (), (y,)),), ("y",))
    x_row_stride = n_cols if x_row_stride is None else x_row_stride
    z_row_stride = n_cols if z_row_stride is None else z_row_stride
    plan = plan_gated_rms_norm_fwd(n_rows, n_cols, group_size, eps, (x_row_stride, z_row_stride, n_cols),
                                   norm_before_gate, activation, rounding)
    scalars = dict(n_rows=n_rows, group_size=group_size, x_row_stride=x_row_stride, z_row_stride=z_row_stride,
                   y_row_stride=n_cols)
    return Recipe((Step(plan, ("x", "z", "w"), (y,), scalars),), ("y",))


@functools.lru_cache(maxsize=4096, typed=True)
def gated_rms_norm_bwd_recipe(n_rows: int, n_cols: int, group_size: int, eps: float, x_dtype: str, w_dtype: str,
                              x_row_stride: int | None = None, z_row_stride: int | None = None,
                              dy_row_stride: int | None = None, norm_before_gate: bool = True,
                              activation: str = "silu", rounding: str = "llama",
                              dw_dtype: str | None = None) -> Recipe:
    """Inputs x, z and dy [n_rows, n_cols] (dy in y's dtype; rows `*_row_stride` apart, default contiguous)
    and w [n_cols]; results dx and dz [n_rows, n_cols] (x's dtype, contiguous) and dw [1, n_cols] in
    `dw_dtype` (default w's; float32 where shards' dw are summed before one rounding)."""
    dw_dtype = dw_dtype or w_dtype
    dx = Buffer("dx", (n_rows, n_cols), x_dtype)
    dz = Buffer("dz", (n_rows, n_cols), x_dtype)
    if n_rows * n_cols == 0:
        return Recipe((Step(None, (), (dx, dz, Buffer("dw", (1, n_cols), dw_dtype, fill=0))),), ("dx", "dz", "dw"))
    x_row_stride = n_cols if x_row_stride is None else x_row_stride
    z_row_stride = n_cols if z_row_stride is None else z_row_stride
    dy_row_stride = n_cols if dy_row_stride is None else dy_row_stride
    plan = plan_gated_rms_norm_bwd(n_rows, n_cols, group_size, eps, (x_row_stride, z_row_stride, dy_row_stride,
                                                                    n_cols), norm_before_gate, activation, rounding)
    scalars = dict(n_rows=n_rows, group_size=group_size, x_row_stride=x_row_stride, z_row_stride=z_row_stride,
                   dy_row_stride=dy_row_stride, dx_row_stride=n_cols)
    inputs = ("x", "z", "w", "dy")
    steps = []
    if plan.stats is not None:
        steps.append(Step(plan.stats, inputs, (Buffer("stats", (n_rows * (n_cols // group_size), 2), "float32"),),
                          scalars))
        inputs = inputs + ("stats",)
    partial = Buffer("partial", (plan.n_partials, n_cols), "float32")
    steps.append(Step(plan.bwd, inputs, (dx, dz, partial), scalars))
    steps.append(Step(plan.reduce, ("partial",), (Buffer("dw", (1, n_cols), dw_dtype),),
                      dict(n_partials=plan.n_partials, n_cols=n_cols)))
    return Recipe(tuple(steps), ("dx", "dz", "dw"))
