"""Registers and spills of the RMSNorm plans at the benchmark shapes, for sm_90, from this CPU machine.

    python -m tools.registers [--sweep | --candidates]      (without TRITON_INTERPRET)

Compiles each plan's kernel as the launchers do (`xkern.compile_check.source`: 16-byte aligned pointers)
and runs Triton's bundled `ptxas -v` on the PTX: a kernel that spills, or whose registers cap the warps
per SM, is bound by the register file. `--sweep`: every width of the benchmark's width sweep (rows filling
its 2^26 elements), as a markdown table with the occupancy the registers allow, the waves of programs and
the bytes of x (and dy) the resident programs hold in flight per SM (one tile each; what the backward's
fraction of the copy ceiling depends on, with the lanes in use: docs/benchmarks.md, entry 15).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile

import triton

from benchmarks.rms_norm import SHAPES, SWEEP_ELEMS, SWEEP_WIDTHS
from xkern.compile_check import TARGET, sass, source
from xkern.device import properties
from xkern.rms_norm import plans as K

NUM_SMS = properties().num_sms  # this GPU's (the plans' own grids read it there too)

PTRS = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "DY": "*bf16", "DX": "*bf16", "DW_PARTIAL": "*fp32",
        "DW": "*bf16", "STATS": "*fp32"}


def compile_sm90(launch):
    return triton.compile(source(launch, PTRS), target=TARGET, options={"num_warps": launch.num_warps})


def ptxas_info(compiled) -> str:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        err = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    return "; ".join(line.split(":", 1)[-1].strip() for line in err.splitlines()
                     if "registers" in line or "spill" in line)


def sass_loop(compiled) -> int:
    """SASS instructions in the kernel's longest loop (the span of its longest backward branch: the
    persistent kernels' row or tile loop)."""
    spans = [int(at, 16) - int(to, 16) for at, to in
             re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`?\(?)0x([0-9a-f]+)", sass(compiled))]
    return max([0] + spans) // 16 + 1  # 16 bytes per sm_90 instruction


# sm_90: registers and warps per SM, programs (CTAs) per SM, register allocation granularity per warp
SM_REGS, SM_WARPS, SM_CTAS, REG_UNIT = 65536, 64, 32, 256


def occupancy(regs: int, num_warps: int) -> int:
    """Programs per SM the register file, the warp slots and the CTA slots allow (no shared memory limit:
    these kernels use little)."""
    per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    return max(0, min(SM_REGS // (per_warp * num_warps), SM_WARPS // num_warps, SM_CTAS))


def resources(compiled, launch, n_cols: int, tensors: int) -> dict:
    """Registers, spill bytes, programs per SM (`per_sm`: what fits; `resident`: what the grid puts there) and
    the KB of input in flight per SM: Little's law, one tile of `tensors` bf16 inputs per resident program
    (x; x and dy); the H200 needs ~33 KB per SM (4.3 TB/s × ~1 µs over 132 SMs) to run at its copy ceiling."""
    info = ptxas_info(compiled)
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = re.search(r"(\d+) bytes spill stores", info)
    per_sm = occupancy(regs, launch.num_warps)
    resident = min(per_sm, -(-math.prod(launch.grid) // NUM_SMS))  # a persistent grid may launch fewer
    c = launch.constexprs
    elems = c.get("BLOCK_M", 1) * min(n_cols, c["BLOCK_N"] * c.get("SPLIT", 1))  # column splits hold a chunk
    return {"regs": regs, "spill": int(spill.group(1)) if spill else 0, "per_sm": per_sm, "resident": resident,
            "elems": elems, "in_flight_kb": resident * elems * 2 * tensors / 1024}


def _row(name: str, launch, n_cols: int) -> list[str]:
    r = resources(compile_sm90(launch), launch, n_cols, 2 if name == "bwd" else 1)
    grid = math.prod(launch.grid)
    rows = launch.constexprs.get("BLOCK_M", 1)
    split = launch.constexprs.get("SPLIT", 1)
    tile = f"{rows}×{launch.constexprs['BLOCK_N']}" + (f"×{split}" if split > 1 else "")
    return [name, launch.kernel.fn.__name__.removeprefix("_rms_norm_").removesuffix("_kernel"), tile,
            str(launch.num_warps), str(r["regs"]), str(r["spill"]), str(r["per_sm"]),
            str(r["per_sm"] * launch.num_warps), f"{grid / max(1, r['per_sm'] * NUM_SMS):.1f}",
            f"{r['in_flight_kb']:.0f}"]


def sweep():
    print("| width | pass | kernel | tile | warps | registers | spill bytes | programs/SM | warps/SM | waves | "
          "KB in flight/SM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in SWEEP_WIDTHS:
        m = SWEEP_ELEMS // n
        for name, launch in (("fwd", K.plan_rms_norm_fwd(m, n, 1e-6)), ("bwd", K.plan_rms_norm_bwd(m, n, 1e-6).bwd)):
            print(f"| {n} | " + " | ".join(_row(name, launch, n)) + " |", flush=True)


def candidates():
    """`plan_probe --set bwd-row`'s candidates against the plan, before GPU time decides them: registers,
    programs per SM (resident; the candidate asks for `ask`), the bytes of x and dy in flight per SM when
    every resident program reads its row (or tile) at once, and SASS per element (the loop's instructions
    times threads over the elements one pass of it takes)."""
    from tools.plan_probe import _BWD_ROW_CANDIDATES, bwd_row

    print("| width | candidate | warps | registers | spill bytes | programs/SM (ask) | KB in flight/SM | "
          "SASS per element |")
    print("|---|---|---|---|---|---|---|---|")
    for n, cands in _BWD_ROW_CANDIDATES:
        m = SWEEP_ELEMS // n
        for name, launch in [("plan", K.plan_rms_norm_bwd(m, n, 1e-6).bwd)] + [
                (f"row {b}×{k} {'w held' if h else 'w re-read'}", bwd_row(b, k, nw, ps, h)(m, n, 1e-6).bwd)
                for b, k, nw, ps, h in cands]:
            compiled = compile_sm90(launch)
            r = resources(compiled, launch, n, 2)
            ask = -(-math.prod(launch.grid) // NUM_SMS)
            per_element = sass_loop(compiled) * 32 * launch.num_warps / r["elems"]
            print(f"| {n} | {name} | {launch.num_warps} | {r['regs']} | {r['spill']} | {r['resident']} ({ask}) "
                  f"| {r['in_flight_kb']:.0f} | {per_element:.1f} |", flush=True)


def main():
    if "--sweep" in sys.argv:
        sweep()
        return
    if "--candidates" in sys.argv:
        candidates()
        return
    for m, n in SHAPES:
        bwd = K.plan_rms_norm_bwd(m, n, 1e-6)
        for name, launch in (("fwd", K.plan_rms_norm_fwd(m, n, 1e-6)), ("bwd", bwd.bwd)):
            tile = f"{launch.constexprs.get('BLOCK_M', 1)}x{launch.constexprs['BLOCK_N']}"
            print(f"{name} {m}x{n}: {launch.kernel.fn.__name__} {tile} w{launch.num_warps} | "
                  f"{ptxas_info(compile_sm90(launch))}")


if __name__ == "__main__":
    main()
