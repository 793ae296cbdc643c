"""Registers and spills of the RMSNorm plans at the benchmark shapes, for sm_90, from this CPU machine.

    python -m benchmarks.registers      (without TRITON_INTERPRET)

Compiles each plan's kernel as the launchers do (`xkern.compile_check.source`: 16-byte aligned pointers)
and runs Triton's bundled `ptxas -v` on the PTX: a kernel that spills, or whose registers cap the warps
per SM, is bound by the register file.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import triton

from benchmarks.rms_norm import SHAPES
from xkern import rms_norm as K
from xkern.compile_check import TARGET, source

PTRS = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "DY": "*bf16", "DX": "*bf16", "DW_PARTIAL": "*fp32",
        "DW": "*bf16", "STATS": "*fp32"}


def ptxas_info(launch) -> str:
    compiled = triton.compile(source(launch, PTRS), target=TARGET,
                              options={"num_warps": launch.num_warps})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        err = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    return "; ".join(line.split(":", 1)[-1].strip() for line in err.splitlines()
                     if "registers" in line or "spill" in line)


def main():
    for m, n in SHAPES:
        bwd = K.plan_rms_norm_bwd(m, n, 1e-6)
        for name, launch in (("fwd", K.plan_rms_norm_fwd(m, n, 1e-6)), ("bwd", bwd.bwd)):
            tile = f"{launch.constexprs.get('BLOCK_M', 1)}x{launch.constexprs['BLOCK_N']}"
            print(f"{name} {m}x{n}: {launch.kernel.fn.__name__} {tile} w{launch.num_warps} | {ptxas_info(launch)}")


if __name__ == "__main__":
    main()
