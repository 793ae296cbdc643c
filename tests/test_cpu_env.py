"""What a CPU user of the development venv sees: JAX runs without a traceback although the CUDA plugin (for
the lowering tests) is installed. `scripts/setup.sh` makes the venv's Python default JAX to the CPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import DEVICE

ROOT = Path(__file__).resolve().parent.parent
CALL = """
import jax.numpy as jnp
import jax_api as xj
y = xj.rms_norm(jnp.arange(16, dtype=jnp.float32).reshape(2, 8), jnp.ones(8, jnp.float32))
print(y.shape, y.dtype)
"""


@pytest.mark.skipif(DEVICE != "cpu", reason="a CPU machine's venv")
def test_jax_on_cpu_prints_no_traceback():
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as a user's shell: not set
    env.update(TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", CALL], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "(2, 8) float32" in proc.stdout, proc.stderr[-3000:]
    plugin = importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
    assert "Traceback" not in proc.stderr and "cuDNN" not in proc.stderr, (
        f"CUDA plugin installed: {plugin}; a venv built by scripts/setup.sh defaults JAX_PLATFORMS to cpu "
        f"(rerun it to add that line):\n{proc.stderr[-3000:]}")
