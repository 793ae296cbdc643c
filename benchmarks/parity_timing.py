"""Is JAX's slower backward at some widths (bf16 256 and 3072: 0.95-0.96 of torch in two sweeps, same PTX) the
timing method? The sweep times torch as one call per CUDA-graph replay with L2 flushed before it, and JAX as a
jitted loop of back-to-back calls, each one's dx the next one's cotangent, with no flush. This times xkern's
backward alone both ways in torch (the sweep's way, and K back-to-back calls fed the same way in one graph) and
the sweep's way in JAX, at the same x of 2**26 elements. Device µs per call.

    python -m benchmarks.parity_timing [--widths 256,3072,2560,4096] [--k 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU here


def torch_times(m: int, n: int, k: int) -> dict:
    import torch

    from benchmarks import rms_norm as RN
    from benchmarks import timing
    from benchmarks.runner import Inputs, torch_make_calls

    gen = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(n)
    device = gen.device
    x, cot = (torch.randn(m, n, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(n, generator=gen, device=device, dtype=torch.bfloat16)

    def chained():  # K calls in one graph, each cotangent the previous dx (as JAX's loop feeds it)
        leaves = [x.detach().requires_grad_(), w.detach().requires_grad_()]
        y = RN.xkern_torch(*leaves)

        def call():
            c = cot
            for _ in range(k):
                c = torch.autograd.grad(y, leaves, c, retain_graph=True)[0]
            return c
        return [call]

    single, _ = timing.torch_device_us(torch_make_calls(RN.xkern_torch, "bwd", Inputs([([x, w], cot)])),
                                       eager_fallback=False)  # the sweep's
    chain, _ = timing.torch_device_us(chained, eager_fallback=False)
    return {"torch, one call per replay (sweep)": single, f"torch, {k} chained calls per replay": chain / k}


def jax_time(m: int, n: int) -> float:
    import jax
    import jax.numpy as jnp

    from benchmarks import rms_norm as RN
    from benchmarks import timing
    from benchmarks.runner import jax_loop

    keys = jax.random.split(jax.random.key(n), 3)
    x, cot = (jax.random.normal(kk, (m, n), jnp.bfloat16) for kk in keys[:2])
    w = jax.random.normal(keys[2], (n,), jnp.bfloat16)
    step, consts, state = jax_loop(RN.xkern_jax, "bwd", [([x, w], cot)], ())
    return timing.jax_device_us(step, consts, state, 100.0)[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="256,3072,2560,4096")
    parser.add_argument("--elems", type=int, default=1 << 26)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--out")
    args = parser.parse_args()
    import torch

    from benchmarks import timing

    timing.set_smoke(not torch.cuda.is_available())  # CPU: runs once, no timing is a measurement
    rows = []
    for n in (int(w) for w in args.widths.split(",")):
        m = max(1, args.elems // n)
        got = {**torch_times(m, n, args.k), "jax, jitted loop (sweep)": jax_time(m, n)}
        rows.append({"shape": [m, n], **got})
        print(f"{m}x{n}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()) + " (µs per call)", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "parity-timing.json"), "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
