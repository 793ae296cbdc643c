"""A Llama-style block's training step under `jax.jit`: plain `jax.numpy` norms and residual adds (XLA fuses
them into its own kernels) against xkern's `rms_norm` and fused `add_rms_norm` at the second norm.

Block (pre-norm, as Hugging Face's Llama decoder layer): h = x + attn(norm1(x)); out = h + mlp(norm2(h)).
xkern computes `norm2(x + attn)` and the residual `h` in one kernel (`jax_api.add_rms_norm`; norm1 has no add
before it: `jax_api.rms_norm`). The step is `vjp` of the block's output against a fixed cotangent: the
gradient of x and of every weight, all returned. Device time per step: `timing.profile_device_us` (the
profiler's device activities of one jitted step, L2 flushed before it; the benchmark's JAX method), with
the kernels each step launches (`kernels`). Sizes: `SIZES` (two, the torch block's and a larger one).

    python -m benchmarks.jax_block [--out DIR] [--profile]

`--profile`: per configuration, every kernel of a step with its count and device µs per step, and the
totals by kind (xkern's Triton kernels, XLA's fusions, matmuls, attention, other).
"""

from __future__ import annotations

import functools

from benchmarks import timing
from benchmarks.timing import error_status

EPS = 1e-6
# [batch, seq, dim], heads, MLP hidden size: the torch block's (benchmarks/host.py) and a Llama-3-8B-like one
SIZES = {"cuda": [dict(batch=1, seq=256, dim=2048, heads=16, hidden=5632),
                  dict(batch=1, seq=2048, dim=4096, heads=32, hidden=14336)],
         "cpu": [dict(batch=1, seq=4, dim=64, heads=4, hidden=128)]}
NORMS = ("jnp", "xkern")


def _plain_rms_norm(x, w):
    import jax
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    return w * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)).astype(x.dtype)


def _params(cfg: dict, key):
    import jax
    import jax.numpy as jnp

    d, f = cfg["dim"], cfg["hidden"]
    shapes = {"qkv": (d, 3 * d), "o": (d, d), "gate_up": (d, 2 * f), "down": (f, d)}
    keys = jax.random.split(key, len(shapes) + 2)
    params = {name: (jax.random.normal(k, s, jnp.float32) / s[0] ** 0.5).astype(jnp.bfloat16)
              for (name, s), k in zip(shapes.items(), keys)}
    for name, k in zip(("norm1", "norm2"), keys[len(shapes):]):
        params[name] = (1 + 0.1 * jax.random.normal(k, (d,), jnp.float32)).astype(jnp.bfloat16)
    return params


def block(params, x, norm: str, heads: int):
    """The block's output [batch, seq, dim]."""
    import jax
    import jax.numpy as jnp

    b, s, d = x.shape
    if norm == "xkern":
        import jax_api

        h1 = jax_api.rms_norm(x, params["norm1"], EPS)
    else:
        h1 = _plain_rms_norm(x, params["norm1"])
    q, k, v = jnp.split((h1 @ params["qkv"]).reshape(b, s, 3 * heads, d // heads), 3, axis=2)
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, d) @ params["o"]
    if norm == "xkern":
        h2, h = jax_api.add_rms_norm(a, x, params["norm2"], EPS)
    else:
        h = x + a
        h2 = _plain_rms_norm(h, params["norm2"])
    gate, up = jnp.split(h2 @ params["gate_up"], 2, axis=-1)
    return h + (jax.nn.silu(gate) * up) @ params["down"]


@functools.cache
def _step(norm: str, heads: int):
    """The jitted training step: (dparams, dx) of the block at (params, x) against dy."""
    import jax

    def step(params, x, dy):
        _, vjp = jax.vjp(lambda p, x: block(p, x, norm, heads), params, x)
        return vjp(dy)

    return jax.jit(step)


def kind(name: str) -> str:
    """A kernel's kind by its name (CUPTI's): xkern's Triton kernels, XLA's fusions, matmuls, attention."""
    low = name.lower()
    if "rms_norm" in low or "add_rms" in low or "dw_reduce" in low:
        return "xkern (Triton)"
    if any(k in low for k in ("gemm", "cutlass", "sm90_xmma", "cublas", "nvjet", "matmul", "dot")):
        return "matmul"
    if any(k in low for k in ("flash", "fmha", "attention", "cudnn")):
        return "attention"
    if "fusion" in low or "loop_" in low or "input_" in low or "reduce" in low:
        return "XLA fusion"
    return "other"


def _check(cfg: dict) -> str:
    """The two norms' block outputs and gradients agree (bf16: within a few ULP of each other)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    params = _params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (cfg["batch"], cfg["seq"], cfg["dim"]), jnp.bfloat16)
    outs = {n: jax.jit(lambda p, x, n=n: block(p, x, n, cfg["heads"]))(params, x) for n in NORMS}
    a, b = (np.asarray(outs[n].astype(jnp.float32)) for n in NORMS)
    rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))
    if not rel < 2e-2:
        raise AssertionError(f"xkern's block differs from the jnp block: relative L2 {rel:.3g}")
    return f"outputs agree (relative L2 {rel:.2g})"


def jax_block_table(device: str, log) -> list[dict]:
    """One row per (size, norm): device µs per training step (`timing.profile_device_us`) and the step's
    kernels, the jnp and xkern steps of a size timed in turn."""
    import jax
    import jax.numpy as jnp

    rows = []
    for cfg in SIZES[device]:
        try:
            checked = _check(cfg)
        except Exception as err:  # noqa: BLE001 - a failed check is a row's status, not the run's end
            checked = error_status(err)
        for norm in NORMS:
            row = {"norm": norm, "config": cfg, "check": checked}
            rows.append(row)
            try:
                params = _params(cfg, jax.random.key(0))
                shape = (cfg["batch"], cfg["seq"], cfg["dim"])
                x = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
                dy = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
                step = functools.partial(_step(norm, cfg["heads"]), params, x, dy)
                row["device_us"], row["timing"], row["kernels"] = timing.profile_device_us([step], timing.jax_sync)
                for k in row["kernels"]:
                    k["kind"] = kind(k["name"])
                log(f"jax block {cfg['dim']}x{cfg['seq']} with {norm} norms: {row['device_us']:.0f} µs/step")
            except Exception as err:  # noqa: BLE001
                row["status"] = error_status(err)
                log(f"jax block {cfg['dim']} with {norm} norms: {row['status']}")
    return rows


def profile_text(rows: list[dict]) -> str:
    """Per configuration and norm: the totals by kind, then every kernel (count and µs per step)."""
    out = []
    for row in rows:
        cfg = row["config"]
        out.append(f"## {cfg['dim']}x{cfg['seq']} (batch {cfg['batch']}), {row['norm']} norms: "
                   + (f"{row['device_us']:.1f} µs/step" if row.get("device_us") else row.get("status", "")))
        kernels = row.get("kernels") or []
        by_kind: dict = {}
        for k in kernels:
            by_kind[k["kind"]] = by_kind.get(k["kind"], 0.0) + k["us"]
        out += [f"  {name:<16} {us:9.1f} µs" for name, us in sorted(by_kind.items(), key=lambda kv: -kv[1])]
        out += [f"    {k['us']:9.2f} µs  x{k['count']:<5.3g} {k['kind']:<15} {k['name'][:110]}" for k in kernels]
    return "\n".join(out)


if __name__ == "__main__":  # rows printed, and into DIR if given; --profile: the kernel table too
    import argparse
    import json
    import os

    from benchmarks.machine import GPU, commit, gpu_kind  # noqa: I001 - first: sets the platform env on CPU

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for <gpu kind>-jax-block.json (and -jax-block-profile.txt)")
    parser.add_argument("--profile", action="store_true", help="print every kernel of each step, by kind")
    args = parser.parse_args()
    import torch

    dev = "cuda" if GPU else "cpu"
    timing.set_smoke(not GPU)
    gpu = torch.cuda.get_device_name(0) if GPU else "cpu"
    rows = jax_block_table(dev, print)
    text = profile_text(rows) if args.profile else ""
    if text:
        print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, gpu_kind(gpu) + "-jax-block.json"), "w") as f:
            json.dump({"gpu": gpu, "commit": commit(), "smoke": timing.smoke(), "rows": rows}, f, indent=1)
        if text:
            with open(os.path.join(args.out, gpu_kind(gpu) + "-jax-block-profile.txt"), "w") as f:
                f.write(text + "\n")
