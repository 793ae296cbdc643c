"""The experts' grouped GEMM on its own: xkern's forward, dx and dw against CUTLASS (`torch._grouped_mm`) and, in
JAX, against `jax.lax.ragged_dot`, at the MoE layer benchmark's sizes.

    python -m benchmarks.grouped_mm [--out DIR] [--quick] [--sizes qwen3-moe,deepseek-v3]
                                    [--routings balanced,skewed] [--projections gate_up,down]
                                    [--variants default,persistent,dw_persistent,dw_narrow,dw_split]
                                    [--no-ragged-dot] [--smoke]

The GEMMs are the layer's (`benchmarks/moe_layer.py`, `benchmarks/jax_moe_layer.py`): the gate/up projection
x [S, H] @ w13 [E, H, 2I] and the down projection h [S, I] @ w2 [E, I, H], over the padded expert-major rows
(S = T * k + E * 16 slots, each expert's block rounded up to 16 rows, zero rows past the last block), bf16.
Each projection's three GEMMs: the forward y = x_e @ w_e, dx = dy_e @ w_e.T, dw_e = x_e.T @ dy_e. Weights in
ragged_dot's layout [E, K, N] (the only one `jax_api.grouped_mm` takes), the same buffer for every row (the
torch layer keeps the transposes, [E, N, K], and reads them transposed: the other layout of the same GEMMs).

Routings: "balanced", the layer's own (its router, `moe_layer.route`, on the layer's first inputs: x and
W_r drawn as `moe_layer.torch_inputs` draws them); "skewed", the same number of routed rows with the experts'
loads falling as 1 / rank (Zipf, s = 1; no expert more than T rows, one copy of each token at most).

Implementations, each pass timed by one method (`timing.profile_device_us`: the device's kernels of a call,
L2 flushed before each round, median of the rounds; the same for torch and JAX):
- "xkern (torch)": `torch_api.grouped_mm` and the kernels its backward runs (`grouped_mm_dx`, `grouped_mm_dw`);
- "CUTLASS (torch._grouped_mm)": the forward and the GEMMs of its autograd, as the torch layer calls them;
- "xkern (jax)": `jax_api.grouped_mm` and its vjp's kernels (`grouped_mm_dx`, `grouped_mm_dw`), jitted;
- "ragged_dot (jax)": `jax.lax.ragged_dot`, dx as ragged_dot on w transposed, dw by its vjp; a pass whose
  compiled program needs more than the free memory, or whose first call takes more than `RAGGED_SLOW` times
  xkern's, is not timed (the row says why).
`--variants` adds xkern rows of other kernel variants (`xkern.grouped_mm.VARIANTS`: "persistent", the rows
kernel on one program per SM; "dw_persistent", the dw kernel so, its loops flattened; "dw_narrow", 128 x 128
dw tiles, two programs an SM; "dw_split", experts longer than a chunk summed in chunks, which only the skewed
routing at Qwen3-MoE makes) for the passes they change, named "xkern (torch) [variant]": the default and the
candidates from one run. The markdown ends with each implementation's six GEMMs summed (a layer step's).

Checks: xkern (torch) against CUTLASS (relative L2 over the experts' rows, pass within `REL_TOL`: both sum in
FP32 and round once, in other orders), every xkern (jax) row bitwise against xkern (torch) of its variant, the
other rows' relative L2 to xkern (torch). Reported per row: µs, TFLOP/s (2 * m_offsets[-1] * K * N flops), and
for xkern rows the time over the best peer's (CUTLASS or ragged_dot; below 1: xkern is faster).

`--quick`: the balanced routing, `QUICK_ROUNDS` rounds a row (meant for a run of both sizes in a minute and a
half to two and a half of GPU time with a few variants, most of it compiling; not yet timed on a GPU).
Results: `<out>/<gpu kind>-grouped-mm[-quick].json` and `.md`, written after every row ("complete" once the
run ends).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

from benchmarks.report import table

ALIGN = 16
PROJECTIONS = ("gate_up", "down")
PASSES = ("fwd", "dx", "dw")
ROUTINGS = ("balanced", "skewed")
XK_TORCH, CUTLASS, XK_JAX, RAGGED = "xkern (torch)", "CUTLASS (torch._grouped_mm)", "xkern (jax)", "ragged_dot (jax)"
PEERS = (CUTLASS, RAGGED)
QUICK_ROUNDS = 5
REL_TOL = 1e-2  # bf16 results of FP32 sums in two orders: a few roundings apart (~1e-3); a wrong block reads ~1
RAGGED_SLOW = 20  # ragged_dot's first call this many times xkern's: not timed further (XLA's dense lowering)


def projection_shape(size: dict, projection: str) -> tuple[int, int]:
    """(K, N) of a projection's forward."""
    h, i = size["hidden"], size["inter"]
    return (h, 2 * i) if projection == "gate_up" else (i, h)


def n_slots(size: dict) -> int:
    """The layer's padded rows: every routed copy plus room for each expert's padding."""
    return size["tokens"] * size["top_k"] + size["experts"] * ALIGN


def balanced_counts(size: dict, device: str):
    """Rows per expert [E] int64 (numpy) of the layer's own routing: its router on its first inputs."""
    import numpy as np
    import torch

    from benchmarks.moe_layer import route

    h, e, t = size["hidden"], size["experts"], size["tokens"]
    g = torch.Generator(device=device).manual_seed(0)  # `moe_layer.torch_inputs`' first two draws
    x = torch.randn(t, h, generator=g, device=device, dtype=torch.bfloat16)
    w_router = torch.randn(h, e, generator=g, device=device, dtype=torch.bfloat16).mul_(h ** -0.5)
    _, ids = route(x, w_router, size["top_k"])
    return np.bincount(ids.reshape(-1).cpu().numpy(), minlength=e).astype(np.int64)


def skewed_counts(size: dict):
    """Rows per expert [E] int64: T * k rows, loads falling as 1 / rank, none above T (water-filled)."""
    import numpy as np

    e, t, total = size["experts"], size["tokens"], size["tokens"] * size["top_k"]
    weights = 1.0 / np.arange(1, e + 1)
    counts = np.zeros(e, np.int64)
    free = np.ones(e, bool)
    while (left := total - counts.sum()) > 0:
        share = np.floor(left * weights * free / (weights * free).sum()).astype(np.int64)
        share[np.flatnonzero(free)[0]] += left - share.sum()  # the rounding's remainder to the largest
        counts = np.minimum(counts + share, t)
        free = counts < t
    return counts


def offsets(counts):
    """m_offsets [E] int32 of the padded layout (each block rounded up to ALIGN rows, at least one block)."""
    import numpy as np

    return np.cumsum(-(-np.maximum(counts, ALIGN) // ALIGN) * ALIGN).astype(np.int32)


def flops(rows: int, k: int, n: int) -> int:
    return 2 * rows * k * n


# ---------------------------------------------------------------------------------------------------
# The passes of each implementation: fn(x, w, dy, offs) -> result


def torch_impls() -> dict:
    import torch_api
    from benchmarks.moe_layer import grouped_mm, grouped_mm_weight_grad
    from torch_api.grouped_mm import grouped_mm_dw, grouped_mm_dx

    return {
        XK_TORCH: {"fwd": lambda x, w, dy, offs: torch_api.grouped_mm(x, w, offs),
                   "dx": lambda x, w, dy, offs: grouped_mm_dx(dy, w, offs),
                   "dw": lambda x, w, dy, offs: grouped_mm_dw(x, dy, offs)},
        CUTLASS: {"fwd": lambda x, w, dy, offs: grouped_mm(x, w, offs),
                  "dx": lambda x, w, dy, offs: grouped_mm(dy, w.transpose(-2, -1), offs),
                  "dw": lambda x, w, dy, offs: grouped_mm_weight_grad(x, dy, offs, w)},
    }


def jax_impls() -> dict:
    """Jitted fn(x, w, dy, offs, group_sizes); made anew per call (a jitted function keeps the variant it was
    traced with)."""
    import jax

    import jax_api
    from jax_api.grouped_mm import grouped_mm_dw, grouped_mm_dx

    def ragged_dw(x, w, dy, offs, sizes):
        return jax.vjp(lambda w: jax.lax.ragged_dot(x, w, sizes), w)[1](dy)[0]

    return {
        XK_JAX: {"fwd": jax.jit(lambda x, w, dy, offs, sizes: jax_api.grouped_mm(x, w, offs)),
                 "dx": jax.jit(lambda x, w, dy, offs, sizes: grouped_mm_dx(dy, w, offs)),
                 "dw": jax.jit(lambda x, w, dy, offs, sizes: grouped_mm_dw(x, dy, offs))},
        RAGGED: {"fwd": jax.jit(lambda x, w, dy, offs, sizes: jax.lax.ragged_dot(x, w, sizes)),
                 "dx": jax.jit(lambda x, w, dy, offs, sizes: jax.lax.ragged_dot(dy, w.swapaxes(1, 2), sizes)),
                 "dw": jax.jit(ragged_dw)},
    }


# ---------------------------------------------------------------------------------------------------
# Measuring


def rel_l2(got, ref, rows: int | None) -> float:
    """||got - ref|| / ||ref|| in FP64 (over the first `rows` rows where given), in slices of experts or rows."""
    import torch

    got, ref = (torch.as_tensor(a) for a in (got, ref))
    if rows is not None:
        got, ref = got[:rows], ref[:rows]
    diff2 = ref2 = 0.0
    step = max(1, 2**26 // max(1, ref[0].numel()))
    for i in range(0, ref.shape[0], step):
        r, g = ref[i:i + step].double(), got[i:i + step].double()
        diff2 += float(((g - r) ** 2).sum())
        ref2 += float((r ** 2).sum())
    return (diff2 / ref2) ** 0.5 if ref2 > 0 else float(diff2 > 0)


def same_bits(a, b) -> bool:
    import torch

    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def free_bytes() -> int | None:
    import torch

    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None


def measure(row: dict, call, sync, rounds: int) -> None:
    """The row's device time (`profile_us` as `us`), its method and top kernels, or its error status."""
    from benchmarks import timing

    try:
        row["us"], row["timing"], kernels = timing.profile_device_us([call], sync, rounds)
        row["kernels"] = [{"name": k["name"][:80], "us": k["us"], "count": k["count"]} for k in kernels[:4]]
        row["status"] = "ok"
    except Exception as err:  # noqa: BLE001 - one failing row must not lose the others
        row["status"] = timing.error_status(err)


def run_projection(label: str, size: dict, routing: str, counts, projection: str, device: str, variants,
                   ragged: bool, rounds: int, log, done=None) -> list[dict]:
    """Every implementation's three passes of one projection at one size and routing; `done(rows so far)` after
    each row (the run saves them: a run stopped by a time limit keeps them). Memory: the operands, the
    default xkern results (the others' reference) and one pass's results at a time (two while a pass warms up:
    the DeepSeek-V3 gate/up projection's weight and its gradient are 15 GB each); a variant's result is kept
    as its fingerprint (`moe_layer.fingerprint`: whole up to 256 MiB, else two sums of its bits) for the JAX
    row's comparison."""
    import zlib

    import numpy as np
    import torch

    from benchmarks.moe_layer import fingerprint
    from benchmarks.moe_layer import same_bits as same_fingerprint
    from benchmarks.runner import to_jax
    from xkern.grouped_mm import VARIANTS, set_variant

    k, n = projection_shape(size, projection)
    e, s = size["experts"], n_slots(size)
    offs_np = offsets(counts)
    rows = int(offs_np[-1])
    g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{label} {projection}".encode()))
    x = torch.randn(s, k, generator=g, device=device, dtype=torch.bfloat16)
    w = torch.randn(e, k, n, generator=g, device=device, dtype=torch.bfloat16).mul_(k ** -0.5)
    dy = torch.randn(s, n, generator=g, device=device, dtype=torch.bfloat16)
    x[rows:], dy[rows:] = 0, 0  # the layer's padding tail: zero rows
    offs = torch.from_numpy(offs_np).to(device)
    group_sizes = np.diff(offs_np, prepend=0).astype(np.int32)
    group_sizes[-1] += s - rows  # the tail's zero rows join the last group (as the JAX layer does)
    # the JAX rows read the same buffers (DLPack)
    jargs = tuple(to_jax(t) for t in (x, w, dy, offs, torch.from_numpy(group_sizes).to(device)))
    base = {"size": label, **size, "routing": routing, "projection": projection, "shape": [s, k, n, e],
            "rows": rows, "max_expert_rows": int(counts.max()), "dtype": "bfloat16",
            "gflop": flops(rows, k, n) / 1e9}
    out, refs = [], {}
    torch_fns, sync = torch_impls(), _syncs()

    def run(impl, framework, pass_, fn, args, check):
        """One row: the first call checked (`check(result)` fills the row), then timed."""
        row = {**base, "framework": framework, "impl": impl, "pass": pass_}
        out.append(row)
        try:
            got = fn(*args)
            sync[framework](got)
            check(row, got if framework == "torch" else torch.from_dlpack(got))
            del got
            measure(row, functools.partial(fn, *args), sync[framework], rounds)
        except Exception as err:  # noqa: BLE001 - one failing row must not lose the others
            row["status"] = _error(err)
        finish(row)
        return row

    def finish(row):
        if "us" in row:
            row["tflops"] = row["gflop"] / row["us"] / 1e3
        log(f"{label} {routing} {projection} {row['pass']} {row['impl']}: {row.get('us', float('nan')):.1f} us "
            f"{row.get('tflops', float('nan')):.0f} TFLOP/s [{row['status']}]")
        if done is not None:
            done(out)

    def span(pass_):  # the rows of a result that every implementation defines (past the last offset: dw whole)
        return None if pass_ == "dw" else rows

    for variant in variants:  # xkern, torch then JAX, the default first (the others' reference)
        set_variant(variant)
        jax_fns = jax_impls()  # traced under this variant
        suffix = "" if variant == "default" else f" [{variant}]"
        for pass_ in [p for p in PASSES if variant == "default" or p in VARIANTS[variant]]:
            kept = {}

            def keep(row, got, pass_=pass_, kept=kept, variant=variant):
                kept["bits"] = fingerprint(got)
                if variant == "default":
                    refs[pass_] = got
                else:
                    row["rel_l2_vs_xkern_default"] = rel_l2(got, refs[pass_], span(pass_))

            def same_as_torch(row, got, kept=kept):
                row["bitwise_equal_torch"] = "bits" in kept and same_fingerprint(fingerprint(got), kept["bits"])

            run(XK_TORCH + suffix, "torch", pass_, torch_fns[XK_TORCH][pass_], (x, w, dy, offs), keep)
            _free(device)
            run(XK_JAX + suffix, "jax", pass_, jax_fns[XK_JAX][pass_], jargs, same_as_torch)
    set_variant("default")

    def against_xkern(key):
        def check(row, got):
            pass_ = row["pass"]
            if pass_ in refs:
                row[key] = err = rel_l2(got, refs[pass_], span(pass_))
                if key == "rel_l2_vs_cutlass":  # the xkern row's check
                    xk = next(r for r in out if r["impl"] == XK_TORCH and r["pass"] == pass_)
                    xk["rel_l2_vs_cutlass"] = err
                    xk["check"] = "pass" if err <= REL_TOL else f"fail: relative L2 {err:.2e} to CUTLASS > {REL_TOL:g}"
        return check

    for pass_ in PASSES:
        run(CUTLASS, "torch", pass_, torch_fns[CUTLASS][pass_], (x, w, dy, offs), against_xkern("rel_l2_vs_cutlass"))
        _free(device)
    if ragged:
        jax_fns = jax_impls()
        for pass_ in PASSES:
            fn = ragged_dot_call(jax_fns[RAGGED][pass_], jargs, out, pass_)
            if isinstance(fn, str):
                out.append({**base, "framework": "jax", "impl": RAGGED, "pass": pass_, "status": fn})
                finish(out[-1])
                continue
            run(RAGGED, "jax", pass_, fn, jargs, against_xkern("rel_l2_vs_xkern"))
            _free(device)
    refs.clear()
    del jargs, x, w, dy
    _free(device)
    return out


def ragged_dot_call(fn, args, rows: list[dict], pass_: str):
    """`fn` (a jitted ragged_dot pass) compiled, or why it is not timed: its compiled program needs more than
    the free memory, or its first call took more than RAGGED_SLOW times xkern (jax)'s time (XLA's dense
    lowering)."""
    import time

    from benchmarks import timing

    try:
        compiled = fn.lower(*args).compile()
        mem = compiled.memory_analysis()
        need = sum(getattr(mem, a, 0) or 0 for a in ("temp_size_in_bytes", "output_size_in_bytes"))
        free = free_bytes()
        if free is not None and need > free:
            return f"skipped: the compiled program needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        xk = next((r for r in rows if r["impl"] == XK_JAX and r["pass"] == pass_ and "us" in r), None)
        if xk is not None and not timing.smoke():
            start = time.perf_counter()
            timing.jax_sync(compiled(*args))
            first_us = 1e6 * (time.perf_counter() - start)
            if first_us > RAGGED_SLOW * max(xk["us"], 1000.0):
                return f"not timed: its first call took {first_us / 1e3:.0f} ms"
    except Exception as err:  # noqa: BLE001
        return _error(err)
    return compiled


def _error(err: BaseException) -> str:
    from benchmarks import timing

    return timing.error_status(err)


def _syncs() -> dict:
    from benchmarks import timing

    return {"torch": timing.torch_sync, "jax": timing.jax_sync}


def _free(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()


def add_ratios(rows: list[dict]) -> None:
    """Each xkern row's time over the best peer's of its size, routing, projection and pass."""
    for r in rows:
        if not r["impl"].startswith("xkern") or "us" not in r:
            continue
        peers = [p for p in rows if p["impl"] in PEERS and "us" in p and all(
            p[key] == r[key] for key in ("size", "routing", "projection", "pass"))]
        if peers:
            best = min(peers, key=lambda p: p["us"])
            r["vs_best_peer"], r["best_peer"] = r["us"] / best["us"], best["impl"]


def row_order(rows: list[dict]):
    """Sort key: sizes and routings as run, then projection, pass, and xkern's rows (torch, JAX, each variant's)
    before the peers'."""
    sizes = list(dict.fromkeys((r["size"], r["routing"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows if r["impl"].startswith("xkern"))) + list(PEERS)
    return lambda r: (sizes.index((r["size"], r["routing"])), PROJECTIONS.index(r["projection"]),
                      PASSES.index(r["pass"]), impls.index(r["impl"]) if r["impl"] in impls else len(impls))


def markdown(rows: list[dict], gpu: str, smoke: bool) -> str:
    lines = [f"## Grouped GEMM (the MoE layer's experts) on {gpu}: bf16, µs (TFLOP/s); xkern / best peer is the "
             "time ratio (below 1: xkern faster)" + (" — smoke run, not measurements" if smoke else ""), ""]
    cols = []
    for r in sorted(rows, key=row_order(rows)):
        us = f"{r['us']:.1f} ({r['tflops']:.0f})" if "us" in r else ""
        ratio = f"{r['vs_best_peer']:.2f}x" if "vs_best_peer" in r else ""
        check = r.get("check", "")
        if "bitwise_equal_torch" in r:
            check = "bitwise = torch" if r["bitwise_equal_torch"] else "fail: bits differ from torch"
        for key, to in (("rel_l2_vs_xkern", "xkern"), ("rel_l2_vs_xkern_default", "the default")):
            if key in r:
                check = f"rel L2 to {to} {r[key]:.1e}"
        s, k, n, e = r["shape"]
        cols.append([r["size"], r["routing"], f"{r['projection']} {s}×{k}×{n}, E={e}", r["pass"], r["impl"], us,
                     ratio, check, r["status"]])
    sums = [[r["size"], r["routing"], r["impl"], f"{r['us']:.0f}", f"{r['vs_cutlass']:.2f}x" if "vs_cutlass" in r
             else ""] for r in step_sums(rows)]
    return "\n".join(lines + table(["size", "routing", "GEMM (S×K×N)", "pass", "impl", "µs (TFLOP/s)",
                                    "xkern / best peer", "check", "status"], cols) + [
        "", "The layer step's six GEMMs (both projections' forward, dx and dw; a variant's rows with the default's "
        "for the passes it leaves): µs summed, and over CUTLASS's sum", ""] + table(
        ["size", "routing", "impl", "µs, six GEMMs", "/ CUTLASS"], sums))


def step_sums(rows: list[dict]) -> list[dict]:
    """Per size, routing and implementation with all six GEMMs timed: their summed µs, and its ratio to
    CUTLASS's sum. A variant's row takes the default xkern row of its framework where it changes nothing."""
    out = []
    for size, routing in dict.fromkeys((r["size"], r["routing"]) for r in rows):
        mine = [r for r in rows if (r["size"], r["routing"]) == (size, routing)]
        timed = {(r["impl"], r["projection"], r["pass"]): r["us"] for r in mine if "us" in r}
        sums = {}
        for impl in dict.fromkeys(r["impl"] for r in mine):
            plain = impl.partition(" [")[0]
            got = [timed.get((impl, p, q), timed.get((plain, p, q))) for p in PROJECTIONS for q in PASSES]
            if all(t is not None for t in got):
                sums[impl] = sum(got)
        for impl, us in sums.items():
            row = {"size": size, "routing": routing, "impl": impl, "us": us}
            if CUTLASS in sums:
                row["vs_cutlass"] = us / sums[CUTLASS]
            out.append(row)
    return out


def main(argv=None) -> int:
    from benchmarks.moe_layer import SIZES, SMOKE_SIZE

    # JAX gives its buffers back to the driver when they go (its default pool would keep the 15 GB weight
    # gradients of one projection out of the next one's torch rows)
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for <gpu>-grouped-mm[-quick].json/.md (default: "
                        "benchmarks/results/<gpu kind>/ on a GPU, nothing on CPU)")
    parser.add_argument("--quick", action="store_true", help=f"balanced routing, {QUICK_ROUNDS} rounds per row")
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: " + ", ".join(SIZES))
    parser.add_argument("--routings", default=None, help="comma-separated: " + ", ".join(ROUTINGS))
    parser.add_argument("--projections", default=",".join(PROJECTIONS), help="comma-separated: " + ", ".join(
        PROJECTIONS))
    parser.add_argument("--variants", default="default",
                        help="comma-separated kernel variants of xkern (xkern.grouped_mm.VARIANTS), default first")
    parser.add_argument("--no-ragged-dot", action="store_true", help="leave jax.lax.ragged_dot out")
    parser.add_argument("--smoke", action="store_true", help="a tiny size, every path run through once")
    args = parser.parse_args(argv)

    from benchmarks.machine import GPU, RESULTS, commit, gpu_kind, versions  # noqa: I001 - first: the platform env
    import torch

    from benchmarks import timing
    from xkern.grouped_mm import VARIANTS

    def chosen(flag: str, value: str, names) -> list[str]:
        got = value.split(",")
        if not set(got) <= set(names) or (flag == "variants" and got[0] != "default"):
            parser.error(f"--{flag}: a comma-separated subset of {', '.join(names)}"
                         f"{' (default first)' * (flag == 'variants')}, got {value}")
        return got

    variants = chosen("variants", args.variants, VARIANTS)
    routings = chosen("routings", args.routings or ("balanced" if args.quick else ",".join(ROUTINGS)), ROUTINGS)
    projections = chosen("projections", args.projections, PROJECTIONS)
    smoke = args.smoke or not GPU
    timing.set_smoke(smoke)
    device = "cuda" if GPU else "cpu"
    gpu = torch.cuda.get_device_name(0) if GPU else "cpu"
    sizes = {"smoke": dict(SMOKE_SIZE)} if smoke else {s: dict(SIZES[s]) for s in args.sizes.split(",")}
    rounds = QUICK_ROUNDS if args.quick else timing.PROFILE_ROUNDS
    out_dir = args.out or (os.path.join(RESULTS, gpu_kind(gpu)) if GPU and not smoke else None)
    stem = None if out_dir is None else os.path.join(out_dir, gpu_kind(gpu) + "-grouped-mm" + "-quick" * args.quick)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    def save(rows, final=False):
        if stem is None:
            return
        add_ratios(rows)
        os.makedirs(out_dir, exist_ok=True)
        results = {"gpu": gpu, "commit": commit(), "started_utc": started, "smoke": smoke, "quick": args.quick,
                   "rounds": rounds, "align": ALIGN, "rel_tol": REL_TOL, "variants": variants,
                   "versions": versions(), "complete": final, "rows": rows, "step_sums": step_sums(rows)}
        with open(stem + ".json", "w") as f:
            json.dump(results, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(markdown(rows, gpu, smoke) + "\n")

    rows: list[dict] = []
    for label, size in sizes.items():
        for routing in routings:
            counts = balanced_counts(size, device) if routing == "balanced" else skewed_counts(size)
            for projection in projections:
                before = list(rows)
                rows += run_projection(label, size, routing, counts, projection, device, variants,
                                       not args.no_ragged_dot, rounds, lambda m: print(m, flush=True),
                                       lambda new, before=before: save(before + new))
    add_ratios(rows)
    print("\n" + markdown(rows, gpu, smoke))
    save(rows, final=True)
    bad = [r for r in rows if r["impl"].startswith("xkern") and (
        r["status"] != "ok" or r.get("check", "pass") != "pass" or r.get("bitwise_equal_torch") is False
        or not r.get("rel_l2_vs_xkern_default", 0.0) <= REL_TOL)]
    for r in bad:
        print(f"FAILED: {r['size']} {r['routing']} {r['projection']} {r['pass']} {r['impl']}: {r['status']} "
              f"{r.get('check', '')}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
