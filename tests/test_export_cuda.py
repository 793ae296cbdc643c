"""The JAX GPU path lowers for CUDA on a CPU machine: `jax.export(platforms=["cuda"])` of every jax_api op
through jax-triton, which compiles each kernel for sm_90 while lowering (a GPU-only compile error raises).

Runs in a subprocess: Triton's compiler cannot share a process with its interpreter (TRITON_INTERPRET=1,
set by conftest.py). Needs jax-triton and a CUDA plugin for jax (scripts/setup.sh installs both).
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.sm90_static  # conftest.py: CPU CI runs these, a GPU run skips them

# Each case: the kernels of the `triton_kernel_call`s its exported module must hold, one entry per call.
# 16 slots: the inverse is the one-launch search (`xkern.permute.one_launch`), then the gather
GATHER_VIA_INVERSE = ["_gather_rows_kernel", "_inverse_search_kernel"]
EXPECTED = {
    "rms_norm bf16": ["_rms_norm_fwd_row_kernel"],
    "rms_norm fp16 x, fp32 w": ["_rms_norm_fwd_kernel"],
    "grad rms_norm": ["_rms_norm_fwd_row_kernel", "_rms_norm_bwd_kernel"],  # 6 rows: one program writes dw
    "permute_rows": ["_gather_rows_kernel"],
    "unpermute_rows": GATHER_VIA_INVERSE,
    "grad permute_rows": ["_gather_rows_kernel"] + GATHER_VIA_INVERSE,  # forward gather, then unpermute
    "generate_permute_indices": ["_generate_one_kernel"],  # up to ONE_LAUNCH_SLOTS slots: one program
    "topk_permute_indices": ["_route_count_kernel", "_route_fill_kernel", "_route_tables_kernel"],
}


def _kernels(module_text: str) -> list[str]:
    """Kernel names of the `triton_kernel_call`s in `module_text`, each checked to carry sm_90 PTX."""
    names = []
    for m in re.finditer(r'custom_call @triton_kernel_call\(.*?backend_config = "((?:[^"\\]|\\.)*)"', module_text):
        # MLIR escapes bytes as \XX and a backslash as \\; the config is a zlib-compressed proto.
        raw = re.sub(rb"\\(\\|[0-9A-Fa-f]{2})", lambda g: b"\\" if g[1] == b"\\" else bytes([int(g[1], 16)]),
                     m[1].encode("latin-1"))
        config = zlib.decompress(raw)
        assert b".target sm_90" in config, config[:300]
        names.append(re.search(rb"\.globl\s+(\w+)", config)[1].decode())
    return sorted(names)


def _export_all() -> dict:
    """In the child: export each case for CUDA under `gpu_lowering()`; the kernel names per case."""
    import jax
    import jax.numpy as jnp

    import jax_api
    from jax_api._launch import gpu_lowering

    S = jax.ShapeDtypeStruct
    x, w = S((6, 1000), jnp.bfloat16), S((1000,), jnp.bfloat16)  # the row kernel (768 and wider)
    rows, idx, counts = S((10, 64), jnp.float32), S((16,), jnp.int32), S((4,), jnp.int32)
    cases = {
        "rms_norm bf16": (lambda x, w: jax_api.rms_norm(x, w), x, w),
        "rms_norm fp16 x, fp32 w": (lambda x, w: jax_api.rms_norm(x, w), S((2, 3, 96), jnp.float16),
                                    S((96,), jnp.float32)),
        "grad rms_norm": (jax.grad(lambda x, w: jnp.sum(jax_api.rms_norm(x, w).astype(jnp.float32) ** 2),
                                   argnums=(0, 1)), x, w),
        "permute_rows": (jax_api.permute_rows, rows, idx),
        "unpermute_rows": (lambda y, i: jax_api.unpermute_rows(y, i, 10), S((16, 64), jnp.float32), idx),
        "grad permute_rows": (jax.grad(lambda x, i: jnp.sum(jax_api.permute_rows(x, i) ** 2)), rows, idx),
        "generate_permute_indices": (lambda c: jax_api.generate_permute_indices(c, 2, 2, 16, 4), counts),
        "topk_permute_indices": (lambda i: jax_api.topk_permute_indices(i, 4, alignment=4), S((5, 2), jnp.int32)),
    }
    checks = [jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call")]
    found = {}
    with gpu_lowering():
        for name, (f, *args) in cases.items():
            exported = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(*args)
            assert exported.platforms == ("cuda",), exported.platforms
            found[name] = _kernels(exported.mlir_module())
    return found


def test_jax_gpu_path_exports_for_cuda():
    missing = [pkg for pkg, mod in (("jax-triton", "jax_triton"), ("jax-cuda13-plugin", "jax_cuda13_plugin"))
               if importlib.util.find_spec(mod) is None]
    assert not missing, f"not installed: {', '.join(missing)} (CI needs them for this check: scripts/setup.sh)"
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, __file__], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found == {name: sorted(kernels) for name, kernels in EXPECTED.items()}


if __name__ == "__main__":
    print(json.dumps(_export_all()))


def _fake_ptxas(tmp_path):
    """A `ptxas` standing for jaxlib's: it records that it ran."""
    other = tmp_path / "bin"
    other.mkdir()
    (other / "ptxas").write_text(f"#!/bin/sh\necho jaxlib-ptxas > {tmp_path / 'ran'}\n")
    (other / "ptxas").chmod(0o755)
    return other


@pytest.mark.parametrize("choice", ["default", "jaxlib"])
def test_import_routes_ptx_to_tritons_assembler(choice, tmp_path):
    """`import jax_api` on a GPU machine (no interpreter) puts first on PATH the ptxas that routes Triton's PTX
    to Triton's assembler (torch_api's machine code) and the rest to jaxlib's; XKERN_JAX_PTXAS=jaxlib leaves
    PATH as it was."""
    other = _fake_ptxas(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "XKERN_JAX_PTXAS")}
    env.update(JAX_PLATFORMS="cpu", PATH=f"{other}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               **({"XKERN_JAX_PTXAS": "jaxlib"} if choice == "jaxlib" else {}))
    code = "import shutil, jax_api; p = shutil.which('ptxas'); print('FOUND', p); print(open(p).read())"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found, shim = run.stdout.split("FOUND ", 1)[1].split("\n", 1)
    if choice == "jaxlib":
        assert found == str(other / "ptxas")
    else:
        import triton

        assert Path(found).parent.name.startswith("xkern-ptxas-") and str(other / "ptxas") in shim
        assert not Path(found).exists()  # the process removes its ptxas at exit
        assert os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas") in shim


def test_use_triton_ptxas_routes_by_ptx_version(monkeypatch, tmp_path):
    """The `ptxas` that `jax_api.use_triton_ptxas()` puts first: PTX of an ISA version Triton's ptxas assembles
    (Triton's own) goes to Triton's ptxas, a newer one (XLA's from jaxlib 0.11.2: 9.0) and `--version` to the
    ptxas jaxlib's search finds, never to a routing `ptxas` inherited from a parent process; calling it again
    changes nothing. With XKERN_PTXAS_LOG, each call leaves a line there."""
    import shutil

    from jax_api import _ptxas

    other = _fake_ptxas(tmp_path)
    inherited = tmp_path / "xkern-ptxas-parent"  # a parent's router, first on PATH: gone when the parent exits
    inherited.mkdir()
    (inherited / "ptxas").write_text("#!/bin/sh\nexit 3\n")
    (inherited / "ptxas").chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(inherited), str(other), os.environ.get("PATH", "")]))
    monkeypatch.setattr(_ptxas, "_shim_dir", None)
    assert _ptxas.jaxlib_ptxas() == str(other / "ptxas")
    path = _ptxas.use_triton_ptxas()
    shim = shutil.which("ptxas")
    assert shim == os.path.join(path, "ptxas")
    assert str(inherited) not in Path(shim).read_text()
    once = os.environ["PATH"]
    _ptxas.use_triton_ptxas()
    assert os.environ["PATH"] == once and once.split(os.pathsep).count(path) == 1
    _, max_version = _ptxas.triton_ptxas()
    ran, log = tmp_path / "ran", tmp_path / "ptxas.log"
    monkeypatch.setenv("XKERN_PTXAS_LOG", str(log))
    kernel = ".target sm_90a\n.address_size 64\n.visible .entry k()\n{\n\tret;\n}\n"
    for version, jaxlib in ((f"{max_version // 10}.{max_version % 10}", False), ("9.9", True), (None, True)):
        ran.unlink(missing_ok=True)
        out = tmp_path / "k.cubin"
        out.unlink(missing_ok=True)
        if version is None:
            args = ["--version"]
        else:
            (tmp_path / "k.ptx").write_text(f"//\n// a test kernel\n//\n\n.version {version}\n" + kernel)
            args = ["-arch=sm_90a", str(tmp_path / "k.ptx"), "-o", str(out)]
        run = subprocess.run([shim, *args], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert ran.exists() == jaxlib, (version, run.stdout, run.stderr)
        assert out.exists() == (not jaxlib)  # Triton's ptxas assembled it
    # XKERN_PTXAS_LOG: a line per call, which ptxas took it and the PTX's ISA version
    assert log.read_text().splitlines() == [f"triton {max_version}", "jaxlib 99", "jaxlib "]
