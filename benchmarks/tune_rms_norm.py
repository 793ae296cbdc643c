"""Offline sweep of RMSNorm launch configurations on the GPU (what the fixed plans in xkern/ come from).

    python -m benchmarks.tune_rms_norm [--quick]

Times each candidate (kernel, BLOCK_M, BLOCK_N, warps, grid) with do_bench (median), prints GB/s over the
minimum bytes and the fraction of the measured copy ceiling, and the current plan's figure beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton

from torch_api._launch import launch as launch_plan
from xkern import rms_norm as K
from xkern.launch import Launch, cdiv, next_pow2

SHAPES = [(262144, 128), (32768, 128), (262144, 64), (65536, 256), (8192, 2048), (32768, 4096), (8192, 8192),
          (4096, 16384), (2048, 32768), (1024, 65536)]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e-3


def copy_ceiling() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / bench(lambda: b.copy_(a)) / 1e9


EPS = 1e-6


def _fixed(n):
    return {"EPS": EPS, "ROW_ALIGN": K.row_align(n)}


def fwd_candidates(m, n):
    bn = next_pow2(n)
    out = []
    if n >= 16384:
        out += [Launch(K._rms_norm_fwd_chunked_kernel, (m,), w, {**_fixed(n), "BLOCK_N": c}) for c in (2048, 4096, 8192)
                for w in (4, 8, 16)]
    for bm in (1, 2, 4, 8, 16, 32, 64, 128):
        if bm * bn > 65536 or bm * bn < 256:
            continue
        for w in (1, 2, 4, 8, 16, 32):
            per_thread = bm * bn // (32 * w)
            if 8 <= per_thread <= 64:
                out.append(Launch(K._rms_norm_fwd_kernel, (cdiv(m, bm),), w,
                                  {**_fixed(n), "BLOCK_M": bm, "BLOCK_N": bn}))
    return out


def bwd_candidates(m, n):
    bn = next_pow2(n)
    out = []
    for c in (2048, 4096, 8192):
        if n > 8192:
            for w in (8, 16):
                for g in (66, 132, 264):
                    out.append(Launch(K._rms_norm_bwd_chunked_kernel, (min(m, g), 1), w, {**_fixed(n), "BLOCK_N": c}))
    if bn <= 32768:
        for bm in (1, 2, 4, 8, 16, 32, 64):
            if bm * bn > 32768 or bm * bn < 256:
                continue
            for w in (2, 4, 8, 16, 32):
                per_thread = bm * bn // (32 * w)
                if not 8 <= per_thread <= 64:
                    continue
                for ppsm in (1, 2, 4, 8, 16):
                    g = min(cdiv(m, bm), 132 * ppsm)
                    out.append(Launch(K._rms_norm_bwd_kernel, (g, 1), w, {**_fixed(n), "BLOCK_M": bm, "BLOCK_N": bn}))
    return out


def run_fwd(launch, x, w, y):
    m, n = x.shape
    launch_plan(launch, x, w, y, n_rows=m, n_cols=n, x_row_stride=n, y_row_stride=n)


def run_bwd(launch, reduce, x, w, dy, dx, dw):
    m, n = x.shape
    partial = torch.empty((launch.grid[0], n), dtype=torch.float32, device="cuda")

    def fn():
        launch_plan(launch, x, w, dy, dx, partial, n_rows=m, n_cols=n, x_row_stride=n, dy_row_stride=n,
                    dx_row_stride=n)
        launch_plan(reduce, partial, dw, n_partials=launch.grid[0], n_cols=n)
    return fn


def describe(launch):
    return f"{launch.kernel.fn.__name__[10:]} {launch.constexprs} w{launch.num_warps} g{launch.grid[0]}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--passes", default="fwd,bwd")
    p.add_argument("--budget", type=float, default=18.0, help="seconds of sweeping per shape and pass")
    args = p.parse_args()
    ceiling = copy_ceiling()
    print(f"copy ceiling {ceiling:.0f} GB/s", flush=True)
    results = []

    def sweep(name, shape, nbytes, plan, cands, make_fn):
        """Time the plan (first) and each candidate within the budget; record plan vs best."""
        timed, t0 = [], time.time()
        for c in [plan] + cands:
            if time.time() - t0 > args.budget:
                break
            try:
                timed.append((bench(make_fn(c)), c))
            except Exception as e:  # a candidate that does not compile (registers) is just skipped
                print(f"  skip {describe(c)}: {type(e).__name__}", file=sys.stderr)
        (plan_t, _), (best_t, best) = timed[0], min(timed, key=lambda t: t[0])
        row = {"pass": name, "shape": list(shape), "plan": describe(plan), "best": describe(best),
               "plan_frac": nbytes / plan_t / 1e9 / ceiling, "best_frac": nbytes / best_t / 1e9 / ceiling}
        results.append(row)
        print(f"{name} {shape[0]}x{shape[1]}: plan {row['plan_frac']:.3f} [{row['plan']}]  "
              f"best {row['best_frac']:.3f} [{row['best']}]", flush=True)

    for m, n in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        y, dx, dw = torch.empty_like(x), torch.empty_like(x), torch.empty_like(w)
        if "fwd" in args.passes:
            sweep("fwd", (m, n), 2 * x.numel() * 2, K.plan_rms_norm_fwd(m, n, EPS),
                  [] if args.quick else fwd_candidates(m, n), lambda c, x=x, w=w, y=y: lambda: run_fwd(c, x, w, y))
        if "bwd" in args.passes:
            plan, reduce = K.plan_rms_norm_bwd(m, n, EPS)
            sweep("bwd", (m, n), 3 * x.numel() * 2, plan, [] if args.quick else bwd_candidates(m, n),
                  lambda c, a=(reduce, x, w, dy, dx, dw): run_bwd(c, *a))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ceiling_gbs": ceiling, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
