"""The machine a benchmark runs on and where its results go, shared by every benchmark entry point.

Import it before torch, triton or jax: on a machine without a CUDA GPU it selects Triton's interpreter and
JAX's CPU platform, and it sets the allocator defaults the benchmarks were measured with.
"""

from __future__ import annotations

import glob
import hashlib
import os
import platform
import re
import shutil
import subprocess


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


GPU = _has_gpu()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX must not grab 75 % of the GPU's memory next to torch.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# With torch's default fixed-size segments, the memory of one case stayed reserved after it (empty_cache
# returned none of it) and grew case by case: 7, 23, 28, 54, 57 GiB after the first five gather cases, then
# out of memory next to JAX on the 80 GB H100 (2026-12-05; ~115 GiB on the H200 the day before). With
# expandable segments every case of the main job ended at 0.0 GiB reserved (H100, 21 cases).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def gpu_kind(name: str) -> str:
    """The results folder and file prefix of a GPU: its name without the memory size ("NVIDIA H100 80GB HBM3"
    -> "nvidia-h100", "NVIDIA H200" -> "nvidia-h200", "NVIDIA H100 PCIe" -> "nvidia-h100-pcie")."""
    words = [w for w in name.lower().split() if not re.fullmatch(r"\d+gb|hbm\w*", w)]
    return "-".join(words)


def kernels_sha() -> str:
    """The first 12 hex digits of a sha256 over xkern/**/*.py (paths and contents): names the kernels and plans
    measured even where git names another commit (a copy of the tree that carries an older .git)."""
    digest = hashlib.sha256()
    core = os.path.join(ROOT, "xkern")
    for path in sorted(glob.glob(os.path.join(core, "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, core).encode() + b"\0" + f.read())
    return digest.hexdigest()[:12]


def commit() -> str | None:
    """This tree's commit (with "+changes" when it has uncommitted ones), where git is there; XKERN_COMMIT
    overrides it (a copy of the tree on another machine may carry an older .git)."""
    if os.environ.get("XKERN_COMMIT"):
        return os.environ["XKERN_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + ("+changes" if dirty else "") if head.returncode == 0 else None
    except OSError:
        return None


DISTS = ("torch", "triton", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "jax-triton", "liger-kernel",
         "quack-kernels", "nvidia-cutlass-dsl", "numpy", "ml_dtypes")


def versions() -> dict:
    """The versions a run measured (None where not installed), CUDA's and the driver's where there is a GPU."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in DISTS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        import torch

        out["cuda (torch)"] = torch.version.cuda
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out["driver"] = subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - informational only
        pass
    return out
