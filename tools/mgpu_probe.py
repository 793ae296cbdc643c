"""The experts' grouped GEMMs of the JAX MoE step (`benchmarks.jax_moe_layer --experts-gemm mgpu`): jax's Mosaic
GPU `ragged_dot` and `transposed_ragged_dot` at the step's six GEMMs (the up and down projections' forward, dx
and weight gradient dw) on the xkern path's padded layout, each with candidate blocks.

    python -m tools.mgpu_probe [--sizes qwen3-moe] [--out DIR]

Prints each candidate's time (ms per call: a jitted call repeated, host wall over calls, median of 3; each call
is milliseconds of GEMM, so launch costs vanish) and TFLOP/s per GEMM, then, per form, the candidate fastest
over both projections as `jax_moe_layer --mgpu-blocks` takes it (also `<out>/mgpu-blocks-<size>.txt`, with the
JSON of every time). A candidate whose result differs from the default blocks' by more than bf16 rounding is
not chosen; one that does not compile (shared memory, registers) is listed as such.

Candidates (block_m, block_n, block_k, max_concurrent_steps, grid_block_n): the benchmark's default
(`MGPU_BLOCK`), wider output tiles, deeper K steps, more steps in flight, and grid_block_n > 1 (output tiles
taken in bands of columns: the weight tile is reread from L2 by neighbouring programs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

ROWS_CANDIDATES = ((128, 128, 64, 4, 1), (128, 128, 64, 4, 4), (128, 128, 64, 6, 4), (128, 128, 128, 3, 4),
                   (64, 256, 64, 4, 4), (64, 256, 64, 6, 4), (128, 192, 64, 4, 4), (128, 256, 64, 3, 4),
                   (64, 128, 64, 6, 4))
DW_CANDIDATES = ((128, 128, 64, 4, 1), (128, 128, 64, 4, 4), (128, 128, 128, 3, 1), (128, 128, 128, 4, 4),
                 (64, 128, 64, 6, 4), (128, 64, 128, 4, 4), (64, 256, 64, 4, 1))
KEYS = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")


def group_sizes(size: dict, align: int):
    """The xkern path's padded group sizes for the benchmark's inputs and router: each expert's copies rounded up
    to `align` rows, the buffer's tail (up to T * k + E * align rows) in the last group."""
    import jax.numpy as jnp

    from benchmarks.jax_moe_layer import inputs, routing

    inp = inputs(size)
    (t, k), e = (size["tokens"], size["top_k"]), size["experts"]
    _, ids = routing(inp["x"], inp["w_router"], k)
    counts = jnp.bincount(ids.reshape(-1), length=e)
    padded = (counts + align - 1) // align * align
    rows = t * k + e * align
    return padded.at[-1].add(rows - padded.sum()).astype(jnp.int32), rows


def gemms(size: dict, rows: int):
    """{name: (form, call(blocks) -> output, flops)} of the step's six GEMMs on random bf16 operands."""
    import inspect

    import jax
    import jax.numpy as jnp

    from benchmarks.jax_moe_layer import mgpu_kernels

    rows_kernel, weight_kernel = mgpu_kernels()
    transposes = "transpose_rhs" in inspect.signature(rows_kernel).parameters
    h, e, i = size["hidden"], size["experts"], size["inter"]
    keys = iter(jax.random.split(jax.random.key(1), 8))

    def normal(*shape):
        return jax.random.normal(next(keys), shape, jnp.bfloat16)

    x, h_rows, dy_up, dy_down = normal(rows, h), normal(rows, i), normal(rows, 2 * i), normal(rows, h)
    w13, w2 = normal(e, h, 2 * i), normal(e, i, h)

    def rows_call(a, w, transposed):
        if transposed and not transposes:
            w, transposed = w.swapaxes(1, 2), False
        extra = {"transpose_rhs": True} if transposed else {}
        return lambda gs, blocks: rows_kernel(a, w, group_sizes=gs, **blocks, **extra)

    def dw_call(a, dy):
        return lambda gs, blocks: weight_kernel(a, dy, group_sizes=gs, **blocks)

    return {"up forward": ("forward", rows_call(x, w13, False), 2 * rows * h * 2 * i),
            "down forward": ("forward", rows_call(h_rows, w2, False), 2 * rows * i * h),
            "up dx": ("dx", rows_call(dy_up, w13, True), 2 * rows * h * 2 * i),
            "down dx": ("dx", rows_call(dy_down, w2, True), 2 * rows * i * h),
            "up dw": ("dw", dw_call(x, dy_up), 2 * rows * h * 2 * i),
            "down dw": ("dw", dw_call(h_rows, dy_down), 2 * rows * i * h)}


def time_ms(fn, *args, calls: int = 10, repeats: int = 3) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return 1e3 * statistics.median(times)


def probe(size: dict, align: int, log) -> dict:
    import jax
    import numpy as np

    gs, rows = group_sizes(size, align)
    results = {}
    for name, (form, call, flops) in gemms(size, rows).items():
        default = None
        for cand in ROWS_CANDIDATES if form != "dw" else DW_CANDIDATES:
            blocks = dict(zip(KEYS, cand, strict=True))
            label = ",".join(f"{k}={v}" for k, v in blocks.items())
            fn = jax.jit(lambda gs, blocks=blocks, call=call: call(gs, blocks))
            try:
                ms = time_ms(fn, gs)
                out = np.asarray(fn(gs), np.float32)
            except Exception as err:  # noqa: BLE001 - a candidate that does not compile is a finding
                log(f"{name:13s} {label}: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
                continue
            if default is None:
                default, scale = out, float(np.abs(out).max())
            ok = bool(np.isfinite(out).all() and np.abs(out - default).max() <= 2e-2 * scale)
            results.setdefault(name, {})[label] = {"form": form, "ms": ms, "tflops": flops / ms / 1e9, "ok": ok}
            log(f"{name:13s} {label}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s{'' if ok else ' [differs]'}")
    return results


def best(results: dict) -> tuple[dict, str]:
    """Per form, the candidate with the least time summed over both projections (every one of them ok)."""
    chosen, parts = {}, []
    for form in ("forward", "dx", "dw"):
        names = [n for n, r in results.items() if next(iter(r.values()))["form"] == form]
        labels = set.intersection(*(set(results[n]) for n in names)) if names else set()
        labels = [lab for lab in labels if all(results[n][lab]["ok"] for n in names)]
        if not labels:
            continue
        pick = min(labels, key=lambda lab: sum(results[n][lab]["ms"] for n in names))
        chosen[form] = {"blocks": pick, "ms": sum(results[n][pick]["ms"] for n in names)}
        parts += [f"{form}.{kv}" for kv in pick.split(",")]
    return chosen, ",".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="qwen3-moe", help="comma-separated sizes of benchmarks.moe_layer.SIZES")
    parser.add_argument("--out", help="directory for mgpu-blocks-<size>.txt and mgpu-probe-<size>.json")
    args = parser.parse_args(argv)

    from benchmarks.jax_moe_layer import mgpu_kernels
    from benchmarks.moe_layer import ALIGN, SIZES

    if mgpu_kernels() is None:
        print("this jax has no Mosaic GPU ragged_dot kernels")
        return 1
    for label in args.sizes.split(","):
        results = probe(SIZES[label], ALIGN, lambda line: print(line, flush=True))
        chosen, text = best(results)
        for form, c in chosen.items():
            print(f"{label} {form}: {c['blocks']} ({c['ms']:.3f} ms over both projections)")
        print(f"{label} --mgpu-blocks {text}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"mgpu-blocks-{label}.txt"), "w") as f:
                f.write(text + "\n")
            with open(os.path.join(args.out, f"mgpu-probe-{label}.json"), "w") as f:
                json.dump({"size": label, **SIZES[label], "align": ALIGN, "chosen": chosen, "results": results}, f,
                          indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
