"""RMSNorm, declared to the runner: xkern's torch and JAX front ends against their peers, forward, backward
alone and forward + backward, bf16 and a few fp16 cases; the width sweep (`--sweep`).

Minimum bytes (w in x's dtype): forward reads x and w and writes y; backward reads x, dy and w and writes
dx and dw; forward + backward is the sum of the two (a training step runs them at different times, so x is
read twice). Checks: the FP64 oracle (`xkern.reference.check`) on evenly spaced rows for y and dx and on
every row for dw.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.runner import Case, Inputs, Op, sample_rows
from xkern import reference as R
from xkern.testing import to_numpy, torch_dtype

EPS = 1e-6
PASSES = ("fwd", "bwd", "fwd+bwd")
SHAPES = [(262144, 128), (32768, 128), (262144, 64), (65536, 256), (8192, 2048), (32768, 4096), (8192, 8192),
          (4096, 16384), (2048, 32768), (1024, 65536)]
SHAPES_FP16 = [(262144, 128), (8192, 2048), (4096, 16384)]
# CPU (interpreter): one shape per plan regime (narrow tiles, row kernels, the backward's row kernel at
# 8193-16384 and in SPLIT blocks above, its column split above 32768) and fp16.
VALIDATE = [((64, 128), "bfloat16"), ((37, 1000), "bfloat16"), ((4, 9000), "bfloat16"), ((5, 16500), "bfloat16"),
            ((2, 33000), "bfloat16"), ((48, 256), "float16")]
SMOKE = [((9, 128), "bfloat16"), ((3, 256), "float16")]

# The width sweep: every multiple of 64 to 1024; hidden sizes and head dims of open model families (Qwen2/3,
# Llama 3, Mistral/Mixtral, Gemma, DeepSeek-V3, Phi); powers of two to 65536. Rows fill SWEEP_ELEMS.
MODEL_WIDTHS = [80, 96, 192, 896, 1536, 2560, 3072, 3584, 5120, 6144, 7168, 8192, 12288, 14336, 16384, 18432]
SWEEP_WIDTHS = sorted(set(range(64, 1025, 64)) | set(MODEL_WIDTHS) | {2 ** p for p in range(6, 17)})
SWEEP_FP16 = [128, 512, 896, 2048, 4096, 7168, 16384, 65536]
SWEEP_ELEMS = 2**26  # x of 128 MB in bf16: 2x the H200's L2, a few waves of programs at every width
SWEEP_SMOKE = [((2, 96), "bfloat16")]
SAMPLE_ELEMS = 2**21  # y and dx are checked on rows adding up to about this; dw on every row
CHUNK_ELEMS = 2**18   # rows per oracle task (threads; small chunks stay in the CPU caches)


def cases(mode: str) -> list[Case]:
    sweep = [((SWEEP_ELEMS // n, n), "bfloat16") for n in SWEEP_WIDTHS]
    sweep += [((SWEEP_ELEMS // n, n), "float16") for n in SWEEP_FP16]
    shapes = {"main": [(s, "bfloat16") for s in SHAPES] + [(s, "float16") for s in SHAPES_FP16],
              "validate": VALIDATE, "smoke": SMOKE, "sweep": sweep, "sweep-smoke": SWEEP_SMOKE}[mode]
    info = {"sweep": True} if mode.startswith("sweep") else {}
    return [Case("rms_norm", shape, dtype, PASSES, dict(info)) for shape, dtype in shapes]


def min_bytes(case: Case, pass_: str) -> int:
    m, n = case.shape
    size = np.dtype(R.np_dtype(case.dtype)).itemsize
    fwd = 2 * m * n * size + n * size
    bwd = 3 * m * n * size + 2 * n * size
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[pass_]


# ---------------------------------------------------------------------------------------------------
# Implementations


def hf_rms_norm(x, w, eps: float = EPS):
    """The Hugging Face Llama expression, as eager PyTorch runs it."""
    import torch

    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def xla_rms_norm(x, w, eps: float = EPS):
    """The same expression in jax.numpy (XLA fuses it under jit)."""
    import jax
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    return w * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def xkern_torch(x, w):
    import torch_api

    return torch_api.rms_norm(x, w, EPS)


def xkern_jax(x, w):
    import jax_api

    return jax_api.rms_norm(x, w, EPS)


def f_rms_norm(x, w):
    import torch

    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, EPS)


@functools.cache
def liger():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception as err:  # noqa: BLE001 - optional peer
        return f"skipped: liger-kernel not importable ({type(err).__name__}: {err})"
    # Llama casting mode; in_place=True (its default) writes dx into dy: the runner clones dy per call.
    return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", True)


@functools.cache
def quack():
    try:
        from quack.rmsnorm import rmsnorm
    except Exception as err:  # noqa: BLE001 - optional peer
        return f"skipped: quack not importable ({type(err).__name__}: {err}); see docs/benchmarks.md"
    return lambda x, w: rmsnorm(x, w, eps=EPS)


def compiled_hf():
    """torch.compile of the HF expression for one shape (Inductor on a GPU; on CPU the aot_eager backend,
    which runs the same tracing without a C++ build)."""
    import torch

    backend = "inductor" if torch.cuda.is_available() else "aot_eager"
    return torch.compile(hf_rms_norm, dynamic=False, fullgraph=True, backend=backend)


def torch_impls(case: Case) -> dict:
    return {"xkern (torch)": xkern_torch, "HF eager": hf_rms_norm, "F.rms_norm": f_rms_norm,
            "torch.compile": compiled_hf(), "Liger": liger(), "quack": quack()}


def jax_impls(case: Case) -> dict:
    return {"xkern (jax)": xkern_jax, "jax.jit (XLA)": xla_rms_norm}


# ---------------------------------------------------------------------------------------------------
# Inputs, oracle, check


def oracle(x: np.ndarray, w: np.ndarray, dy: np.ndarray, rows: np.ndarray) -> dict:
    """FP64 truth: y and dx at `rows`, dw and its tolerance over every row (row chunks in threads)."""
    step = max(1, CHUNK_ELEMS // x.shape[1])

    def chunk(start):
        stop = min(start + step, x.shape[0])
        dx, dw, tol = R.rms_norm_bwd(x[start:stop], w, dy[start:stop], EPS)
        return dx[rows[(rows >= start) & (rows < stop)] - start], dw, tol

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        parts = list(pool.map(chunk, range(0, x.shape[0], step)))
    return {"rows": rows, "y": R.rms_norm_fwd(x[rows], w, EPS), "dx": np.concatenate([p[0] for p in parts]),
            "dw": sum(p[1] for p in parts), "dw_tol": sum(p[2] for p in parts)}


def make(case: Case, device: str, n_sets: int) -> Inputs:
    import torch

    (m, n), dt = case.shape, torch_dtype(case.dtype)
    gen = torch.Generator(device=device).manual_seed(m * 131 + n)
    w = torch.randn(n, generator=gen, device=device, dtype=dt)
    sets = [([torch.randn(m, n, generator=gen, device=device, dtype=dt), w],
             torch.randn(m, n, generator=gen, device=device, dtype=dt)) for _ in range(n_sets)]
    (x, _), dy = sets[0]
    rows = sample_rows(m, SAMPLE_ELEMS, n)
    case.info["checked_rows"] = len(rows)
    return Inputs(sets, ref=oracle(to_numpy(x), to_numpy(w), to_numpy(dy), rows))


def check(case: Case, ref: dict, got: dict) -> tuple[dict, str | None]:
    """`R.check` of y, dx (sampled rows) and dw: (stats, None), or (stats so far, the failure)."""
    import torch

    rows = torch.from_numpy(ref["rows"]).to(got["y"].device)
    outputs = {"y": got["y"][rows], "dx": got["dx"][rows], "dw": got["dw"]}
    stats = {}
    for kind, out in outputs.items():
        try:
            stats[kind] = R.check(to_numpy(out), ref[kind], "fwd" if kind == "y" else kind,
                                  abs_ok=ref["dw_tol"] if kind == "dw" else None)
        except AssertionError as err:
            return stats, f"{kind}: {err}"
    return stats, None


OP = Op("rms_norm", cases, make, check, min_bytes, torch_impls, jax_impls, grad_names=("dx", "dw"))
