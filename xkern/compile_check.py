"""Compile every kernel variant the launch plans can choose, for each GPU architecture, on a machine without a GPU.

Run in a process *without* TRITON_INTERPRET (the interpreter and the compiler cannot share a process):
    python -m xkern.compile_check [--sass] [--arch 90 | 80,86 | all] [--sample]
GPU-backend errors (layouts, register pressure, unsupported ops) then surface on CPU, in CI. Each variant is
planned for its architecture (`xkern.device.ARCHITECTURES`: the plans read its shared memory and SM count) and
held to its limits: the shared memory a block may opt into, at most 255 registers a thread and 64K a block.
`--arch` defaults to 90 (sm_90, the H100 and H200); `--sample` compiles `sample()`'s few variants per kernel.
`--sass` prints a hash of each variant's SASS instructions (cuobjdump, addresses dropped): a refactor whose hashes
match those of a GPU-validated commit leaves every binary the plans launch as it was validated.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import math
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from xkern import device

OPS = ["xkern.rms_norm", "xkern.add_rms_norm", "xkern.permute", "xkern.grouped_mm", "xkern.gated_rms_norm"]
TARGET = GPUTarget("cuda", 90, 32)
MAX_REGS_PER_THREAD = 255
MAX_REGS_PER_BLOCK = 64 * 1024


def source(launch, pointer_types: dict) -> ASTSource:
    """What both front ends compile for `launch`: its signature, constexprs, and every pointer marked
    16-byte aligned (as both launchers mark fresh buffers; without it loads are 2-byte, not 16-byte)."""
    sig, consts = signature(launch, pointer_types)
    attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(sig.values()) if ty.startswith("*")}
    return ASTSource(launch.kernel, sig, consts, attrs)


def signature(launch, pointer_types: dict) -> tuple[dict, dict]:
    """Triton signature for `launch.kernel`: pointers from `pointer_types`, `eps` fp32, other scalars i32."""
    sig, consts = {}, {}
    for name in inspect.signature(launch.kernel.fn).parameters:
        if name in launch.constexprs:
            sig[name], consts[name] = "constexpr", launch.constexprs[name]
        elif name in pointer_types:
            sig[name] = pointer_types[name]
        else:
            sig[name] = "fp32" if name == "eps" else "i32"
    return sig, consts


def sass(compiled, *flags: str) -> str:
    """cuobjdump's SASS listing of a compiled kernel's cubin (the cuobjdump bundled with Triton); `flags` add
    to `-sass` (`-res-usage`: the registers and memory the binary declares)."""
    return cuobjdump(compiled, "-sass", *flags)


def cuobjdump(compiled, *flags: str) -> str:
    """The cuobjdump bundled with Triton, run with `flags` on a compiled kernel's cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True, check=True).stdout


def sass_hash(compiled, listing: str | None = None) -> str:
    """Hash of the kernel's SASS instructions, addresses and encodings dropped."""
    ins = [re.sub(r"/\*[0-9a-fx]+\*/", "", line).strip() for line in (listing or sass(compiled)).splitlines()
           if re.match(r"^\s+/\*[0-9a-f]{4}\*/", line)]
    return hashlib.sha1("\n".join(ins).encode()).hexdigest()[:16]


def limits_exceeded(compiled, listing: str, num_warps: int, props: device.DeviceProperties) -> list[str]:
    """What of the architecture's per-block limits the binary passes: its dynamic shared memory (Triton's
    metadata) against `props.max_shared_mem`, and its registers (`REG:` of cuobjdump's resource usage, the
    binary's own record) against 255 a thread and 64K a block."""
    regs = int(re.search(r"REG:(\d+)", listing).group(1))
    shared = compiled.metadata.shared + int(re.search(r"SHARED:(\d+)", listing).group(1))  # dynamic + static
    bad = []
    if shared > props.max_shared_mem:
        bad.append(f"{shared} B of shared memory > {props.max_shared_mem}")
    if regs > MAX_REGS_PER_THREAD or regs * num_warps * 32 > MAX_REGS_PER_BLOCK:
        bad.append(f"{regs} registers x {num_warps * 32} threads > {MAX_REGS_PER_BLOCK} (or > 255 a thread)")
    return bad


def build(launch, pointer_types: dict, props: device.DeviceProperties, print_sass: bool = False) -> str | None:
    """Compile one variant for `props`' architecture, hold it to its limits; its SASS hash with `print_sass`
    (the disassembly is most of a check's time)."""
    compiled = triton.compile(source(launch, pointer_types), target=GPUTarget("cuda", props.arch, 32),
                              options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    assert "ptx" in compiled.asm and "cubin" in compiled.asm
    listing = sass(compiled, "-res-usage") if print_sass else cuobjdump(compiled, "-res-usage")
    bad = limits_exceeded(compiled, listing, launch.num_warps, props)
    if bad:
        raise RuntimeError(f"over sm_{props.arch}'s limits: {'; '.join(bad)}")
    return sass_hash(compiled, listing) if print_sass else None


def variants(props: device.DeviceProperties) -> dict:
    """Every (launch, pointer types) the ops' plans choose on `props`, once each, keyed by kernel, signature,
    constexprs, warps and stages (the grid does not change a binary)."""
    found = {}
    with device.target(props):
        for module_name in OPS:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError:
                continue
            for launch, pointer_types in module.compile_variants():
                sig, consts = signature(launch, pointer_types)
                key = (launch.kernel.fn.__name__, tuple(sorted(sig.items())), tuple(sorted(consts.items())),
                       launch.num_warps, launch.num_stages)
                found.setdefault(key, (launch, pointer_types))
    return found


def sample(found: dict) -> dict:
    """A few variants per kernel, those that press hardest on the limits: the largest tile at each pipeline
    depth, the most tile elements a thread, and the most warps (tiles: the product of the BLOCK_* and SPLIT
    constexprs)."""
    def tile(key):
        return math.prod(v for k, v in key[2] if k.startswith("BLOCK_") or k == "SPLIT")

    picks = {}
    for key in found:
        picks.setdefault(key[0], []).append(key)
    chosen = set()
    for keys in picks.values():
        for stages in {k[4] for k in keys}:
            chosen.add(max((k for k in keys if k[4] == stages), key=tile))
        chosen.add(max(keys, key=lambda k: tile(k) / k[3]))
        chosen.add(max(keys, key=lambda k: (k[3], tile(k))))
    return {k: v for k, v in found.items() if k in chosen}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sass", action="store_true", help="print each variant's SASS hash")
    parser.add_argument("--arch", default="90", help="compute capabilities, comma-separated, or 'all'")
    parser.add_argument("--sample", action="store_true", help="a few variants per kernel (`sample`)")
    args = parser.parse_args(argv)
    archs = sorted(device.ARCHITECTURES) if args.arch == "all" else [int(a) for a in args.arch.split(",")]
    planned = {}
    for arch in archs:
        found = variants(device.ARCHITECTURES[arch])
        planned[arch] = sample(found) if args.sample else found
    # One thread per core: Triton's compiler (and cuobjdump, a subprocess) run without the GIL, so the
    # variants compile side by side; the report keeps the variants' order.
    failures = {arch: 0 for arch in archs}
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        builds = {(arch, key): pool.submit(build, *variant, device.ARCHITECTURES[arch], args.sass)
                  for arch in archs for key, variant in planned[arch].items()}
        for (arch, key), result in builds.items():
            try:
                digest = result.result()
                if args.sass:
                    print(digest, key if arch == 90 else (f"sm_{arch}", *key))
            except Exception as e:  # report every failing variant, not just the first
                failures[arch] += 1
                print(f"FAILED sm_{arch} {key}: {type(e).__name__}: {e}", file=sys.stderr)
    for arch in archs:
        print(f"sm_{arch} compile check: {len(planned[arch]) - failures[arch]} passed, {failures[arch]} failed")
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
