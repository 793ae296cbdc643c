"""Gated RMSNorm, declared to the runner: xkern's torch and JAX front ends against flash-linear-attention's
fused gated norm (fla-core, Triton), torch.compile of the Hugging Face forward, the eager HF forward, and the
same expression in jax.numpy under jit; forward, backward and forward + backward, bf16.

Shapes: Qwen3-Next / Qwen3.5 (4096-32768 tokens x 32 value heads x 128, the norm after the linear attention),
Kimi Linear (sigmoid gate, fp32 rounding, 8192 x 32 x 128), Mamba2 / Nemotron-H (width 4096 and 8192, 1 and 8
groups, gate first). Minimum bytes: forward reads x, z and w and writes y; backward reads x, z, dy and w and
writes dx, dz and dw. Checks: the FP64 oracle on evenly spaced rows for y, dx and dz and on every row for dw.

    python -m benchmarks.gated_rms_norm --out DIR       # on a GPU (~5 min); writes DIR/<gpu>-gated_rms_norm.json
    python -m benchmarks.gated_rms_norm --smoke         # every path at tiny sizes (CPU: the interpreter)
    python -m benchmarks.gated_rms_norm --sweep [--out DIR]  # the head-width schedules' candidates (~1 min)

`--sweep`: the narrow (128-wide) backward's and forward's candidate schedules (`SWEEP_BWD_TILES`,
`SWEEP_FWD_TILES`: the plans' `tile=`, constexprs and launch parameters of the same kernels) at Qwen3-Next's
8192 and 32768 tokens x 32 heads x 128, bf16, each checked against the oracle, then timed (do_bench median,
L2 flushed): µs and the fraction of the copy ceiling, the registers and how many programs an SM holds at once
(persistent grids need every program resident).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.runner import Case, Inputs, Op, run_case, sample_rows
from xkern import reference as R
from xkern.gated_rms_norm import FAMILIES
from xkern.gated_rms_norm.plans import BwdTile
from xkern.testing import to_numpy, torch_dtype

EPS = 1e-6
PASSES = ("fwd", "bwd", "fwd+bwd")
# (label, shape, family, activation, group size (None: the row))
MAIN = [(f"qwen3-next T={t}", (t, 32, 128), "norm-llama-then-gate", "silu", None) for t in (4096, 8192, 16384, 32768)]
MAIN += [("kimi-linear T=8192", (8192, 32, 128), "norm-fp32-then-gate", "sigmoid", None)]
MAIN += [(f"mamba2 T=8192 N={n} groups={g}", (8192, n), "gate-then-group-norm", "silu", n // g)
         for n in (4096, 8192) for g in (1, 8)]
SMOKE = [("qwen3-next smoke", (9, 4, 128), "norm-llama-then-gate", "silu", None),
         ("kimi-linear smoke", (5, 2, 64), "norm-fp32-then-gate", "sigmoid", None),
         ("mamba2 smoke", (6, 256), "gate-then-group-norm", "silu", 64)]
SAMPLE_ELEMS = 2**21
CHUNK_ELEMS = 2**18


def cases(mode: str) -> list[Case]:
    table = MAIN if mode in ("main", "quick") else SMOKE
    if mode == "quick":
        table = table[1:2] + table[-1:]
    return [Case("gated_rms_norm", shape, "bfloat16", PASSES,
                 {"label": label, "family": family, "activation": act, "group_size": group or shape[-1]})
            for label, shape, family, act, group in table]


def _options(case: Case) -> dict:
    norm_before_gate, _, rounding = FAMILIES[case.info["family"]]
    return dict(group_size=case.info["group_size"], norm_before_gate=norm_before_gate,
                activation=case.info["activation"], rounding=rounding)


def min_bytes(case: Case, pass_: str) -> int:
    elems, n = int(np.prod(case.shape)), case.shape[-1]
    size = np.dtype(R.np_dtype(case.dtype)).itemsize
    fwd = 3 * elems * size + n * size
    bwd = 5 * elems * size + 2 * n * size
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[pass_]


# ---------------------------------------------------------------------------------------------------
# Implementations


def hf_eager(case: Case):
    """The Hugging Face classes' forward (`torch_api.gated_rms_norm.reference_math`, which the HF probe matches
    bit for bit against each class), eager."""
    from torch_api.gated_rms_norm import reference_math

    return functools.partial(reference_math, eps=EPS, **_options(case))


def compiled_hf(case: Case):
    import torch

    backend = "inductor" if torch.cuda.is_available() else "aot_eager"
    return torch.compile(hf_eager(case), dynamic=False, fullgraph=True, backend=backend)


def xkern_torch(case: Case):
    from torch_api.gated_rms_norm import gated_rms_norm

    return functools.partial(gated_rms_norm, eps=EPS, **_options(case))


def xkern_jax(case: Case):
    from jax_api.gated_rms_norm import gated_rms_norm

    return functools.partial(gated_rms_norm, eps=EPS, **_options(case))


def xla(case: Case):
    """The HF expression in jax.numpy (`jax_api.gated_rms_norm.gated_math`; XLA fuses it under jit)."""
    from jax_api.gated_rms_norm import gated_math

    return functools.partial(gated_math, eps=EPS, **_options(case))


def fla(case: Case):
    """flash-linear-attention's fused gated norm: `rms_norm_gated` (norm, then the gate: silu or sigmoid) and,
    for the gate first with groups, `rmsnorm_fn(..., norm_before_gate=False)` (Mamba2's). Its math is fp32
    throughout (no intermediate rounding to bf16): checked against xkern's oracle, reported only."""
    try:
        if _options(case)["norm_before_gate"]:
            from fla.modules.fused_norm_gate import rms_norm_gated
        else:
            from fla.modules.layernorm_gated import rmsnorm_fn
    except Exception as err:  # noqa: BLE001 - optional peer
        return f"skipped: fla-core not importable ({type(err).__name__}: {err})"
    opts = _options(case)
    if opts["norm_before_gate"]:
        if opts["group_size"] != case.shape[-1]:
            return "skipped: fla's rms_norm_gated normalises whole rows"
        act = "sigmoid" if opts["activation"] == "sigmoid" else "swish"
        return lambda x, z, w: rms_norm_gated(x, z, w, None, activation=act, eps=EPS)
    return lambda x, z, w: rmsnorm_fn(x, w, None, z=z, eps=EPS, group_size=opts["group_size"], norm_before_gate=False)


def torch_impls(case: Case) -> dict:
    return {"xkern (torch)": xkern_torch(case), "HF eager": hf_eager(case), "torch.compile": compiled_hf(case),
            "fla": fla(case)}


def jax_impls(case: Case) -> dict:
    return {"xkern (jax)": xkern_jax(case), "jax.jit (XLA)": xla(case)}


# ---------------------------------------------------------------------------------------------------
# Inputs, oracle, check


def oracle(case: Case, x, z, w, dy, rows) -> dict:
    """FP64 truth on [rows, N] views: y, dx and dz at `rows`, dw and its tolerance over every row."""
    opts = _options(case)
    step = max(1, CHUNK_ELEMS // x.shape[1])

    def chunk(start):
        stop = min(start + step, x.shape[0])
        dx, dz, dw, tol = R.gated_rms_norm_bwd(x[start:stop], z[start:stop], w, dy[start:stop], EPS, **opts)
        keep = rows[(rows >= start) & (rows < stop)] - start
        return dx[keep], dz[keep], dw, tol

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        parts = list(pool.map(chunk, range(0, x.shape[0], step)))
    return {"rows": rows, "y": R.gated_rms_norm_fwd(x[rows], z[rows], w, EPS, **opts),
            "y_tol": R.gated_rms_norm_fwd_tol(x[rows], z[rows], w, EPS, **opts),
            "dx": np.concatenate([p[0] for p in parts]), "dz": np.concatenate([p[1] for p in parts]),
            "dw": sum(p[2] for p in parts), "dw_tol": sum(p[3] for p in parts)}


def make(case: Case, device: str, n_sets: int) -> Inputs:
    import torch

    dt = torch_dtype(case.dtype)
    n = case.shape[-1]
    gen = torch.Generator(device=device).manual_seed(int(np.prod(case.shape)) % 2**31)
    w = (1.0 + 0.3 * torch.randn(n, generator=gen, device=device)).to(dt)
    sets = [([torch.randn(case.shape, generator=gen, device=device, dtype=dt),
              2.0 * torch.randn(case.shape, generator=gen, device=device, dtype=dt), w],
             torch.randn(case.shape, generator=gen, device=device, dtype=dt)) for _ in range(n_sets)]
    (x, z, _), dy = sets[0]
    flat = [to_numpy(t.reshape(-1, n)) for t in (x, z, dy)]
    rows = sample_rows(flat[0].shape[0], SAMPLE_ELEMS, n)
    case.info["checked_rows"] = len(rows)
    return Inputs(sets, ref=oracle(case, flat[0], flat[1], to_numpy(w), flat[2], rows))


def check(case: Case, ref: dict, got: dict) -> tuple[dict, str | None]:
    """y, dx, dz (at the oracle's rows) and dw, those of them in `got`, against the oracle."""
    import torch

    n = case.shape[-1]
    rows = torch.from_numpy(ref["rows"]).to(next(iter(got.values())).device)
    outputs = {kind: out if kind == "dw" else out.reshape(-1, n)[rows] for kind, out in got.items()}
    stats = {}
    for kind, out in outputs.items():
        try:
            abs_ok = {"y": ref["y_tol"], "dw": ref["dw_tol"]}.get(kind)
            stats[kind] = R.check(to_numpy(out), ref[kind], {"y": "fwd", "dz": "dx"}.get(kind, kind), abs_ok=abs_ok)
        except AssertionError as err:
            return stats, f"{kind}: {err}"
    return stats, None


OP = Op("gated_rms_norm", cases, make, check, min_bytes, torch_impls, jax_impls, grad_names=("dx", "dz", "dw"))


# ---------------------------------------------------------------------------------------------------
# The head width's schedules: candidates of the plans' `tile=` (same kernels, constexprs and launch parameters)

SWEEP_SHAPES = [(8192, 32, 128), (32768, 32, 128)]
SWEEP_SMOKE = [(8, 4, 128)]
# BwdTile(BLOCK_M, num_warps, programs per SM, PREFETCH, STAGES, DW_TILE); the first: the schedule before
# PREFETCH and DW_TILE (4 per SM of 8 x 128 tiles, nothing loaded ahead, dw summed over rows a block)
SWEEP_BWD_TILES = [BwdTile(*t) for t in (
    (8, 4, 4, False, 1, False), (8, 4, 4, True, 1, False), (8, 4, 4, False, 1, True), (8, 4, 4, True, 1, True),
    (8, 4, 5, True, 1, True), (8, 4, 4, False, 2, True), (8, 4, 3, False, 3, True), (8, 4, 4, False, 3, True),
    (16, 4, 3, True, 1, True), (16, 4, 2, True, 1, True), (16, 4, 2, False, 2, False), (16, 2, 4, True, 1, False),
    (8, 2, 6, True, 1, True), (32, 4, 2, True, 1, False), (4, 2, 10, True, 1, True), (4, 1, 12, True, 1, True))]
# (BLOCK_M, num_warps, programs per SM: 0 for a program a tile, else persistent, loading the next tile ahead);
# the first: the plan's rule
SWEEP_FWD_TILES = [(16, 4, 0), (16, 2, 0), (8, 2, 0), (8, 1, 0), (4, 1, 0), (32, 4, 0), (32, 8, 0), (64, 8, 0),
                   (16, 4, 4), (8, 2, 8), (16, 2, 4), (32, 4, 2), (32, 8, 2), (8, 1, 8)]
SM_REGISTERS = 64 * 1024  # a register file, sm_80 to sm_120


def _resident(compiled, num_warps: int) -> tuple[int, int, int]:
    """(registers a thread, bytes spilled, programs an SM holds at once by registers and shared memory)."""
    compiled._init_handles()
    per_warp = -(-compiled.n_regs * 32 // 256) * 256  # allocated in units of 256 registers a warp
    import torch

    smem = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_multiprocessor", 228 * 1024)
    by_smem = smem // compiled.metadata.shared if compiled.metadata.shared else 32
    return compiled.n_regs, compiled.n_spills, min(SM_REGISTERS // (per_warp * num_warps), by_smem, 64 // num_warps)


def _timed(launches, arrays, scalars, smoke: bool) -> tuple[float, tuple[int, int, int] | None]:
    """Device time of `launches` in order (each on its named arrays; `timing.torch_device_us`, a CUDA graph
    as the benchmark's torch rows), and the first launch's residency."""
    from benchmarks import timing
    from xkern.launch import bind
    from xkern.testing import launch

    def run():
        for plan, names in launches:
            launch(plan, *[arrays[name] for name in names], **scalars)

    us, _ = timing.torch_device_us(lambda: [run])
    if smoke:
        return us, None
    plan, names = launches[0]
    compiled = plan.kernel.warmup(**bind(plan, [arrays[name] for name in names], scalars), grid=plan.grid,
                                  num_warps=plan.num_warps, num_stages=plan.num_stages)
    return us, _resident(compiled, plan.num_warps)


def sweep(smoke: bool, gbps: float, say) -> list[dict]:
    """Every candidate at every sweep shape: checked against the oracle, timed; one row each."""
    import torch

    from xkern.gated_rms_norm import plan_gated_rms_norm_bwd, plan_gated_rms_norm_fwd
    from xkern.gated_rms_norm.plans import bwd_tile

    rows = []
    for shape in SWEEP_SMOKE if smoke else SWEEP_SHAPES:
        case = Case("gated_rms_norm", shape, "bfloat16", ("fwd", "bwd"),
                    {"label": f"qwen3-next T={shape[0]}", "family": "norm-llama-then-gate", "activation": "silu",
                     "group_size": shape[-1]})
        inputs = make(case, "cuda" if torch.cuda.is_available() else "cpu", 1)
        (x, z, w), dy = inputs.sets[0]
        n = shape[-1]
        m = x.numel() // n
        opts = {k: v for k, v in _options(case).items() if k != "group_size"}
        arrays = {"x": x.view(m, n), "z": z.view(m, n), "w": w, "dy": dy.view(m, n), "y": torch.empty_like(x),
                  "dx": torch.empty_like(x), "dz": torch.empty_like(x), "dw": torch.empty_like(w)}
        scalars = dict(n_rows=m, group_size=n, x_row_stride=n, z_row_stride=n, dy_row_stride=n, dx_row_stride=n,
                       y_row_stride=n, n_cols=n)
        work = [("bwd", t) for t in SWEEP_BWD_TILES]
        work += [("fwd", t) for t in SWEEP_FWD_TILES]
        if smoke:  # the before schedule, the rules' tiles, a pipelined and a persistent candidate
            work = [work[i] for i in (0, 3, 7, len(SWEEP_BWD_TILES), -1)]
        for pass_, tile in work:
            if pass_ == "bwd":
                plan = plan_gated_rms_norm_bwd(m, n, n, EPS, **opts, tile=tile)
                arrays["partial"] = torch.empty(plan.n_partials, n, dtype=torch.float32, device=x.device)
                scalars["n_partials"] = plan.n_partials
                launches = [(plan.bwd, ("x", "z", "w", "dy", "dx", "dz", "partial")), (plan.reduce, ("partial", "dw"))]
                outs = ("dx", "dz", "dw")
            else:
                launches = [(plan_gated_rms_norm_fwd(m, n, n, EPS, **opts, tile=tile), ("x", "z", "w", "y"))]
                outs = ("y",)
            for name in outs:
                arrays[name].fill_(float("nan"))
            row = {"label": case.info["label"], "shape": list(shape), "pass": pass_, "tile": list(tile),
                   "default": tuple(tile) == tuple(bwd_tile(n) if pass_ == "bwd" else SWEEP_FWD_TILES[0])}
            try:
                us, resident = _timed(launches, arrays, scalars, smoke)
                _, failed = check(case, inputs.ref, {k: arrays[k].view(m, n) if k != "dw" else arrays[k]
                                                     for k in outs})
            except Exception as err:  # noqa: BLE001 - a candidate that fails to compile or run: said, next
                rows.append({**row, "status": f"error: {type(err).__name__}: {str(err)[:200]}"})
                say(f"{row['label']} {pass_} {tile}: {rows[-1]['status']}")
                continue
            nbytes = min_bytes(case, pass_)
            row.update(us=us, ceiling_frac=nbytes / us / 1e3 / gbps, check=failed or "pass",
                       status="ok" if not failed else "check failed")
            rows.append(row)
            placed = ""
            if resident:
                wave = " (SECOND WAVE)" if resident[2] < tile[2] else ""
                placed = f"  regs {resident[0]:3d} spill {resident[1]} resident/SM {resident[2]}{wave}"
                row.update(regs=resident[0], spill_bytes=resident[1], resident_per_sm=resident[2])
            say(f"{row['label']:22s} {pass_} {str(tuple(tile)):30s} {us:8.1f} us  {row['ceiling_frac']:.3f} of ceiling"
                f"{'  (default)' if row['default'] else ''}{placed}  {row['check']}")
    for label in dict.fromkeys(r["label"] for r in rows):
        for pass_ in ("bwd", "fwd"):
            ok = [r for r in rows if r["label"] == label and r["pass"] == pass_ and r.get("status") == "ok"]
            if ok:
                best = min(ok, key=lambda r: r["us"])
                default = ", ".join(f"default {r['us']:.1f} us" for r in ok if r["default"])
                say(f"best {label} {pass_}: {tuple(best['tile'])} {best['us']:.1f} us ({best['ceiling_frac']:.3f} of "
                    f"ceiling); {default or 'default not run'}")
    return rows


def main(argv=None) -> int:
    import torch

    from benchmarks import timing
    from benchmarks.machine import commit, gpu_kind, kernels_sha
    from benchmarks.main import configure_dynamo

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, timings not meaningful")
    parser.add_argument("--quick", action="store_true", help="two shapes")
    parser.add_argument("--sweep", action="store_true", help="the head width's backward and forward candidates")
    parser.add_argument("--out", help="directory for <gpu>-gated_rms_norm.json (default: print only)")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    smoke = args.smoke or not gpu
    timing.set_smoke(smoke)
    configure_dynamo()  # torch.compile's backward alone, as the main benchmark times it
    device = "cuda" if gpu else "cpu"
    name = torch.cuda.get_device_name(0) if gpu else "cpu"
    stamp = datetime.datetime.now(datetime.timezone.utc)
    ceiling = timing.copy_ceiling()
    mode = "smoke" if smoke else ("quick" if args.quick else "main")
    results = {"gpu": name, "date": stamp.strftime("%Y-%m-%d"), "started_utc": stamp.strftime("%Y-%m-%dT%H:%M:%SZ"),
               "commit": commit(), "xkern_sha": kernels_sha(), "mode": "sweep" if args.sweep else mode,
               "smoke": smoke, "ceiling": ceiling}
    if args.sweep:
        rows = sweep(smoke, ceiling["gbps"], lambda msg: print(msg, flush=True))
        ok = all(r.get("status") == "ok" for r in rows)
    else:
        rows = []
        for case in cases(mode):
            rows += run_case(OP, case, device, ceiling["gbps"], lambda msg: print(msg, flush=True))
        for row in rows:
            us = row.get("us")
            print(f"{row.get('label', '')}: {row['pass']:8s} {row['impl']:16s} "
                  f"{'-' if us is None else f'{us:9.1f} us'}  {row.get('status', '')}", flush=True)
        ok = all(r.get("check", "pass") == "pass" or not r["impl"].startswith("xkern") for r in rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = f"{gpu_kind(name)}-gated_rms_norm{'-sweep' if args.sweep else ''}{'-smoke' if smoke else ''}"
        path = os.path.join(args.out, f"{stem}.json")
        with open(path, "w") as f:
            json.dump({**results, "results": rows}, f, indent=1, default=str)
        print("wrote", path)
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
