"""Run as a script (without TRITON_INTERPRET): torch's access analysis of every kernel variant, as Inductor
runs it for `torch.library.triton_op` bodies on the GPU (`wrap_triton`), with the sm_90 target. A kernel
whose input pointer the analysis counts as written makes torch.compile treat that input as mutated
(functionalization copies; a leaf that requires grad then fails to compile). Prints one line per variant
that writes a non-output pointer, then a summary."""

from __future__ import annotations

import inspect
import sys

import torch
import triton
from torch._higher_order_ops import triton_kernel_wrap
from triton.backends.compiler import GPUTarget

from xkern import add_rms_norm, grouped_mm, permute, rms_norm
from xkern.compile_check import TARGET

DTYPES = {"*bf16": torch.bfloat16, "*fp16": torch.float16, "*fp32": torch.float32, "*i32": torch.int32,
          "*i64": torch.int64}


class _Target:
    """The active driver as far as the analysis asks: the H200's target (no GPU here)."""

    def get_current_target(self) -> GPUTarget:
        return TARGET


def main() -> int:
    triton.runtime.driver.set_active(_Target())
    analyze = getattr(triton_kernel_wrap, "identify_accessed_tensors", None) or \
        triton_kernel_wrap.identify_mutated_tensors
    checked, bad = set(), 0
    for module in (rms_norm, add_rms_norm, permute, grouped_mm):
        for launch, pointer_types in module.compile_variants():
            params = list(inspect.signature(launch.kernel.fn).parameters)
            kwargs, outputs, seen_scalar = {}, [], False
            for name in params:
                if name in launch.constexprs:
                    kwargs[name] = launch.constexprs[name]
                elif pointer_types.get(name, "").startswith("*"):
                    kwargs[name] = torch.empty(16, dtype=DTYPES[pointer_types[name]])
                    if seen_scalar:  # the parameter order of every kernel: inputs, scalars, outputs
                        outputs.append(name)
                else:
                    kwargs[name], seen_scalar = 1, True  # eps stays a constexpr
            key = (launch.kernel.fn.__name__, tuple(sorted(pointer_types.items())),
                   tuple(sorted(launch.constexprs.items())))
            if key in checked:
                continue
            checked.add(key)
            got = analyze(launch.kernel, kwargs, {})
            got = getattr(getattr(got, "read_writes", None), "writes", got)  # torch >= 2.12: accesses
            written = sorted(getattr(dep, "name", dep) for dep in got)
            if not outputs or set(written) - set(outputs):
                bad += 1
                print(f"WRITES INPUTS {key[0]} {dict(launch.constexprs)}: written {written}, outputs {outputs}")
    print(f"triton_op access analysis: {len(checked)} variants, {bad} writing an input")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
