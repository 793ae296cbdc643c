"""Every kernel variant the plans can choose compiles for sm_90 (Hopper), and for every other architecture Triton
targets (sm_80, sm_86, sm_89, sm_100, sm_120), each within its shared memory and registers: checked on CPU, in CI."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sm90_static  # conftest.py: CPU CI runs these, a GPU run skips them


@pytest.mark.slow  # ~150 s on 2 cores (a thread per core): every variant compiled; run it after a kernel edit
def test_every_plan_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "xkern.compile_check"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=1800)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 failed" in run.stdout and "passed" in run.stdout


@pytest.mark.slow  # ~450 s of CPU an architecture (sm_120's 1414 variants); each planned for its shared memory and SMs
@pytest.mark.parametrize("arch", [80, 86, 89, 100, 120])
def test_every_plan_variant_compiles_for_each_architecture(arch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "xkern.compile_check", "--arch", str(arch)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=3600)
    assert run.returncode == 0, run.stdout + run.stderr[-5000:]
    assert f"sm_{arch} compile check:" in run.stdout and " 0 failed" in run.stdout


def test_each_architecture_compiles_within_its_limits():
    """A kernel compiled for each architecture and held to its limits (`compile_check.build`), and a binary over
    a limit refused: the per-architecture check itself, in the default tier (the full sweeps are slow)."""
    code = """
import dataclasses
from xkern import compile_check, device
from xkern.rms_norm import plan_rms_norm_fwd
ptrs = {"X": "*bf16", "W": "*bf16", "Y": "*bf16"}
for arch, props in device.ARCHITECTURES.items():
    with device.target(props):
        compile_check.build(plan_rms_norm_fwd(64, 4096, 1e-6), ptrs, props)
try:
    compile_check.build(plan_rms_norm_fwd(64, 4096, 1e-6), ptrs, dataclasses.replace(device.H100, max_shared_mem=0))
except RuntimeError as e:
    print("refused:", e)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env={**env, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "refused: over sm_90's limits" in run.stdout, run.stdout + run.stderr


@pytest.mark.slow  # every variant through torch's access analysis
def test_triton_op_bodies_write_only_their_outputs():
    """torch.compile's view of every kernel variant (torch's wrap_triton access analysis, sm_90 target): no
    input pointer counted as written. One that is makes Inductor treat x or dy as mutated (a leaf that
    requires grad then fails to compile), which the interpreter on CPU never shows."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "tests/triton_op_access.py"], cwd=root, env={**env, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert ", 0 writing an input" in run.stdout


def test_sass_hash_tells_binaries_apart():
    """`python -m xkern.compile_check --sass`, the check that a refactor keeps every binary the plans launch:
    the same launch hashes alike, another block size differently."""
    code = """
import triton
from xkern.compile_check import TARGET, sass_hash, source
from xkern.rms_norm import plan_rms_norm_fwd
ptrs = {"X": "*bf16", "W": "*bf16", "Y": "*bf16"}
def h(n):
    p = plan_rms_norm_fwd(64, n, 1e-6)
    return sass_hash(triton.compile(source(p, ptrs), target=TARGET, options={"num_warps": p.num_warps}))
print(h(1024) == h(1024), h(1024) != h(2048))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env={**env, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.split() == ["True", "True"], run.stdout + run.stderr
