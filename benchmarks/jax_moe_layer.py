"""A MoE layer step in JAX, forward + backward: xkern's dispatch and weighted combine against the pure-JAX path
as MaxText writes it, around the same experts.

    python -m benchmarks.jax_moe_layer [--sizes qwen3-moe,deepseek-v3] [--tokens N] [--out DIR] [--smoke]
                                       [--torch-json PATH] [--xla-flags FLAGS] [--experts-gemm NAME]

The sizes, router and SwiGLU experts are `benchmarks/moe_layer.py`'s (the torch step). Per path:
- xkern: `topk_permute_indices` (the padded expert-major layout, no sort), `jax_api.permute_rows(x, idx,
  top_k=k)` from the token rows, the experts on the padded rows, `jax_api.unpermute_rows(y, idx, T * k,
  top_k=k, probs=p)`: the FP32 weighted sum of the k copies in one kernel.
- maxtext (MaxText's `RoutedMoE.permute` / `unpermute` with its sort's custom_vjp): argsort of the flattened
  expert ids, `jnp.repeat` of the token rows, the sort, the experts with `bincount` group sizes, the unsort
  by `argsort(order)`, the weighted sum over the k copies in FP32.
The experts (weights in ragged_dot's layout [E, H, 2I] and [E, I, H], as MaxText keeps them) run through the
grouped GEMM `--experts-gemm` names, the same for both paths. Dispatch + combine alone runs identity experts
behind an optimization barrier, so the permuted rows exist as the GEMMs would need them.

Reported per size and path: `us` (`timing.jax_device_us`: the step inside one jitted `fori_loop`, nothing
hoisted; `profile_us` too, by the profiler), `peak_mib` (the compiled step's `memory_analysis()`; a step
needing more than the free memory is not run), the FP32 reference check and the bits run to run, as the torch
rows; `vs_torch_xkern`, the step's time over the torch xkern step's, read from the torch JSON beside `--out`
(`--add-ratios JAX_JSON --torch-json TORCH_JSON` adds them afterwards). `--xla-flags` (default
`--xla_gpu_autotune_level=0`: XLA's GEMM autotuner once asked for 65 GiB) is added to XLA_FLAGS before jax
loads. Results: `<out>/<gpu>-jax-moe-layer[-<sizes>].json` and `.md`, written after every row.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import glob
import json
import os
import sys

from benchmarks.moe_layer import (
    ALIGN,
    EXACT_BYTES,
    REF_TOL,
    RESULT_NAMES,
    cells,
    chosen_sizes,
    profile_time,
    ref_check,
    size_arguments,
    write_results,
)
from benchmarks.report import table

PATHS = ("xkern", "maxtext")
DEFAULT_XLA_FLAGS = "--xla_gpu_autotune_level=0"
REF_CHUNK = 8  # experts per FP32 reference call: 8 DeepSeek-V3 experts' weights and gradients, ~6 GB in FP32


# ---------------------------------------------------------------------------------------------------
# The layer: router, experts, and each path's dispatch + combine


def routing(x, w_router, top_k: int):
    """FP32 softmax over the experts, top-k, renormalised: (probs [T, k] fp32, expert ids [T, k] int32)."""
    import jax
    import jax.numpy as jnp

    top, ids = jax.lax.top_k(jax.nn.softmax((x @ w_router).astype(jnp.float32), axis=-1), top_k)
    return top / top.sum(-1, keepdims=True), ids


def swiglu_experts(xs, w13, w2, group_sizes, gemm=None):
    """Rows grouped by expert (group_sizes[e] rows of expert e, in order); w13 [E, H, 2I], w2 [E, I, H].
    `gemm(rows, w, group_sizes)`: the grouped GEMM (`EXPERT_GEMMS`; default `jax.lax.ragged_dot`)."""
    import jax
    import jax.numpy as jnp

    gemm = gemm or jax.lax.ragged_dot
    gate, up = jnp.split(gemm(xs, w13, group_sizes), 2, axis=-1)
    return gemm(jax.nn.silu(gate) * up, w2, group_sizes)


# ---------------------------------------------------------------------------------------------------
# The experts' grouped GEMM. XLA's GPU lowering of `ragged_dot` expands at least its weight-gradient form
# (the group dimension contracted) to a dense GEMM masked per group: memory and flops times the expert count,
# 197 GiB for the Qwen3-MoE step on an H100 (jax 0.11.2). So on a GPU both paths run xkern's grouped GEMM; both
# share it, so the ratio still compares their dispatch and combine; the JSON names it.

def use_expert_gemm(name: str):
    """Make `name` the experts' grouped GEMM (`EXPERT_GEMMS`; "auto": on a GPU xkern's (`jax_api.grouped_mm`), on a
    CPU `ragged_dot`, whose lowering there is exact). Returns the name."""
    import jax

    global EXPERT_GEMM
    if name == "auto":
        name = "ragged_dot" if jax.default_backend() == "cpu" else "xkern"
    EXPERT_GEMM = name
    return name


def xkern_gemm(x, w, group_sizes):
    """xkern's grouped GEMM (`jax_api.grouped_mm`, the Triton kernels torch_api.grouped_mm runs) on the groups'
    cumulative ends; rows past the last group come back zero, as from `ragged_dot`."""
    import jax.numpy as jnp

    import jax_api

    return jax_api.grouped_mm(x, w, jnp.cumsum(group_sizes).astype(jnp.int32))


EXPERT_GEMMS = ("auto", "ragged_dot", "xkern")
EXPERT_GEMM_NAMES = {"ragged_dot": "`jax.lax.ragged_dot` (XLA's lowering)",
                     "xkern": "xkern's grouped GEMM (`jax_api.grouped_mm`, Triton)"}
EXPERT_GEMM = "ragged_dot"


def xkern_moe(x, probs, ids, experts):
    """xkern's dispatch and weighted combine; `experts(rows, group_sizes)` runs on the padded layout."""
    import jax.numpy as jnp

    import jax_api

    (t, k), e = ids.shape, experts.num_experts
    rows = t * k + e * ALIGN  # room for every expert's padding: topk_permute_indices' default max_len
    slot_copy, m_sizes, _ = jax_api.topk_permute_indices(ids, e, rows, ALIGN)  # no sort
    # The rows past the last expert's block (zero rows, as padding, read by no token) join its group: the
    # grouped GEMM then covers every row, none left unwritten, at the cost of at most e * ALIGN zero rows.
    m_sizes = m_sizes.at[-1].add(rows - jnp.sum(m_sizes))
    y = experts(jax_api.permute_rows(x, slot_copy, top_k=k), m_sizes)
    return jax_api.unpermute_rows(y, slot_copy, t * k, top_k=k, probs=probs)


def maxtext_moe(x, probs, ids, experts):
    """MaxText's sort-based dispatch and FP32 weighted sum (RoutedMoE.permute / unpermute)."""
    import jax.numpy as jnp

    (t, k), e = ids.shape, experts.num_experts
    flat = ids.reshape(-1)
    order = jnp.argsort(flat)
    xs = sort_rows(jnp.repeat(x, k, axis=0), order)
    y = sort_rows(experts(xs, jnp.bincount(flat, length=e).astype(jnp.int32)), jnp.argsort(order))
    out = jnp.einsum("tkh,tk->th", y.reshape(t, k, -1).astype(jnp.float32), probs.astype(jnp.float32))
    return out.astype(x.dtype)


@functools.cache
def _sort_rows():
    import jax

    @jax.custom_vjp
    def sort(rows, idx):
        return rows[idx]

    def fwd(rows, idx):
        return rows[idx], idx

    def bwd(idx, grad):  # the inverse sort, as MaxText's `_sort_activations_custom` (no scatter-add)
        import jax.numpy as jnp

        return sort(grad, jnp.argsort(idx)), None

    sort.defvjp(fwd, bwd)
    return sort


def sort_rows(rows, idx):
    """rows[idx] for a permutation idx, differentiable with the inverse sort as its backward."""
    return _sort_rows()(rows, idx)


PATH_FNS = {"xkern": xkern_moe, "maxtext": maxtext_moe}


class Experts:
    """The SwiGLU experts bound to their weights (None: identity experts, for dispatch + combine alone)."""

    def __init__(self, num_experts: int, w13=None, w2=None):
        self.num_experts, self.w13, self.w2 = num_experts, w13, w2

    def __call__(self, rows, group_sizes):
        if self.w13 is None:  # materialised as the experts' GEMMs would need them: nothing fuses across
            import jax

            return jax.lax.optimization_barrier(rows)
        return swiglu_experts(rows, self.w13, self.w2, group_sizes, xkern_gemm if EXPERT_GEMM == "xkern" else None)


def layer_step(path: str, top_k: int, num_experts: int):
    """(params, x, dout) -> (out, dx, dw_router, dw13, dw2): the layer's forward and its vjp."""
    import jax

    def layer(params, x):
        w_router, w13, w2 = params
        probs, ids = routing(x, w_router, top_k)
        return PATH_FNS[path](x, probs, ids, Experts(num_experts, w13, w2))

    def step(params, x, dout):
        out, vjp = jax.vjp(layer, params, x)
        dparams, dx = vjp(dout)
        return (out, dx, *dparams)

    return step


def dc_step(path: str, top_k: int, num_experts: int):
    """(w_router, x, dout) -> (out, dx, dprobs): dispatch + combine alone, identity experts, the router's probs
    a leaf (the router runs without gradient, as in the torch benchmark's row)."""
    import jax

    def step(w_router, x, dout):
        probs, ids = jax.lax.stop_gradient(routing(x, w_router, top_k))
        out, vjp = jax.vjp(lambda x, p: PATH_FNS[path](x, p, ids, Experts(num_experts)), x, probs)
        return (out, *vjp(dout))

    return step


def inputs(size: dict, seed: int = 0) -> dict:
    """bf16 inputs of the torch benchmark's scales; weights in ragged_dot's layout, made on the device."""
    import jax
    import jax.numpy as jnp

    h, e, i, t = size["hidden"], size["experts"], size["inter"], size["tokens"]
    shapes = {"x": ((t, h), 1.0), "w_router": ((h, e), h ** -0.5), "w13": ((e, h, 2 * i), h ** -0.5),
              "w2": ((e, i, h), i ** -0.5), "dout": ((t, h), 1.0)}
    keys = jax.random.split(jax.random.key(seed), len(shapes))

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def normal(key, shape, scale):  # one fusion: no FP32 copy of a 15 GB weight
        return (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16)

    return {name: normal(key, shape, scale) for (name, (shape, scale)), key in zip(shapes.items(), keys)}


# ---------------------------------------------------------------------------------------------------
# The FP32 reference


def reference_errors(inp: dict, top_k: int, got, whole: bool) -> dict:
    """Relative L2 distance, ||got - ref|| / ||ref||, of each result (named as `moe_layer.RESULT_NAMES`) to the FP32
    reference: the same bf16 inputs (exact in FP32), the same expert choices (the bf16 router's), every
    operation in FP32. The experts run `REF_CHUNK` at a time, each padded to the most rows any expert has
    (padding rows weigh 0), and each chunk's weight gradients are compared as they are made."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    f32 = jnp.float32
    x32, dout = inp["x"].astype(f32), inp["dout"].astype(f32)
    probs_bf16, ids = jax.jit(routing, static_argnums=2)(inp["x"], inp["w_router"], top_k)
    sums: dict = {}

    def add(name, value, ref):
        d = value.astype(f32) - ref
        sums.setdefault(name, []).append(np.array([jnp.vdot(d, d), jnp.vdot(ref, ref)], np.float64))

    names = RESULT_NAMES[whole]
    if not whole:  # identity experts: out[t] = sum_j p[t, j] x[t]
        p32 = probs_bf16.astype(f32)
        out, vjp = jax.vjp(lambda x, p: p.sum(-1, keepdims=True) * x, x32, p32)
        for name, value, ref in zip(names, got, (out, *vjp(dout)), strict=True):
            add(name, value, ref)
        return _relative(sums, names)

    def probs_of(x, w_router):
        top = jnp.take_along_axis(jax.nn.softmax(x @ w_router, axis=-1), ids, axis=-1)
        return top / top.sum(-1, keepdims=True)

    probs, probs_vjp = jax.vjp(probs_of, x32, inp["w_router"].astype(f32))
    t, h = x32.shape
    e = inp["w13"].shape[0]
    flat = np.asarray(ids).reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=e)
    cap = int(-(-max(counts.max(), 1) // 64) * 64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    # copies[e, c]: the c-th copy routed to expert e, or 0 with weight 0 (padding)
    copies = np.zeros((e, cap), np.int32)
    valid = np.zeros((e, cap), bool)
    for ex in range(e):
        copies[ex, :counts[ex]] = order[starts[ex]:starts[ex + 1]]
        valid[ex, :counts[ex]] = True

    @jax.jit
    def chunk(x, dout, probs_flat, copies, valid, w13, w2):
        token = copies // top_k
        p = jnp.where(valid, probs_flat[copies], 0.0)

        def part(xe, w13, w2, p):
            gate, up = jnp.split(jnp.einsum("ech,ehf->ecf", xe, w13), 2, axis=-1)
            return p[..., None] * jnp.einsum("eci,eih->ech", jax.nn.silu(gate) * up, w2)

        y, vjp = jax.vjp(part, x[token], w13.astype(f32), w2.astype(f32), p)
        gx, g13, g2, gp = vjp(dout[token])
        out = jnp.zeros_like(x).at[token.reshape(-1)].add(y.reshape(-1, x.shape[1]))
        dx = jnp.zeros_like(x).at[token.reshape(-1)].add(gx.reshape(-1, x.shape[1]))
        dprobs = jnp.zeros_like(probs_flat).at[copies.reshape(-1)].add(jnp.where(valid, gp, 0.0).reshape(-1))
        return out, dx, dprobs, g13, g2

    out, dx, dprobs = jnp.zeros_like(x32), jnp.zeros_like(x32), jnp.zeros(t * top_k, f32)
    for lo in range(0, e, REF_CHUNK):
        hi = min(lo + REF_CHUNK, e)
        o, gx, gp, g13, g2 = chunk(x32, dout, probs.reshape(-1), copies[lo:hi], valid[lo:hi],
                                   inp["w13"][lo:hi], inp["w2"][lo:hi])
        out, dx, dprobs = out + o, dx + gx, dprobs + gp
        add("dw13", got[3][lo:hi], g13)
        add("dw2", got[4][lo:hi], g2)
    gx, gw = probs_vjp(dprobs.reshape(t, top_k))
    add("out", got[0], out)
    add("dx", got[1], dx + gx)
    add("dw_router", got[2], gw)
    return _relative(sums, names)


def _relative(sums: dict, names) -> dict:
    import numpy as np

    errors = {}
    for name in names:
        diff2, ref2 = np.sum(sums[name], axis=0)
        errors[name] = float(np.sqrt(diff2 / ref2)) if ref2 > 0 else float(diff2 > 0)
    return errors


# ---------------------------------------------------------------------------------------------------
# Measuring one path


def fingerprint(a):
    """What the run-to-run check compares: the array on the host, or for a large one (the experts' weight
    gradients) two sums of its bits computed on the device (int32 wrapping, and float32)."""
    import numpy as np

    if a.size * a.dtype.itemsize <= EXACT_BYTES:
        return np.asarray(a)
    return np.asarray(_bit_sums()(a))


@functools.cache
def _bit_sums():
    """The large arrays' two sums as one jitted reduction (compiled once per shape): eager, each cast held a
    copy of the array (28 GiB at DeepSeek-V3's size)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def sums(a):
        bits = jax.lax.bitcast_convert_type(a, {2: jnp.int16, 4: jnp.int32}[a.dtype.itemsize]).astype(jnp.int32)
        return jnp.stack([jax.lax.bitcast_convert_type(bits.sum(), jnp.float32), a.sum(dtype=jnp.float32)])

    return sums


def compiled_bytes(compiled) -> int:
    """What one call adds to the memory held before it: the compiled program's temporaries and outputs."""
    mem = compiled.memory_analysis()
    return int(mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes)


def free_bytes() -> int | None:
    import jax

    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def est_step_us(size: dict, whole: bool) -> float:
    """A first guess of a step's device time, for the timing loop's length: the GEMMs' flops at 400 TFLOP/s,
    or the gathers' bytes at 3 TB/s."""
    rows = size["tokens"] * size["top_k"]
    if whole:
        return 6 * rows * size["hidden"] * 3 * size["inter"] / 400e6
    return 8 * rows * size["hidden"] * 2 / 3e6


def timed_step(step):
    """`step` as `timing.jax_device_us` runs it: `(consts, (x, touch)) -> (x, touch)`.

    The loop's state is x and one element of the last step's gradients, summed (whole gradients in the state
    would hold a second copy, 22.5 GB at the DeepSeek-V3 size; with two steps per loop iteration and nothing
    reading the first one's gradients, XLA dropped their GEMMs, seen in the compiled HLO; an optimization
    barrier did not keep them). Each step passes on x + 0 * (that element + out + dx): the same values, so the
    routing stays the same, but made by the step before, so nothing is hoisted out of the loop."""
    import jax.numpy as jnp

    def loop_step(consts, state):
        (x, touch), f32 = state, jnp.float32
        out, dx, *grads = step(consts[0], x, consts[1])
        x = (x.astype(f32) + (touch + out.astype(f32) + dx.astype(f32)) * 0).astype(x.dtype)
        return x, sum(g.reshape(-1)[0].astype(f32) for g in grads)

    return loop_step


def measure(path: str, size: dict, inp: dict, whole: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from benchmarks import timing

    k, e = size["top_k"], size["experts"]
    row = {"framework": "jax", "impl": path, "part": "layer" if whole else "dispatch+combine"}
    if whole:
        step = layer_step(path, k, e)
        consts = ((inp["w_router"], inp["w13"], inp["w2"]), inp["dout"])
    else:
        step = dc_step(path, k, e)
        consts = (inp["w_router"], inp["dout"])
    args = (consts[0], inp["x"], consts[1])
    try:
        jitted = jax.jit(step).lower(*args).compile()
        row["peak_mib"] = compiled_bytes(jitted) / 2**20
        free = free_bytes()
        if free is not None and row["peak_mib"] * 2**20 > free:
            row["status"] = (f"skipped: the compiled step needs {row['peak_mib'] / 1024:.1f} GiB, "
                             f"{free / 2**30:.1f} GiB free")
            return row
        got = jitted(*args)
        row["ref_rel_l2"] = reference_errors(inp, k, got, whole)
        row["ref_check"] = ref_check(row["ref_rel_l2"])
        first = [fingerprint(a) for a in got]
        del got
        second = [fingerprint(a) for a in jitted(*args)]
        row["bitwise_run_to_run"] = all(a.tobytes() == b.tobytes() for a, b in zip(first, second, strict=True))
        del first, second

        state = (inp["x"] + 0, jnp.zeros((), jnp.float32))
        row["us"], row["timing"] = timing.jax_device_us(timed_step(step), consts, state, est_step_us(size, whole))
        profile_time(row, [lambda: jitted(*args)], "jax_sync")
        row["status"] = "ok"
    except Exception as err:  # noqa: BLE001 - one failing path must not lose the others
        row["status"] = timing.error_status(err)
    finally:
        row["process_peak_mib"] = process_peak_mib()
    return row


def process_peak_mib() -> float | None:
    import jax

    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    return stats["peak_bytes_in_use"] / 2**20 if stats and "peak_bytes_in_use" in stats else None



# ---------------------------------------------------------------------------------------------------
# The run


def torch_rows(path: str | None, out_dir: str | None) -> list[dict]:
    """The torch benchmark's rows (benchmarks/moe_layer.py's JSON): `path`, or every `*-moe-layer*.json` in
    `out_dir`."""
    paths = [path] if path else sorted(glob.glob(os.path.join(out_dir, "*-moe-layer*.json"))) if out_dir else []
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [r for r in json.load(f).get("rows", []) if r.get("framework") == "torch"]
    return rows


def run_size(label: str, size: dict, log, done=None) -> list[dict]:
    """Both paths' rows at one size; `done(rows so far)` after each (the run saves them: a crash keeps them)."""
    import gc

    inp = inputs(size)
    rows = []
    for whole in (False, True):
        for path in PATHS:
            row = measure(path, size, inp, whole)
            rows.append(row)
            if done is not None:
                done([{**r, "size": label, **size} for r in rows])
            log(f"{label} jax {path} {row['part']}: {row.get('us', float('nan')):.1f} us, compiled peak "
                f"{row.get('peak_mib', float('nan')):.0f} MiB, FP32 reference {row.get('ref_check')}, bitwise "
                f"{row.get('bitwise_run_to_run')} [{row['status']}]")
            gc.collect()
    for r in rows:
        r.update(size=label, **size)
    return rows


def add_ratios(rows: list[dict], torch: list[dict]) -> None:
    """Each JAX row's time over the torch xkern row's of the same size, tokens and part."""
    for r in rows:
        ref = next((t for t in torch if t.get("impl") == "xkern" and t.get("part") == r["part"] and t.get("us")
                    and t.get("size") == r["size"] and t.get("tokens") == r["tokens"]), None)
        if ref is not None and "us" in r:  # by the profiler where both have its time: one method for both
            key = "profile_us" if "profile_us" in r and "profile_us" in ref else "us"
            r["torch_xkern_us"], r["vs_torch_xkern_by"] = ref[key], key
            r["vs_torch_xkern"] = r[key] / ref[key]


def add_ratios_to(path: str, torch: list[dict]) -> int:
    """Add the ratios to `torch`'s rows to a JSON this benchmark wrote (the torch step ran in another call)."""
    with open(path) as f:
        results = json.load(f)
    add_ratios(results["rows"], torch)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    md = markdown(results["rows"], results["gpu"], results["xla_flags"], results.get("experts_gemm", "ragged_dot"))
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(md + "\n")
    print(md)
    return 0 if any("vs_torch_xkern" in r for r in results["rows"]) else 1


def markdown(rows: list[dict], device: str, xla_flags: str, experts_gemm: str) -> str:
    lines = [f"## MoE layer step (JAX) on {device} (fwd + bwd, bf16, jit; XLA_FLAGS `{xla_flags}`; experts' grouped "
             f"GEMM: {EXPERT_GEMM_NAMES.get(experts_gemm, experts_gemm)}, both paths; FP32 reference: worst "
             f"relative L2 of the output and every gradient, pass <= {REF_TOL:g})", "",
             ]
    cols = []
    for r in rows:
        us, ratio, peak, ref = cells(r, rows, lambda p: p["impl"] == "maxtext")
        torch = f"{r['vs_torch_xkern']:.2f}x" if "vs_torch_xkern" in r else ""
        cols.append([f"{r['size']} (T={r['tokens']})", r["part"], r["impl"], us, ratio, torch, peak, ref,
                     r.get("bitwise_run_to_run", ""), r["status"]])
    return "\n".join(lines + table(["size", "part", "path", "µs", "xkern / maxtext", "/ torch xkern",
                                    "compiled peak MiB", "FP32 reference", "bitwise run-to-run", "status"], cols))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size_arguments(parser, "jax-moe-layer")
    parser.add_argument("--torch-json", help="the torch benchmark's JSON for the ratios (default: the "
                        "*-moe-layer*.json files in --out)")
    parser.add_argument("--xla-flags", default=DEFAULT_XLA_FLAGS, help="added to XLA_FLAGS before jax loads "
                        f"(default: {DEFAULT_XLA_FLAGS!r}; '' for none)")
    parser.add_argument("--experts-gemm", choices=EXPERT_GEMMS, default="auto", help="the experts' grouped GEMM, "
                        "shared by both paths (default auto: xkern's on a GPU, ragged_dot on a CPU)")
    parser.add_argument("--add-ratios", metavar="JAX_JSON", help="no run: add the ratios to the torch rows "
                        "(--torch-json) to this benchmark's JSON from another call, rewrite it and its .md")
    args = parser.parse_args(argv)
    if args.add_ratios:
        return add_ratios_to(args.add_ratios, torch_rows(args.torch_json, os.path.dirname(args.add_ratios)))

    from benchmarks.machine import GPU, RESULTS, commit, gpu_kind  # noqa: I001 - first: the platform env on CPU

    if GPU and args.xla_flags:  # before jax initialises its backend; the CPU backend ignores GPU flags anyway
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
    # Its own process: JAX may take most of the GPU (the DeepSeek-V3 step holds 45 GB of weights and gradients,
    # more than the default 75 %).
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    import jax

    from benchmarks import timing

    smoke = args.smoke or not GPU
    timing.set_smoke(smoke)
    experts_gemm = use_expert_gemm(args.experts_gemm)
    device = jax.devices()[0].device_kind if GPU else "cpu"
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out_dir = args.out or (os.path.join(RESULTS, gpu_kind(device)) if GPU and not smoke else None)
    xla_flags = os.environ.get("XLA_FLAGS", "")
    torch = torch_rows(args.torch_json, out_dir)

    def save(rows, final=False):
        add_ratios(rows, torch)
        if out_dir:
            write_results(out_dir, device, "jax-moe-layer", args, {
                "gpu": device, "commit": commit(), "started_utc": started, "smoke": smoke, "align": ALIGN,
                "ref_tol": REF_TOL, "xla_flags": xla_flags, "experts_gemm": experts_gemm,
                "experts_gemm_name": EXPERT_GEMM_NAMES[experts_gemm], "jax": jax.__version__,
                "complete": final, "rows": rows}, markdown(rows, device, xla_flags, experts_gemm))

    rows = []
    for label, size in chosen_sizes(args, smoke).items():
        rows += run_size(label, size, lambda m: print(m, flush=True),
                         lambda partial, before=list(rows): save(before + partial))
    save(rows, final=True)
    print("\n" + markdown(rows, device, xla_flags, experts_gemm))
    bad = [r for r in rows if r["impl"] == "xkern" and (r["status"].startswith("error") or r.get("ref_check", "pass")
                                                         != "pass" or r.get("bitwise_run_to_run") is False)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
