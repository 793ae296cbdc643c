"""Does where the buffers lie change a kernel's device time? The same binary has timed 4-6 % apart between
the two front ends (the backward at bf16 256 and 3072, entry 17/18 of docs/benchmarks.md) and between two
torch tools (the backward at 128: 111 against 117 µs), with no difference in the code or the timing method.
Suspect: the relative placement of x, dy and dx in DRAM (which channels a row's three streams hit at once).

This launches xkern's RMSNorm recipe (every step, the dw reduction included) on buffers carved from one
pool at chosen gaps, so that only their placement changes, and times each layout as the sweep times a call
(a CUDA graph under do_bench, L2 flushed). Device µs per call, per width and layout.

    python -m benchmarks.placement [--widths 128,256,3072,4096] [--pass bwd] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os

# Gaps in bytes before each buffer, in the recipe's order (inputs x, w, dy, then each step's outputs).
# "packed": back to back; the others shift one stream against the rest.
LAYOUTS = {
    "packed": {},
    "dy +64 KiB": {"dy": 1 << 16},
    "dy +1 MiB": {"dy": 1 << 20},
    "dx +64 KiB": {"dx": 1 << 16},
    "dx +1 MiB": {"dx": 1 << 20},
    "dy +4 KiB, dx +8 KiB": {"dy": 1 << 12, "dx": 1 << 13},
}
ALIGN = 256  # every buffer 256-byte aligned, as the allocators place them (the kernels' binaries need 16)


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def carve(pool, layout: dict, buffers: list[tuple[str, tuple, object]]) -> dict:
    """{name: tensor} of `buffers` ((name, shape, torch dtype) in order) laid out in the uint8 `pool`, each
    after the gap `layout` gives it (0 by default)."""
    out, at = {}, 0
    for name, shape, dtype in buffers:
        at += layout.get(name, 0)
        at = -(-at // ALIGN) * ALIGN
        n = _nbytes(shape, dtype)
        out[name] = pool[at:at + n].view(dtype).view(shape)
        at += n
    if at > pool.numel():
        raise ValueError(f"the pool holds {pool.numel()} bytes; this layout needs {at}")
    return out


def _buffers(pass_: str, m: int, n: int, dtype: str):
    """(recipe, [(name, shape, torch dtype)] of its inputs then its steps' outputs)."""
    from torch_api._launch import DTYPES
    from xkern import rms_norm as XR

    dt = DTYPES[dtype]
    if pass_ == "fwd":
        recipe, inputs = XR.rms_norm_fwd_recipe(m, n, 1e-6, dtype, dtype), [("x", (m, n), dt), ("w", (n,), dt)]
    else:
        recipe = XR.rms_norm_bwd_recipe(m, n, 1e-6, dtype, dtype)
        inputs = [("x", (m, n), dt), ("w", (n,), dt), ("dy", (m, n), dt)]
    return recipe, inputs + [(b.name, b.shape, DTYPES[b.dtype]) for step in recipe.steps for b in step.outputs]


def pool_bytes(buffers: list) -> int:
    """Bytes that hold `buffers` under every layout."""
    gaps = max(sum(layout.values()) for layout in LAYOUTS.values())
    return sum(_nbytes(shape, dt) for _, shape, dt in buffers) + gaps + ALIGN * (len(buffers) + 1)


def recipe_call(recipe, buffers: list, layout: dict, pool, n_inputs: int):
    """A zero-argument call launching the recipe's steps on `buffers` carved from `pool` by `layout` (the
    inputs filled with fresh random values first)."""
    import torch

    from xkern.testing import launch

    bufs = carve(pool, layout, buffers)
    gen = torch.Generator(device=pool.device).manual_seed(7)
    for name, shape, _ in buffers[:n_inputs]:
        bufs[name].copy_(torch.randn(shape, generator=gen, device=pool.device))

    def call():
        for step in recipe.steps:
            launch(step.launch, *(bufs[i] for i in step.inputs), *(bufs[b.name] for b in step.outputs),
                   **step.scalars)
        return [bufs[r] for r in recipe.results]
    return call


def measure(widths: list[int], pass_: str, elems: int, device: str, log=print) -> list[dict]:
    """Per width, every layout of `LAYOUTS` in one pool (only the gaps move the buffers): device µs per call
    and whether its results equal the packed layout's bit for bit (they must: the same math)."""
    import torch

    from benchmarks import timing

    rows = []
    for n in widths:
        m = max(1, elems // n)
        recipe, buffers = _buffers(pass_, m, n, "bfloat16")
        pool = torch.empty(pool_bytes(buffers), dtype=torch.uint8, device=device)
        first = None
        for name, layout in LAYOUTS.items():
            call = recipe_call(recipe, buffers, layout, pool, 2 if pass_ == "fwd" else 3)
            got = [t.clone() for t in call()]
            first = first or got
            us = timing.torch_device_us(lambda call=call: [call], eager_fallback=False)[0]
            row = {"pass": pass_, "shape": [m, n], "layout": name, "us": us,
                   "same_result": all(torch.equal(a, b) for a, b in zip(got, first, strict=True))}
            log(json.dumps(row))
            rows.append(row)
        del pool
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="128,256,3072,4096")
    parser.add_argument("--pass", dest="pass_", default="bwd", choices=("fwd", "bwd"))
    parser.add_argument("--elems", type=int, default=1 << 26)
    parser.add_argument("--out")
    args = parser.parse_args()
    import torch

    from benchmarks import timing

    device = "cuda" if torch.cuda.is_available() else "cpu"
    timing.set_smoke(device == "cpu")  # CPU: runs once, no timing is a measurement
    rows = measure([int(w) for w in args.widths.split(",")], args.pass_, args.elems, device)
    if args.out:
        with open(os.path.join(args.out, f"placement-{args.pass_}.json"), "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
