"""Launching an xkern plan from PyTorch, and the input checks every torch op shares."""

from __future__ import annotations

import contextlib
import os

import torch

from xkern.launch import INTERPRETER_LOCK, Launch, bind, patch_interpreter

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    patch_interpreter()


def launch(plan: Launch, *arrays, **scalars) -> None:
    """Launch `plan` on `arrays` (its inputs, then its outputs) and the runtime `scalars`."""
    with INTERPRETER_LOCK if INTERPRET else contextlib.nullcontext():
        plan.kernel[plan.grid](**bind(plan, arrays, scalars), num_warps=plan.num_warps, num_stages=plan.num_stages)


def check_device(name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
    if like is not None and t.device != like.device:
        raise ValueError(f"{name} must be on {like.device} like the other inputs, got {t.device}")
    if t.device.type != "cuda" and not (INTERPRET and t.device.type == "cpu"):
        raise ValueError(f"{name} must be a CUDA tensor (CPU tensors run only with TRITON_INTERPRET=1), "
                         f"got {t.device}")


def rows_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, last]: a view when the last dim is contiguous and the leading dims collapse to one
    row stride (head-major views, slices of a fused tensor), otherwise a contiguous copy."""
    width = t.shape[-1] if t.dim() else 1
    if t.dim() >= 1 and (t.stride(-1) == 1 or width == 1):
        try:
            return t.view(-1, width)
        except RuntimeError:
            pass
    return t.reshape(-1, width).contiguous()
