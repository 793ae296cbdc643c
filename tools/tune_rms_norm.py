"""Offline sweep of RMSNorm launch configurations on the GPU (what the fixed plans in xkern/ come from).

    python -m tools.tune_rms_norm [--passes fwd,bwd,cols,reduce] [--out results.json]

Times each candidate with `timing.do_bench_us` (median, L2 flushed before each call) and prints the
fraction of the copy ceiling over the minimum bytes, the current plan's figure beside the best. Candidates
are compiled first in parallel worker processes (Triton's disk cache), so the sweep itself only times.

- fwd: the forward kernels (tile rows, warps; grid of the persistent chunked kernel for the widest rows).
- bwd: the joint backward kernel with the dw reduction its partial count needs; the plan's
  backward split into kernel and reduction, to show where the time goes.
- cols: the wide-row backward's two steps (row statistics; the column-split kernel) timed apart.
- reduce: the dw reduction alone over partial counts and widths.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import sys
import time

import torch

from benchmarks import timing
from benchmarks.rms_norm import EPS, SHAPES
from xkern.device import properties
from xkern.launch import Launch, cdiv, next_pow2, row_align
from xkern.rms_norm import kernels as KN
from xkern.rms_norm import plans as K
from xkern.testing import launch as launch_plan

NUM_SMS = properties().num_sms  # this GPU's (the plans' own grids read it there too)

DEVICE = os.environ.get("XKERN_TUNE_DEVICE", "cuda")  # "cpu": a smoke run under TRITON_INTERPRET=1


def bench(fn) -> float:
    """Seconds: a shorter do_bench than the benchmark's (thousands of candidates)."""
    return timing.do_bench_us(fn, warmup_ms=5, rep_ms=25) * 1e-6


def _fixed(n, eps=True):
    fixed = {"ROW_ALIGN": row_align(n), "ONE_COL": n == 1, "VARIANT": K.VARIANTS["llama"]}
    return {"EPS": EPS, **fixed} if eps else fixed


def _split_blocks(n, max_per_thread):
    """(BLOCK_N, warps) for rows of n in SPLIT = cdiv(n, BLOCK_N) blocks: at most 16 blocks, 2 to 16
    elements per thread per block and at most `max_per_thread` in all."""
    out = []
    for b in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
        if b > next_pow2(n) or cdiv(n, b) > 16:
            continue
        out += [(b, w) for w in (1, 2, 4, 8, 16, 32)
                if 2 <= b // (32 * w) <= 16 and 4 <= cdiv(n, b) * b // (32 * w) <= max_per_thread]
    return out


def fwd_candidates(m, n):
    bn = next_pow2(n)
    out = []
    if n >= 32768:
        out += [Launch(KN._rms_norm_fwd_chunked_kernel, (min(m, g),), w, {**_fixed(n), "BLOCK_N": c})
                for c in (4096, 8192, 16384) for w in (8, 16, 32) for g in (NUM_SMS, 2 * NUM_SMS, 4 * NUM_SMS, m)
                if 8 <= c // (32 * w) <= 32]
    if bn > 256:  # the row kernel: SPLIT blocks of BLOCK_N per row (a power of two: one block)
        out += [Launch(KN._rms_norm_fwd_row_kernel, (m,), w,
                       {**_fixed(n), "BLOCK_N": b, "SPLIT": cdiv(n, b), "RELOAD": reload})
                for b, w in _split_blocks(n, 64) for reload in (False, True)]
    out += [Launch(KN._rms_norm_fwd_kernel, (cdiv(m, bm),), w, {**_fixed(n), "BLOCK_M": bm, "BLOCK_N": bn})
            for bm in (1, 2, 4, 8, 16, 32, 64) for w in (1, 2, 4, 8, 16, 32)
            if 512 <= bm * bn <= 32768 and bn <= 2048 and 8 <= bm * bn // (32 * w) <= 32]
    return out


def bwd_candidates(m, n):
    bn = next_pow2(n)
    out = []
    for bm in (1, 2, 4, 8, 16, 32, 64, 128):
        if bm * bn > 16384 or bm * bn < 512 or bm > m or (n >= 512 and bm > 2):  # wide: 1-row tiles won
            continue
        for w in (1, 2, 4, 8, 16, 32):
            if not 4 <= bm * bn // (32 * w) <= 32:
                continue
            tiles = cdiv(m, bm)
            for ppsm in (1, 2, 4, 8, 16):
                out += [Launch(KN._rms_norm_bwd_kernel, (min(tiles, NUM_SMS * ppsm), 1), w,
                               {**_fixed(n), "BLOCK_M": bm, "BLOCK_N": bn, "PREFETCH": prefetch})
                        for prefetch in (True, False)]
                if tiles <= NUM_SMS * ppsm:
                    break
    if n != bn and n < 512:  # tiles of several rows in SPLIT blocks of BLOCK_N (80 = 5 x 16)
        for b in (16, 32, 64, 128, 256):
            if b >= bn or cdiv(n, b) > 8:
                continue
            for bm in (8, 16, 32, 64):
                for w in (1, 2, 4):
                    if not (2 <= bm * b // (32 * w) <= 16 and cdiv(n, b) * bm * b // (32 * w) <= 32):
                        continue
                    out += [Launch(KN._rms_norm_bwd_split_kernel, (min(cdiv(m, bm), NUM_SMS * ppsm), 1), w,
                                   {**_fixed(n), "BLOCK_M": bm, "BLOCK_N": b, "SPLIT": cdiv(n, b), "PREFETCH": True})
                            for ppsm in (2, 4, 8)]
    if n != bn and n >= 512:  # one row in SPLIT blocks of BLOCK_N
        for b, w in _split_blocks(n, 32):
            if b == bn:
                continue
            for ppsm in (1, 2, 4):
                out += [Launch(KN._rms_norm_bwd_split_kernel, (min(m, NUM_SMS * ppsm), 1), w,
                               {**_fixed(n), "BLOCK_M": 1, "BLOCK_N": b, "SPLIT": cdiv(n, b), "PREFETCH": prefetch})
                        for prefetch in (True, False)]
    if bn >= 4096:  # the row kernel (rows read twice)
        out += [Launch(KN._rms_norm_bwd_row_kernel, (min(m, NUM_SMS * ppsm), 1), w,
                       {**_fixed(n), "BLOCK_N": bn, "SPLIT": 1, "HOLD_W": True})
                for w in (8, 16, 32) for ppsm in (1, 2)]
    return out


def stats_candidates(m, n):
    return [Launch(KN._rms_norm_bwd_stats_kernel, (m, 1), w, {**_fixed(n), "BLOCK_N": c})
            for c in (2048, 4096, 8192) for w in (4, 8, 16) if 4 <= c // (32 * w) <= 32 and c <= next_pow2(n)]


def cols_candidates(m, n):
    out = []
    for bn in (512, 1024, 2048, 4096):
        for bm in (1, 2, 4, 8):
            for w in (4, 8, 16):
                if not 4 <= bm * bn // (32 * w) <= 32 or bn > next_pow2(n):
                    continue
                for programs in (2 * NUM_SMS, 4 * NUM_SMS, 8 * NUM_SMS):
                    groups = max(1, min(cdiv(m, bm), programs // cdiv(n, bn)))
                    out.append(Launch(KN._rms_norm_bwd_cols_kernel, (cdiv(n, bn), groups, 1), w,
                                      {**_fixed(n, eps=False), "BLOCK_M": bm, "BLOCK_N": bn}))
    return out


def reduce_candidates(n):
    return [Launch(KN._dw_reduce_kernel, (cdiv(n, bn), 1), w, {"ROW_ALIGN": row_align(n), "BLOCK_P": bp, "BLOCK_N": bn})
            for bn in (16, 32, 64) for bp in (64, 128, 256, 512) for w in (2, 4, 8)
            if bn <= next_pow2(n) and 4 <= bp * bn // (32 * w) <= 64]


# --- running one launch on the shapes' buffers -------------------------------------------------------------


def arrays_for(launch, buf):
    """The kernel's arrays, in order, from the shape's buffers (partials sized for the launch)."""
    name = launch.kernel.fn.__name__
    m, n = buf["x"].shape
    if name.startswith("_rms_norm_fwd"):
        return [buf["x"], buf["w"], buf["y"]]
    if name == "_rms_norm_bwd_stats_kernel":
        return [buf["x"], buf["w"], buf["dy"], buf["stats"]]
    if name == "_dw_reduce_kernel":
        return [buf["partial"][: buf["n_partials"] * n].view(-1, n), buf["dw"]]
    partial = buf["partial"][: partials_of(launch) * n].view(-1, n)
    if name == "_rms_norm_bwd_cols_kernel":
        return [buf["x"], buf["w"], buf["dy"], buf["stats"], buf["dx"], partial]
    return [buf["x"], buf["w"], buf["dy"], buf["dx"], partial]


def partials_of(launch) -> int:
    return launch.grid[1] if launch.kernel.fn.__name__ == "_rms_norm_bwd_cols_kernel" else launch.grid[0]


def runner(launch, buf):
    m, n = buf["x"].shape
    arrays = arrays_for(launch, buf)
    scalars = dict(n_rows=m, n_cols=n, x_row_stride=n, y_row_stride=n, dy_row_stride=n, dx_row_stride=n,
                   n_partials=buf.get("n_partials", 0))
    return lambda: launch_plan(launch, *arrays, **scalars)


def buffers(m, n, max_partials=8 * NUM_SMS * 64):
    torch.manual_seed(0)
    x = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
    bf16 = dict(device=DEVICE, dtype=torch.bfloat16)
    return {"x": x, "w": torch.randn(n, **bf16), "dy": torch.randn_like(x), "y": torch.empty_like(x),
            "dx": torch.empty_like(x), "dw": torch.empty(n, **bf16),
            "stats": torch.empty(m, 2, device=DEVICE),
            "partial": torch.empty(min(max_partials, 4 * 1024 * 1024 * 1024 // (4 * n) // 8) * n, device=DEVICE)}


def _compile_one(job):
    name, grid, num_warps, constexprs, n = job
    launch = Launch(getattr(K, name), grid, num_warps, constexprs)
    buf = buffers(64, n, max_partials=64 * 32)
    small = dataclasses.replace(launch, grid=(1,) * len(launch.grid))
    if small.kernel.fn.__name__ == "_dw_reduce_kernel":
        buf["n_partials"] = 1
    try:
        runner(small, buf)()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as e:  # too many registers etc.: reported, then skipped in the sweep
        return f"{describe(launch)}: {type(e).__name__} {str(e)[:80]}"


def precompile(jobs):
    """Compile every candidate in up to 14 processes (fills Triton's disk cache; the timing process then loads)."""
    uniq = {}
    for launch, n in jobs:
        key = (launch.kernel.fn.__name__, tuple(sorted(launch.constexprs.items())), launch.num_warps, row_align(n))
        uniq[key] = (launch, n)
    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(14, os.cpu_count() or 1), mp_context=ctx) as pool:
        jobs = [(c.kernel.fn.__name__, c.grid, c.num_warps, c.constexprs, n) for c, n in uniq.values()]
        for err in pool.map(_compile_one, jobs):
            if err:
                print("  compile failed:", err, file=sys.stderr)
    print(f"precompiled {len(uniq)} binaries in {time.time() - t0:.0f} s", flush=True)


def describe(launch):
    name = launch.kernel.fn.__name__[1:].replace("_kernel", "")
    return f"{name} {launch.constexprs} w{launch.num_warps} g{launch.grid}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--passes", default="fwd,bwd,cols,reduce")
    p.add_argument("--shapes", default=None, help="e.g. 262144x128,1024x65536")
    args = p.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
    passes = args.passes.split(",")

    plans = {}
    jobs = []
    for m, n in shapes:
        plans[(m, n)] = (K.plan_rms_norm_fwd(m, n, EPS), K.plan_rms_norm_bwd(m, n, EPS))
        fwd, bwd = plans[(m, n)]
        cols = "cols" in passes and n >= 8192
        cands = {"fwd": [fwd] + fwd_candidates(m, n) if "fwd" in passes else [],
                 "bwd": [bwd.bwd] + (bwd_candidates(m, n) if n <= K.MAX_BWD_BLOCK else []) if "bwd" in passes else [],
                 "stats": stats_candidates(m, n) if cols else [], "cols": cols_candidates(m, n) if cols else []}
        plans[(m, n)] += (cands,)
        for c in [x for v in cands.values() for x in v] + [launch for launch in (bwd.stats, bwd.reduce) if launch]:
            jobs.append((c, n))
            if c.kernel.fn.__name__ in ("_rms_norm_bwd_kernel", "_rms_norm_bwd_split_kernel",
                                        "_rms_norm_bwd_row_kernel", "_rms_norm_bwd_cols_kernel"):
                jobs.append((K.plan_dw_reduce(partials_of(c), n), n))
    if "reduce" in passes:
        for n in (64, 128, 256, 2048, 16384, 65536):
            jobs += [(c, n) for c in reduce_candidates(n)]
    precompile(jobs)

    ceiling = timing.copy_ceiling(2**30)["gbps"]
    print(f"copy ceiling {ceiling:.0f} GB/s", flush=True)
    results = []

    def record(name, shape, nbytes, timed, plan_t=None):
        timed = [t for t in timed if t[0] is not None]
        best_t, best = min(timed, key=lambda t: t[0])
        top = sorted(timed, key=lambda t: t[0])[:3]
        row = {"pass": name, "shape": list(shape), "best": describe(best), "best_us": best_t * 1e6,
               "best_frac": nbytes / best_t / 1e9 / ceiling, "n_timed": len(timed),
               "top3": [(t * 1e6, describe(c)) for t, c in top],
               "all": [(t * 1e6, describe(c)) for t, c in sorted(timed, key=lambda t: t[0])]}
        if plan_t is not None:
            row.update(plan_us=plan_t * 1e6, plan_frac=nbytes / plan_t / 1e9 / ceiling)
        results.append(row)
        plan = f"plan {row['plan_frac']:.3f} ({row['plan_us']:.1f} us)  " if plan_t is not None else ""
        print(f"{name} {shape[0]}x{shape[1]}: {plan}best {row['best_frac']:.3f} ({best_t * 1e6:.1f} us) "
              f"[{row['best']}]  of {len(timed)}", flush=True)
        for t, c in top[1:]:
            print(f"    {t * 1e6:.1f} us [{describe(c)}]", flush=True)

    def timeit(fns):
        try:
            return bench(lambda: [f() for f in fns])
        except Exception as e:
            print(f"  failed: {type(e).__name__} {str(e)[:100]}", file=sys.stderr)
            return None

    for m, n in shapes:
        fwd, bwd, cands = plans[(m, n)]
        buf = buffers(m, n)
        io = m * n * 2
        if cands["fwd"]:
            timed = [(timeit([runner(c, buf)]), c) for c in cands["fwd"]]
            record("fwd", (m, n), 2 * io, timed, timed[0][0])
        if cands["bwd"]:

            def with_reduce(c, n=n, buf=buf):
                reduce = K.plan_dw_reduce(partials_of(c), n)
                b2 = {**buf, "n_partials": partials_of(c)}
                return [runner(c, buf), runner(reduce, b2)]

            plan_fns = ([runner(bwd.stats, buf)] if bwd.stats else []) + [runner(bwd.bwd, buf)]
            plan_t = timeit(plan_fns + [runner(bwd.reduce, {**buf, "n_partials": bwd.n_partials})])
            k_t = timeit(plan_fns)
            r_t = timeit([runner(bwd.reduce, {**buf, "n_partials": bwd.n_partials})])
            print(f"bwd {m}x{n}: plan split: kernels {k_t * 1e6:.1f} us + reduce {r_t * 1e6:.1f} us "
                  f"(P={bwd.n_partials})", flush=True)
            timed = [(timeit(with_reduce(c)), c) for c in cands["bwd"]]
            record("bwd+reduce", (m, n), 3 * io, timed, plan_t)
        if cands["cols"]:
            st = [(timeit([runner(c, buf)]), c) for c in cands["stats"]]
            record("stats", (m, n), 2 * io, st)
            ct = [(timeit([runner(c, buf)]), c) for c in cands["cols"]]
            record("cols", (m, n), 3 * io, ct)
            best_c = min((t for t in ct if t[0]), key=lambda t: t[0])[1]
            red = K.plan_dw_reduce(partials_of(best_c), n)
            best_s = min((t for t in st if t[0]), key=lambda t: t[0])[1]
            total = timeit([runner(best_s, buf), runner(best_c, buf),
                            runner(red, {**buf, "n_partials": partials_of(best_c)})])
            record("stats+cols+reduce", (m, n), 3 * io, [(total, best_c)])
        del buf
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        save(args.out, ceiling, results)  # after every shape: a run cut short keeps what it measured
    if "reduce" in passes:
        for n in (64, 128, 256, 2048, 16384, 65536):
            for parts in (132, 528, 2112):
                buf = {"partial": torch.randn(parts * n, device=DEVICE), "x": torch.empty(1, n), "n_partials": parts,
                       "dw": torch.empty(n, device=DEVICE, dtype=torch.bfloat16)}
                plan = K.plan_dw_reduce(parts, n)
                timed = [(timeit([runner(c, buf)]), c) for c in [plan] + reduce_candidates(n)]
                record(f"reduce P={parts}", (parts, n), parts * n * 4, timed, timed[0][0])
    save(args.out, ceiling, results)


def save(path, ceiling, results):
    if path:
        with open(path, "w") as f:
            json.dump({"ceiling_gbs": ceiling, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
