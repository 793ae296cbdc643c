"""JAX forward + backward of RMSNorm with the cotangent available from the start (the previous step's y: the
benchmark's fwd+bwd step until 2026-12-04) and with it waiting for this step's y (`runner.jax_loop
(dependent=True)`, the benchmark's step since, as in a model, where it comes from the layers after the
norm): how much of XLA's lead at the widest rows came from fusing its forward and backward into one pass
over x, which a model's step does not allow. Device µs per step (one jitted loop), bf16, x of 2**26
elements.

    python -m benchmarks.dependent_cot [--widths 65536,32768,4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="65536,32768,8192,4096,1024")
    parser.add_argument("--elems", type=int, default=1 << 26)
    parser.add_argument("--out")
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp

    from benchmarks import rms_norm as RN
    from benchmarks import timing
    from benchmarks.runner import jax_loop

    rows = []
    for n in (int(w) for w in args.widths.split(",")):
        m = max(1, args.elems // n)
        keys = jax.random.split(jax.random.key(n), 3)
        x, cot = (jax.random.normal(k, (m, n), jnp.bfloat16) for k in keys[:2])
        w = jax.random.normal(keys[2], (n,), jnp.bfloat16)
        for impl, fn in RN.jax_impls(None).items():
            for dependent in (False, True):
                step, consts, state = jax_loop(fn, "fwd+bwd", [([x, w], cot)], (), dependent=dependent)
                us, how = timing.jax_device_us(step, consts, state, 300.0)
                rows.append({"shape": [m, n], "impl": impl, "dependent": dependent, "us": us, "timing": how})
                print(f"{m}x{n} {impl:14s} cotangent {'after y' if dependent else 'given  '}: {us:8.1f} us",
                      flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "dependent-cot.json"), "w") as f:
            json.dump({"gpu": str(jax.devices()[0].device_kind), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
