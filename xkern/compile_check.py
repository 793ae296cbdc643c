"""Compile every kernel variant the launch plans can choose for sm_90, on a machine without a GPU.

Run in a process *without* TRITON_INTERPRET (the interpreter and the compiler cannot share a process):
    python -m xkern.compile_check [--sass]
GPU-backend errors (layouts, register pressure, unsupported ops) then surface on CPU, in CI. `--sass`
prints a hash of each variant's SASS instructions (cuobjdump, addresses dropped): a refactor whose hashes
match those of a GPU-validated commit leaves every binary the plans launch as it was validated.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

OPS = ["xkern.rms_norm", "xkern.add_rms_norm", "xkern.permute", "xkern.grouped_mm", "xkern.gated_rms_norm"]
TARGET = GPUTarget("cuda", 90, 32)


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


def sass(compiled) -> str:
    """cuobjdump's SASS listing of a compiled kernel's cubin (the cuobjdump bundled with Triton)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def sass_hash(compiled) -> str:
    """Hash of the kernel's SASS instructions, addresses and encodings dropped."""
    ins = [re.sub(r"/\*[0-9a-fx]+\*/", "", line).strip() for line in sass(compiled).splitlines()
           if re.match(r"^\s+/\*[0-9a-f]{4}\*/", line)]
    return hashlib.sha1("\n".join(ins).encode()).hexdigest()[:16]


def build(launch, pointer_types: dict, print_sass: bool) -> str | None:
    """Compile one variant for sm_90; its SASS hash with `print_sass`."""
    compiled = triton.compile(source(launch, pointer_types), target=TARGET,
                              options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    assert "ptx" in compiled.asm and "cubin" in compiled.asm
    return sass_hash(compiled) if print_sass else None


def main() -> int:
    variants, failures = {}, 0
    print_sass = "--sass" in sys.argv
    for module_name in OPS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue
        for launch, pointer_types in module.compile_variants():
            sig, consts = signature(launch, pointer_types)
            key = (launch.kernel.fn.__name__, tuple(sorted(sig.items())), tuple(sorted(consts.items())),
                   launch.num_warps, launch.num_stages)
            variants.setdefault(key, (launch, pointer_types))
    # One thread per core: Triton's compiler (and cuobjdump, a subprocess) run without the GIL, so the
    # variants compile side by side; the report keeps the variants' order.
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        builds = {key: pool.submit(build, *variant, print_sass) for key, variant in variants.items()}
        for key, result in builds.items():
            try:
                digest = result.result()
                if print_sass:
                    print(digest, key)
            except Exception as e:  # report every failing variant, not just the first
                failures += 1
                print(f"FAILED {key}: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"sm_90 compile check: {len(variants) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
