# Sourced by main.sh and test.sh: picks the Python to use, setting up .venv on a machine without a GPU.
# On a CPU machine: Python 3.11 venv with torch 2.13.0 (CPU build, from local disk), triton 3.6.0 (its
# interpreter runs the kernels), jax 0.10.2. numpy < 2.4: Triton 3.6's interpreter breaks on numpy
# 2.4's removal of 1-element-array-to-int conversion (kernels looping over program ids). jax-triton and
# the CUDA plugin for jax (no CUDA libraries, ~400 MB) let tests/test_export_cuda.py lower the GPU path.
# kernels (Hugging Face's kernel hub client) for tests/test_hf.py's `kernelize` tests (0.17.2 here; transformers
# 5.24 marks its classes for the hub and takes use_kernels=True only with 0.18.x, so those tests mark them).
# flax (with optax) for jax_api.nnx and tests/test_nnx.py.
# On a GPU machine: the system python3 and what is installed there; on a machine without network, plus the
# wheels of .whl/ (docs/gpu-runs.md), installed once per machine into /tmp/xkern-site.
set -e
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  PY=python3
  if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    WHEELS=$(ls .whl/*.whl | sort | tr '\n' ' ')  # installed once per machine (gpu_all.sh sources this twice)
    if [ "$(cat /tmp/xkern-site/.wheels 2>/dev/null)" != "$WHEELS" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/xkern-site .whl/*.whl
      echo "$WHEELS" > /tmp/xkern-site/.wheels
    fi
    export PYTHONPATH=/tmp/xkern-site:${PYTHONPATH:-}
  fi
  if [ -d /tmp/xkern-site/nvidia_cutlass_dsl/dsl_packages ]; then  # quack's CuTe DSL, where its wheels came in .whl/
    export PYTHONPATH=/tmp/xkern-site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  fi
  export PYTHONPATH=$ROOT:${PYTHONPATH:-}
  # The GPU's kind, naming its logs and results: "NVIDIA H100 80GB HBM3" -> nvidia-h100, "NVIDIA H200" -> nvidia-h200
  GPU_KIND=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr '[:upper:]' '[:lower:]' |
             awk '{print $1 ($2 == "" ? "" : "-" $2)}')
else
  PYBIN=$(command -v python3.11 || (command -v pyenv >/dev/null && pyenv root >/dev/null && ls "$(pyenv root)"/versions/3.11*/bin/python3.11 2>/dev/null | head -1) || command -v python3)
  if [ ! -x .venv/bin/python ] || ! JAX_PLATFORMS=cpu .venv/bin/python -c "import torch, triton, jax, ml_dtypes, pytest, xdist, hypothesis, transformers, jax_triton, kernels, flax, optax" 2>/dev/null; then
    "$PYBIN" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q torch==2.13.0 triton==3.6.0 jax==0.10.2 jaxlib==0.10.2 \
      ml_dtypes "numpy<2.4" pytest pytest-xdist hypothesis ruff matplotlib transformers kernels jax-cuda13-plugin==0.10.2 jax-triton==0.3.1 \
      flax==0.12.8
    .venv/bin/python -m pip install -q --no-deps -e .
  fi
  # JAX with the CUDA plugin on a machine without CUDA prints a cuDNN traceback at its first call: this
  # venv's Python starts with JAX on the CPU unless JAX_PLATFORMS says otherwise (a .pth line runs at start-up,
  # before any import; the lowering tests name CUDA in jax.export, which needs no CUDA backend).
  echo 'import os; os.environ.setdefault("JAX_PLATFORMS", "cpu")' \
    > "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/xkern-jax-cpu.pth"
  PY=.venv/bin/python
  export TRITON_INTERPRET=1 JAX_PLATFORMS=cpu
fi
export PYTHONUNBUFFERED=1
