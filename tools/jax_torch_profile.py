"""Where xkern's JAX front end spends its time against its torch front end, on the benchmark's worst shapes:
for each case and pass, each kernel launched per call with its device time (the profiler's, the
benchmark's method: `timing.profile_device_us`), for torch_api, jax_api and XLA's own RMSNorm (CUPTI
records XLA's kernels too: its kernels listed here show it), beside the earlier methods (torch: CUDA graph
under do_bench; JAX: host wall time of a jitted fori_loop) and the host's time to launch one call.

    python3 -m tools.jax_torch_profile [--out DIR] [--cases all|quick] [--jaxlib-ptxas]
    python3 -m tools.jax_torch_profile --ptxas [--out DIR]

JAX's kernels are assembled by Triton's ptxas as torch's are (`import jax_api` puts it first on PATH:
`jax_api.use_triton_ptxas`), so both front ends run the same binaries; `--jaxlib-ptxas` (XKERN_JAX_PTXAS=jaxlib)
leaves jaxlib's own search; the JSON records which.

`--ptxas` (no GPU needed; run where the GPU's jax is installed): the two front ends compile the same PTX
(Triton's, the same specialization), but torch's launcher assembles it with Triton's bundled ptxas and
jax-triton's custom call with XLA's ptxas (jaxlib's `CompileGpuAsm`, at first launch). For each RMSNorm
kernel at 32768x128 bf16, every ptxas found: its version, registers and a hash of the SASS; a differing
hash is machine code that differs between the front ends (jaxlib 0.11's assembler takes the first ptxas
of `./bin`, PATH, CUDA_HOME, /usr/local/cuda, the pip CUDA packages; `jax_api.use_triton_ptxas()` puts
Triton's first). Then the StableHLO that jax_api.rms_norm's
forward, backward and forward + backward lower to for CUDA (`jax.export`): every op, each kernel call by
its kernel's name, so that any op around the kernels (a fill, copy, transpose, convert) shows.

Reading it: the same kernels with the same device time in both front ends, and a JAX loop time above
the JAX device time by about the JAX host launch time, say that the difference the loop measured is host
launch cost (XLA's thunk and jax-triton's custom call, per kernel), not device work. A kernel in one list
only, or one whose time differs, is device work to remove. Without a GPU it runs through once at tiny
sizes (smoke: not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# (op, shape, passes): rms_norm's worst JAX / torch ratios on the H100 (main set) and unpermute_rows' worst
CASES = {"quick": [("rms_norm", (32768, 128), ("fwd", "bwd", "fwd+bwd"))],
         "all": [("rms_norm", (32768, 128), ("fwd", "bwd", "fwd+bwd")),
                 ("rms_norm", (65536, 256), ("fwd+bwd",)),
                 ("rms_norm", (8192, 2048), ("fwd+bwd",)),
                 ("unpermute_rows", (16384, 7168), ("fwd",))]}
SMOKE_CASES = [("rms_norm", (9, 128), ("fwd", "bwd", "fwd+bwd")), ("unpermute_rows", (16, 40), ("fwd",))]


def _case(op_name: str, shape):
    from benchmarks import permute as P
    from benchmarks import rms_norm as RN
    from benchmarks.runner import Case

    if op_name == "rms_norm":
        return RN.OP, Case("rms_norm", shape, "bfloat16", RN.PASSES)
    op = P.PERMUTE if op_name == "permute_rows" else P.UNPERMUTE
    _, n, n_pad = P.routing(*shape)
    return op, Case(op_name, shape, P.DTYPE, ("fwd", "bwd"), {"rows": n, "rows_padded": n_pad})


def profile_case(op_name: str, shape, passes, device: str) -> list[dict]:
    """A dict per (pass, implementation): device µs per call by each method, host launch µs, kernels."""
    from benchmarks import timing
    from benchmarks.runner import jax_calls, jax_loop, to_jax, torch_make_calls

    op, case = _case(op_name, shape)
    inputs = op.make(case, device, timing.n_sets(op.min_bytes(case, "fwd")))
    jsets = [([to_jax(a) for a in args], to_jax(cot)) for args, cot in inputs.sets]
    jconsts = inputs.jax_consts()
    torch_impls, jax_impls = op.torch_impls(case), op.jax_impls(case)
    impls = [("torch", "xkern (torch)", torch_impls["xkern (torch)"]), ("jax", "xkern (jax)", jax_impls["xkern (jax)"])]
    if op_name == "rms_norm":
        impls.append(("jax", "jax.jit (XLA)", jax_impls["jax.jit (XLA)"]))
    out = []
    for pass_ in passes:
        for framework, name, fn in impls:
            row = {"op": op_name, "shape": list(shape), "pass": pass_, "impl": name, "input_sets": len(jsets)}
            try:
                if framework == "torch":
                    calls, sync = torch_make_calls(fn, pass_, inputs)(), timing.torch_sync
                    row["graph_us"], _ = timing.torch_device_us(torch_make_calls(fn, pass_, inputs))
                else:
                    calls, sync = jax_calls(fn, pass_, jsets, jconsts), timing.jax_sync
                    step, consts, state = jax_loop(fn, pass_, jsets, jconsts)
                    loop_us, _ = timing.jax_device_us(step, consts, state, len(jsets) * 10.0)
                    row["loop_us"] = loop_us / len(jsets)
                row["device_us"], row["timing"], row["kernels"] = timing.profile_device_us(calls, sync)
                row["host_wall_us"], row["host_launch_us"] = timing.host_us_per_call(calls[0], sync, 500)
            except Exception as err:  # noqa: BLE001 - one failing implementation must not hide the others
                row["status"] = timing.error_status(err)
            out.append(row)
    return out


def pairs(rows: list[dict]) -> list[dict]:
    """Each shape-pass both front ends ran: their device time per call and torch's over JAX's (below 1: JAX is
    slower). The JSON carries them, the README's line is read from there."""
    by = {}
    for row in rows:
        if row.get("device_us") and row["impl"].startswith("xkern"):
            by.setdefault((row["op"], tuple(row["shape"]), row["pass"]), {})[row["impl"]] = row["device_us"]
    return [{"op": op, "shape": list(shape), "pass": pass_, "torch_us": t["xkern (torch)"], "jax_us": t["xkern (jax)"],
             "torch_over_jax": t["xkern (torch)"] / t["xkern (jax)"]}
            for (op, shape, pass_), t in by.items() if len(t) == 2]


def text(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        head = f"## {row['op']} {'x'.join(map(str, row['shape']))} bf16 {row['pass']}, {row['impl']}"
        if "status" in row:
            lines += [head + f": {row['status']}"]
            continue
        other = (f"CUDA graph (do_bench) {row['graph_us']:.2f} µs" if "graph_us" in row else
                 f"fori_loop (host wall) {row['loop_us']:.2f} µs")
        lines.append(f"{head}: device {row['device_us']:.2f} µs/call; {other}; host per call: launch "
                     f"{row['host_launch_us']:.1f} µs, wall {row['host_wall_us']:.1f} µs; {row['input_sets']} set(s)")
        lines += [f"    {k['us']:8.2f} µs  x{k['count']:<4.3g} {k['cat']:<10} {k['name'][:100]}"
                  for k in row["kernels"]]
    lines += ["", "JAX / torch, device time per call (torch µs / JAX µs: below 1, JAX is slower):"]
    lines += [f"  {p['op']} {'x'.join(map(str, p['shape']))} {p['pass']}: torch {p['torch_us']:.2f} µs, JAX "
              f"{p['jax_us']:.2f} µs, {p['torch_over_jax']:.3f}" for p in pairs(rows)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# --ptxas: the machine code each front end's assembler makes of the same PTX


def ptxas_found() -> dict:
    """{label: path} of the ptxas binaries a process may use: Triton's (torch's launches) and those jaxlib looks
    for, in its order (PATH, the CUDA toolkit, the pip CUDA packages)."""
    import glob
    import shutil
    import site

    import triton

    found = {"triton (torch_api)": os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")}
    roots = site.getsitepackages() + [site.getusersitepackages()]
    for label, path in (("PATH (jaxlib: searched first)", shutil.which("ptxas")),
                        ("CUDA toolkit", "/usr/local/cuda/bin/ptxas")):
        if path and os.path.exists(path) and path not in found.values():
            found[label] = path
    for path in sorted({p for root in roots for p in glob.glob(os.path.join(root, "nvidia", "*", "bin", "ptxas"))}):
        found.setdefault(f"pip {path.split(os.sep)[-3]}", path)
    return {k: v for k, v in found.items() if os.path.exists(v)}


def _assemble(ptxas: str, ptx: str) -> dict:
    import re
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
        run = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", src, "-o", out], capture_output=True, text=True)
        if run.returncode:
            return {"version": version, "error": run.stderr.strip()[-300:]}
        regs = re.search(r"Used (\d+) registers", run.stderr)
        with open(out, "rb") as f:
            cubin = f.read()
    return {"version": version, "registers": int(regs[1]) if regs else None, **_sass_of(cubin)}


def _sass_of(cubin: bytes) -> dict:
    import hashlib
    import re

    from xkern.compile_check import sass

    listing = sass(type("Compiled", (), {"asm": {"cubin": cubin}})())
    ins = [re.sub(r"/\*[0-9a-fx]+\*/", "", line).strip() for line in listing.splitlines()
           if re.match(r"^\s+/\*[0-9a-f]{4}\*/", line)]
    return {"instructions": len(ins), "sass": hashlib.sha1("\n".join(ins).encode()).hexdigest()[:16]}


def ptxas_rows() -> list[dict]:
    """Per RMSNorm kernel at 32768x128 bf16 (forward, backward, dw reduce): each ptxas's machine code."""
    import triton

    from xkern.compile_check import TARGET, source
    from xkern.rms_norm import rms_norm_bwd_recipe, rms_norm_fwd_recipe

    ptrs = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "DY": "*bf16", "DX": "*bf16", "DW_PARTIAL": "*fp32",
            "DW": "*bf16", "STATS": "*fp32"}
    found = ptxas_found()
    rows = []
    for recipe in (rms_norm_fwd_recipe(32768, 128, 1e-6, "bfloat16", "bfloat16"),
                   rms_norm_bwd_recipe(32768, 128, 1e-6, "bfloat16", "bfloat16")):
        for launch in (s.launch for s in recipe.steps if s.launch is not None):
            compiled = triton.compile(source(launch, ptrs), target=TARGET,
                                      options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
            row = {"kernel": launch.kernel.fn.__name__, "triton_cubin": _sass_of(compiled.asm["cubin"])}
            row["ptxas"] = {label: _assemble(path, compiled.asm["ptx"]) for label, path in found.items()}
            rows.append(row)
    return rows


def ptxas_text(rows: list[dict]) -> str:
    lines = ["Machine code of the same PTX by each ptxas (registers, SASS instructions, SASS hash):"]
    for row in rows:
        t = row["triton_cubin"]
        lines.append(f"## {row['kernel']} (Triton's own cubin, torch_api's binary: {t['instructions']} instructions, "
                     f"sass {t['sass']})")
        hashes = {r.get("sass") for r in row["ptxas"].values()} | {t["sass"]}
        for label, r in row["ptxas"].items():
            lines.append(f"    {label:<34} {r['version']:<48} " + (f"error: {r['error']}" if "error" in r else
                         f"{r['registers']} regs, {r['instructions']} instructions, sass {r['sass']}"))
        lines.append("    same machine code from every ptxas" if len(hashes) == 1 else
                     "    DIFFERENT machine code: the front ends run different binaries of the same kernel")
    return "\n".join(lines)


def hlo_ops() -> dict:
    """{pass: [op, ...]}: the StableHLO ops of jax_api.rms_norm at 32768x128 bf16 lowered for CUDA, each
    `triton_kernel_call` named by its kernel."""
    import re
    import zlib

    import jax
    import jax.numpy as jnp

    import jax_api
    from jax_api._launch import gpu_lowering

    x, w = jax.ShapeDtypeStruct((32768, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128,), jnp.bfloat16)

    def fwd(x, w):
        return jax_api.rms_norm(x, w, 1e-6)

    def bwd(x, w, dy):
        return jax.vjp(fwd, x, w)[1](dy)

    def train(x, w, dy):
        y, vjp = jax.vjp(fwd, x, w)
        return y, vjp(dy)

    checks = [jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call")]
    out = {}
    with gpu_lowering():
        for name, f, args in (("fwd", fwd, (x, w)), ("bwd", bwd, (x, w, x)), ("fwd+bwd", train, (x, w, x))):
            text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
            ops = []
            for m in re.finditer(r'(stablehlo\.\w+)(?: @(\w+))?(.*?backend_config = "((?:[^"\\]|\\.)*)")?',
                                 text.split("func.func public @main", 1)[1]):
                if m[1] == "stablehlo.custom_call" and m[4]:
                    raw = re.sub(rb"\\(\\|[0-9A-Fa-f]{2})",
                                 lambda g: b"\\" if g[1] == b"\\" else bytes([int(g[1], 16)]), m[4].encode("latin-1"))
                    kernel = re.search(rb"\.globl\s+(\w+)", zlib.decompress(raw))
                    ops.append(f"{m[2]}: {kernel[1].decode() if kernel else '?'}")
                else:
                    ops.append(m[1])
            out[name] = ops
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for jax_torch_profile.json and .txt")
    parser.add_argument("--cases", choices=tuple(CASES), default="all")
    parser.add_argument("--ptxas", action="store_true", help="compare the ptxas binaries' machine code (no GPU; "
                        "run without TRITON_INTERPRET)")
    parser.add_argument("--jaxlib-ptxas", action="store_true", help="JAX's kernels assembled by jaxlib's own "
                        "ptxas search, not Triton's ptxas as torch's are (XKERN_JAX_PTXAS=jaxlib)")
    args = parser.parse_args(argv)
    if args.jaxlib_ptxas:  # read when jax_api is first imported
        if "jax_api" in sys.modules:
            raise RuntimeError("--jaxlib-ptxas: jax_api was imported before the option could take effect")
        os.environ["XKERN_JAX_PTXAS"] = "jaxlib"
    import jax_api._launch  # noqa: F401  (its import puts Triton's ptxas first unless told otherwise)

    jax_ptxas = "jaxlib's search (PATH, CUDA_HOME, /usr/local/cuda, pip CUDA packages)" if args.jaxlib_ptxas else \
        "Triton's (jax_api.use_triton_ptxas)"
    if args.ptxas:
        rows = ptxas_rows()
        ops = hlo_ops()
        report = ptxas_text(rows) + "\n\nStableHLO of jax_api.rms_norm at 32768x128 bf16, lowered for CUDA:\n" + \
            "\n".join(f"    {name}: {', '.join(o)}" for name, o in ops.items())
        print(report)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "jax_torch_ptxas.json"), "w") as f:
                json.dump({"ptxas": rows, "stablehlo": ops}, f, indent=1)
        return 0
    from benchmarks.machine import GPU, commit  # noqa: I001 - first: sets the platform env on CPU
    from benchmarks import timing

    timing.set_smoke(not GPU)
    device = "cuda" if GPU else "cpu"
    rows = []
    for op_name, shape, passes in CASES[args.cases] if GPU else SMOKE_CASES:
        rows += profile_case(op_name, shape, passes, device)
        print(f"{op_name} {shape}: done", file=sys.stderr, flush=True)
    report = text(rows)
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "jax_torch_profile.json"), "w") as f:
            import torch

            json.dump({"gpu": torch.cuda.get_device_name() if GPU else "cpu", "commit": commit(),
                       "smoke": timing.smoke(), "jax_ptxas": jax_ptxas, "pairs": pairs(rows), "rows": rows}, f,
                      indent=1)
        with open(os.path.join(args.out, "jax_torch_profile.txt"), "w") as f:
            f.write(report + "\n")
    return 0 if all("status" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
