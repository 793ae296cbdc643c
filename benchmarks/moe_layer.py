"""A MoE layer step, forward + backward, with xkern's dispatch and weighted combine beside the peers' paths.

    python -m benchmarks.moe_layer [--sizes deepseek-v3,qwen3-moe] [--tokens N] [--out DIR] [--smoke]

The step: router (x @ W_r, softmax in FP32, top-k, renormalised) -> dispatch -> grouped expert GEMMs
(SwiGLU: `torch._grouped_mm`; JAX `jax.lax.ragged_dot`) -> weighted combine, then the backward of a fixed
cotangent into x and every weight. The layout is the padded expert-major one of `generate_permute_indices`
(blocks of 16 rows, the grouped GEMM's alignment), computed on the device: no host sync in any path, so each
step is captured in one CUDA graph and timed by its replays (benchmarks/timing.py).

Dispatch + combine paths (the rest of the step is the same code):
- xkern: `permute_rows(x, idx, top_k=k)` straight from the token rows, `unpermute_rows(y, idx, T * k, top_k=k,
  probs=p)`: the FP32 weighted sum of the k copies in one kernel; its backward writes dy and dprobs in one
  kernel (no atomics).
- torchtitan (its MoE.forward today, single GPU with its padding wrapper): index gather `x[sorted // k]`, the
  padded gather (`vstack` a zero row, index), the experts, the padded scatter back (`index_put`), the unsort
  scatter into zeros (deterministic: each index once), then `bmm` of the FP32 scores with the FP32 rows.
- plain: `repeat_interleave` + `index_select`, multiply by the weights in the rows' dtype, `index_add_`.
- TransformerEngine's `moe_permute_with_probs` / `moe_unpermute(merging_probs=)` where importable (it is not
  installed on the lent GPU machines: the row says so).

Reported per size and path: the whole step's device time, dispatch + combine alone (forward + backward with
identity experts), peak memory of one eager step above what was allocated before it, the output's relative
difference to torchtitan's, and whether two runs give the same bits (outputs and every gradient). JAX: the
xkern path's step and its dispatch + combine (jitted; host wall time of back-to-back calls, so device time
where the step is device-bound). Results: `<out>/<gpu>-moe-layer[-<sizes>].json`, `.md` and `.png` (bars
per path; `-<sizes>` when --sizes picks a subset, so two calls with one size each keep both).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU in one process

SIZES = {  # hidden, experts, top_k, expert width (intermediate), tokens (scaled to fit one GPU with grads)
    "deepseek-v3": dict(hidden=7168, experts=256, top_k=8, inter=2048, tokens=8192),
    "qwen3-moe": dict(hidden=2048, experts=128, top_k=8, inter=768, tokens=16384),
}
SMOKE_SIZE = dict(hidden=32, experts=4, top_k=2, inter=16, tokens=12)
ALIGN = 16  # rows per expert block: torch._grouped_mm's bf16 alignment (torchtitan pads the same way)
PATHS = ("xkern", "torchtitan", "plain", "transformer_engine")


# ---------------------------------------------------------------------------------------------------
# torch: the shared parts of the step


def grouped_mm(a, b, offs):
    """[M, K] x [E, K, N] -> [M, N], rows of expert e between offs[e-1] and offs[e] (rows past offs[-1] are
    padding). torch._grouped_mm on a GPU; on CPU (smoke runs) a loop over the blocks (one host read)."""
    import torch

    if a.is_cuda and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a, b, offs=offs)
    out, start = a.new_zeros(a.shape[0], b.shape[-1]), 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[e]
        start = end
    return out


def experts(xp, w13, w2, offs):
    """SwiGLU experts on the padded expert-major rows: w13 [E, 2I, H], w2 [E, H, I] (torchtitan's layout)."""
    import torch.nn.functional as F

    gate, up = grouped_mm(xp, w13.transpose(-2, -1), offs).chunk(2, dim=-1)
    return grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs)


def route(x, w_router, top_k: int):
    """FP32 softmax over the experts, top-k, renormalised: (probs [T, k] fp32, expert ids [T, k])."""
    import torch

    scores = torch.softmax((x @ w_router).float(), dim=-1)
    top, ids = torch.topk(scores, top_k, dim=-1)
    return top / top.sum(-1, keepdim=True), ids


def layout(ids, num_experts: int):
    """The padded expert-major layout of the T * k routed copies (r = t * k + j), on the device.
    Returns (slot_copy [max_len] int32: the copy in each slot, -1 at padding; sorted_slot [max_len]: its
    position in expert-sorted order, -1 at padding; order [T * k]: copies in expert-sorted order; m_offsets)."""
    import torch

    import torch_api

    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # counts without bincount (whose output size is a host read): an integer scatter-add, exact
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    max_len = flat.numel() + num_experts * ALIGN
    sorted_slot, _, m_offsets = torch_api.generate_permute_indices(counts, num_experts, 1, max_len, ALIGN)
    slot_copy = torch.where(sorted_slot >= 0, order[sorted_slot.clamp(min=0).long()], -1).to(torch.int32)
    return slot_copy, sorted_slot, order, m_offsets


# ---------------------------------------------------------------------------------------------------
# torch: dispatch + experts + combine, one function per path: (x, probs, routing, run_experts) -> [T, H]


def xkern_path(x, probs, routing, run_experts):
    import torch_api

    slot_copy = routing[0]
    k = probs.shape[1]
    y = run_experts(torch_api.permute_rows(x, slot_copy, top_k=k))
    return torch_api.unpermute_rows(y, slot_copy, x.shape[0] * k, top_k=k, probs=probs)


def torchtitan_path(x, probs, routing, run_experts):
    import torch

    _, sorted_slot, order, _ = routing
    (t, h), k = x.shape, probs.shape[1]
    routed = x[order // k]                                       # index gather, [T * k, H]
    pad = torch.where(sorted_slot >= 0, sorted_slot, t * k).long()
    padded_in = torch.vstack((routed, routed.new_zeros(1, h)))
    y = run_experts(padded_in[pad])                              # the padding wrapper's gather
    back = y.new_empty(t * k + 1, h)
    back[pad] = y                                                # its scatter back (padding into the last row)
    routed_out = back[:-1]
    unsorted = torch.zeros(t * k, h, dtype=y.dtype, device=y.device)
    unsorted[order] = routed_out                                 # deterministic: each index once
    return torch.bmm(probs.reshape(t, 1, k).float(), unsorted.reshape(t, k, h).float()).to(x.dtype).squeeze(1)


def plain_path(x, probs, routing, run_experts):
    import torch

    slot_copy = routing[0]
    (t, h), k = x.shape, probs.shape[1]
    valid = slot_copy >= 0
    copy = torch.where(valid, slot_copy, t * k).long()
    rows = torch.cat((x.repeat_interleave(k, dim=0), x.new_zeros(1, h)))
    y = run_experts(rows.index_select(0, copy))
    w = torch.cat((probs.reshape(-1), probs.new_zeros(1)))[copy].to(y.dtype)
    token = torch.where(valid, slot_copy // k, t).long()  # padding rows (whatever the GEMM left there): row t
    return torch.zeros(t + 1, h, dtype=y.dtype, device=y.device).index_add_(0, token, y * w[:, None])[:t]


def transformer_engine_path(x, probs, routing, run_experts):
    """TE's fused permute with probs and weighted unpermute (used only where importable)."""
    from transformer_engine.pytorch import moe_permute_with_probs, moe_unpermute

    raise NotImplementedError("TransformerEngine is importable here: wire moe_permute_with_probs / moe_unpermute "
                              f"({moe_permute_with_probs.__name__}, {moe_unpermute.__name__}) into this path")


def transformer_engine_status() -> str | None:
    """None where TE imports, else why not (the benchmark's row says so)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # noqa: BLE001 - ImportError, or a broken install raising anything
        return f"not importable: {type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
    return None


TORCH_PATHS = {"xkern": xkern_path, "torchtitan": torchtitan_path, "plain": plain_path,
               "transformer_engine": transformer_engine_path}


# ---------------------------------------------------------------------------------------------------
# torch: the step, its timing, memory and run-to-run bits


def torch_inputs(size: dict, device: str, seed: int = 0) -> dict:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    h, e, i, t = size["hidden"], size["experts"], size["inter"], size["tokens"]

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16).mul_(scale)

    return {"x": rnd(t, h), "w_router": rnd(h, e, scale=h ** -0.5), "w13": rnd(e, 2 * i, h, scale=h ** -0.5),
            "w2": rnd(e, h, i, scale=i ** -0.5), "dout": rnd(t, h)}


def torch_step(path, inp: dict, top_k: int, num_experts: int, whole: bool):
    """One fwd + bwd: the whole layer (`whole`) -> (out, dx, dw_router, dw13, dw2); or dispatch + combine
    alone (identity experts, the router's probs as a leaf) -> (out, dx, dprobs)."""
    import torch

    x = inp["x"].detach().requires_grad_()
    if whole:
        params = [inp[n].detach().requires_grad_() for n in ("w_router", "w13", "w2")]
        probs, ids = route(x, params[0], top_k)
        routing = layout(ids, num_experts)
        out = path(x, probs, routing, lambda xp: experts(xp, params[1], params[2], routing[3]))
        return (out, *torch.autograd.grad(out, [x, *params], inp["dout"]))
    with torch.no_grad():
        probs, ids = route(inp["x"], inp["w_router"], top_k)
        routing = layout(ids, num_experts)
    probs = probs.requires_grad_()
    out = path(x, probs, routing, lambda xp: xp)
    return (out, *torch.autograd.grad(out, [x, probs], inp["dout"]))


EXACT_BYTES = 256 * 2**20  # results up to this size are kept whole for the run-to-run check


def fingerprint(t):
    """What the run-to-run check compares: the tensor itself, or for a large one (the experts' weight
    gradients) two sums of its bits, in int64 and float64 (a changed rounding anywhere changes both)."""
    import torch

    t = t.detach()
    if t.numel() * t.element_size() <= EXACT_BYTES:
        return t.clone()
    bits = t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])
    return torch.stack([bits.sum(dtype=torch.int64).double(), t.sum(dtype=torch.float64)]).cpu()


def same_bits(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def measure_torch(name: str, inp: dict, top_k: int, num_experts: int, whole: bool, device: str) -> dict:
    import torch

    from benchmarks import timing

    path = TORCH_PATHS[name]
    row = {"framework": "torch", "impl": name, "part": "layer" if whole else "dispatch+combine"}
    try:
        step = torch_step(path, inp, top_k, num_experts, whole)
        out = step[0].detach()
        first = [fingerprint(t) for t in step]
        del step
        second = [fingerprint(t) for t in torch_step(path, inp, top_k, num_experts, whole)]
        row["bitwise_run_to_run"] = all(same_bits(a, b) for a, b in zip(first, second, strict=True))
        del second
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch_step(path, inp, top_k, num_experts, whole)
            torch.cuda.synchronize()
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row["us"], row["timing"] = timing.torch_device_us(
            lambda: [lambda: torch_step(path, inp, top_k, num_experts, whole)])
        row["status"] = "ok"
        row["_out"] = out
    except Exception as err:  # noqa: BLE001 - one failing path must not lose the others
        row["status"] = timing.error_status(err)
    return row


# ---------------------------------------------------------------------------------------------------
# JAX: the xkern path


def jax_functions(size: dict):
    import jax
    import jax.numpy as jnp

    import jax_api

    e, k, t = size["experts"], size["top_k"], size["tokens"]
    max_len = t * k + e * ALIGN

    def routing(x, w_router):
        scores = jax.nn.softmax((x @ w_router).astype(jnp.float32), axis=-1)
        top, ids = jax.lax.top_k(scores, k)
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        counts = jnp.zeros(e, jnp.int32).at[flat].add(1)
        sorted_slot, m_sizes, _ = jax_api.generate_permute_indices(counts, e, 1, max_len, ALIGN)
        slot_copy = jnp.where(sorted_slot >= 0, order[jnp.maximum(sorted_slot, 0)], -1).astype(jnp.int32)
        return top / top.sum(-1, keepdims=True), slot_copy, m_sizes

    def layer_loss(params, x, dout):
        w_router, w13, w2 = params
        probs, slot_copy, m_sizes = routing(x, w_router)
        xp = jax_api.permute_rows(x, slot_copy, top_k=k)
        gate, up = jnp.split(jax.lax.ragged_dot(xp, jnp.swapaxes(w13, -2, -1), m_sizes), 2, axis=-1)
        y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, jnp.swapaxes(w2, -2, -1), m_sizes)
        out = jax_api.unpermute_rows(y, slot_copy, t * k, top_k=k, probs=probs)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    def dc_loss(x, probs, slot_copy, dout):
        xp = jax_api.permute_rows(x, slot_copy, top_k=k)
        out = jax_api.unpermute_rows(xp, slot_copy, t * k, top_k=k, probs=probs)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    layer = jax.jit(jax.grad(layer_loss, argnums=(0, 1), has_aux=True))
    dc = jax.jit(jax.grad(dc_loss, argnums=(0, 1), has_aux=True))
    return layer, dc, jax.jit(routing)


def jax_fingerprint(a):
    """As `fingerprint`, for a jax array: on the host whole, or (large) two sums of its bits computed on the
    device (int32, wrapping: still the same for the same bits)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    if a.size * a.dtype.itemsize <= EXACT_BYTES:
        return np.asarray(a)
    bits = jax.lax.bitcast_convert_type(a, {2: jnp.int16, 4: jnp.int32}[a.dtype.itemsize]).astype(jnp.int32)
    return np.asarray(jnp.stack([jax.lax.bitcast_convert_type(bits.sum(), jnp.float32), a.astype(jnp.float32).sum()]))


def measure_jax(size: dict, inp: dict, smoke: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import timing

    def to_jax(tensor):  # the same bits, shared with torch where dlpack allows (no second copy of the weights)
        try:
            return jax.dlpack.from_dlpack(tensor.contiguous())
        except Exception:  # noqa: BLE001 - a dlpack this jax cannot take: through the host
            return jnp.asarray(np.asarray(tensor.float().cpu())).astype(jnp.bfloat16)

    rows = []
    try:
        layer, dc, routing = jax_functions(size)
        x, dout = to_jax(inp["x"]), to_jax(inp["dout"])
        params = tuple(to_jax(inp[n]) for n in ("w_router", "w13", "w2"))
        probs, slot_copy, _ = routing(x, params[0])
        calls = {"layer": lambda: layer(params, x, dout), "dispatch+combine": lambda: dc(x, probs, slot_copy, dout)}
    except Exception as err:  # noqa: BLE001
        return [{"framework": "jax", "impl": "xkern", "part": "layer", "status": timing.error_status(err)}]
    for part, call in calls.items():
        row = {"framework": "jax", "impl": "xkern", "part": part}
        try:
            first = call()
            out = first[1]
            first = [jax_fingerprint(a) for a in jax.tree.leaves(first)]
            second = [jax_fingerprint(a) for a in jax.tree.leaves(call())]
            row["bitwise_run_to_run"] = all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
                                            for a, b in zip(first, second, strict=True))
            del first, second
            # The layer's outputs hold the experts' weight gradients (22.5 GB at the DeepSeek size): one call in
            # flight at a time there (its host dispatch is ~0.1 % of the step); dispatch+combine back to back.
            n, each = (2 if smoke else 20), part == "layer"
            walls = []
            for _ in range(1 if smoke else 5):
                start = time.perf_counter()
                for _ in range(n):
                    result = call()
                    if each:
                        jax.block_until_ready(result)
                jax.block_until_ready(result)
                walls.append((time.perf_counter() - start) / n * 1e6)
            row["us"] = statistics.median(walls)
            row["timing"] = timing.SMOKE_NOTE if smoke else (
                f"jitted; host wall of {n} calls, {'each waited for' if each else 'back to back'}, median of 5")
            stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
            if stats and "peak_bytes_in_use" in stats:
                row["peak_mib_process"] = stats["peak_bytes_in_use"] / 2**20
            row["status"] = "ok"
            row["_out"] = out
        except Exception as err:  # noqa: BLE001
            row["status"] = timing.error_status(err)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------
# The run


def run_size(label: str, size: dict, device: str, smoke: bool, log) -> list[dict]:
    import numpy as np
    import torch

    inp = torch_inputs(size, device)
    te = transformer_engine_status()
    rows = []
    for whole in (False, True):
        for name in PATHS:
            if name == "transformer_engine" and te is not None:
                rows.append({"framework": "torch", "impl": name, "part": "layer" if whole else "dispatch+combine",
                             "status": f"skipped: TransformerEngine {te}"})
                continue
            row = measure_torch(name, inp, size["top_k"], size["experts"], whole, device)
            rows.append(row)
            log(f"{label} torch {name} {row['part']}: {row.get('us', float('nan')):.1f} us, "
                f"peak {row.get('peak_mib', float('nan')):.0f} MiB, bitwise {row.get('bitwise_run_to_run')} "
                f"[{row['status']}]")
    # the output's distance to torchtitan's (both are FP32 weighted sums, rounded once to bf16)
    for part in ("layer", "dispatch+combine"):
        ref = next((r.get("_out") for r in rows if r["impl"] == "torchtitan" and r["part"] == part), None)
        for r in rows:
            if ref is not None and r.get("_out") is not None and r["part"] == part:
                diff = (r["_out"].float() - ref.float()).abs().max().item()
                r["max_abs_diff_vs_torchtitan"] = diff
                r["max_rel_diff_vs_torchtitan"] = diff / max(ref.float().abs().max().item(), 1e-30)
    xkern_out = {r["part"]: r.pop("_out") for r in rows if r.get("_out") is not None and r["impl"] == "xkern"}
    for r in rows:
        r.pop("_out", None)
    if device == "cuda":
        torch.cuda.empty_cache()
    for row in measure_jax(size, inp, smoke):
        out = row.pop("_out", None)
        if out is not None and row["part"] in xkern_out:  # torch and JAX run the same kernels and routing
            want = xkern_out[row["part"]].float().cpu().numpy()
            row["max_abs_diff_vs_torch_xkern"] = float(np.abs(np.asarray(out, np.float32) - want).max())
        rows.append(row)
        log(f"{label} jax xkern {row['part']}: {row.get('us', float('nan')):.1f} us, bitwise "
            f"{row.get('bitwise_run_to_run')} [{row['status']}]")
    for r in rows:
        r.update(size=label, **{k: v for k, v in size.items()})
    del inp
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], gpu: str) -> str:
    lines = [f"## MoE layer step on {gpu} (fwd + bwd, bf16; dispatch+combine = permute + weighted combine alone)",
             "", "| size | part | framework | path | µs | xkern / best peer | peak MiB | bitwise run-to-run | "
             "max rel diff vs torchtitan | status |", "|---|---|---|---|---:|---:|---:|---|---:|---|"]
    for r in rows:
        peers = [p["us"] for p in rows if p["size"] == r["size"] and p["part"] == r["part"] and "us" in p
                 and p["framework"] == "torch" and p["impl"] != "xkern"]
        us = f"{r['us']:.1f}" if "us" in r else ""
        ratio = f"{r['us'] / min(peers):.2f}x" if us and peers and r["impl"] == "xkern" else ""
        peak = r.get("peak_mib", r.get("peak_mib_process"))
        peak = "" if peak is None else f"{peak:.0f}" + (" (process)" if "peak_mib" not in r else "")
        rel = f"{r['max_rel_diff_vs_torchtitan']:.2e}" if "max_rel_diff_vs_torchtitan" in r else ""
        lines.append(f"| {r['size']} (T={r['tokens']}) | {r['part']} | {r['framework']} | {r['impl']} | {us} | "
                     f"{ratio} | {peak} | {r.get('bitwise_run_to_run', '')} | {rel} | {r['status']} |")
    return "\n".join(lines)


def plot(rows: list[dict], gpu: str, path: str) -> str | None:
    """Bars of device time per path, a panel per (size, part): drawn from the rows (the JSON's)."""
    from benchmarks.report import _plt

    panels = list(dict.fromkeys((r["size"], r["part"]) for r in rows if "us" in r))
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    for ax, (size, part) in zip(axes[0], panels, strict=True):
        sel = [r for r in rows if r["size"] == size and r["part"] == part and "us" in r]
        labels = [f"{r['impl']}\n({r['framework']})" for r in sel]
        ax.bar(range(len(sel)), [r["us"] / 1e3 for r in sel],
               color=["tab:blue" if r["impl"] == "xkern" else "tab:grey" for r in sel])
        ax.set_xticks(range(len(sel)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("ms per step (fwd + bwd)")
        ax.set_title(f"{size} (T={sel[0]['tokens']}): {part}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"MoE layer step, {gpu}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: " + ", ".join(SIZES))
    parser.add_argument("--tokens", type=int, help="tokens per step (default: each size's own)")
    parser.add_argument("--out", help="directory for <gpu>-moe-layer.json/.md (default: benchmarks/results/<gpu "
                        "kind>/ on a GPU, nothing on CPU)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, every path run through once")
    args = parser.parse_args(argv)

    from benchmarks.main import GPU  # noqa: I001 - first: sets TRITON_INTERPRET / JAX_PLATFORMS on CPU
    import torch

    from benchmarks import timing

    smoke = args.smoke or not GPU
    timing.set_smoke(smoke)
    device = "cuda" if GPU else "cpu"
    gpu = torch.cuda.get_device_name(0) if GPU else "cpu"
    sizes = {"smoke": SMOKE_SIZE} if smoke else {s: dict(SIZES[s]) for s in args.sizes.split(",")}
    if args.tokens and not smoke:
        for size in sizes.values():
            size["tokens"] = args.tokens
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    rows = []
    for label, size in sizes.items():
        rows += run_size(label, size, device, smoke, lambda m: print(m, flush=True))
    md = markdown(rows, gpu)
    print("\n" + md)
    from benchmarks.main import RESULTS, commit, gpu_kind

    out_dir = args.out or (os.path.join(RESULTS, gpu_kind(gpu)) if GPU and not smoke else None)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        chosen = "" if smoke or args.sizes == ",".join(SIZES) else "-" + args.sizes.replace(",", "-")
        stem = os.path.join(out_dir, gpu_kind(gpu) + "-moe-layer" + chosen)
        with open(stem + ".json", "w") as f:
            json.dump({"gpu": gpu, "commit": commit(), "started_utc": started, "smoke": smoke, "align": ALIGN,
                       "rows": rows}, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(md + "\n")
        try:
            drawn = plot(rows, gpu, stem + ".png")
        except ImportError as err:  # no matplotlib: the tables are still written
            drawn = f"no plot ({err})"
        print(f"wrote {stem}.json, .md and {drawn}")
    bad = [r for r in rows if r["impl"] == "xkern" and (r["status"] != "ok" or r.get("bitwise_run_to_run") is False)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
