"""A MoE layer step in torch, forward + backward, with xkern's dispatch and weighted combine beside the peers' paths.

    python -m benchmarks.moe_layer [--sizes deepseek-v3,qwen3-moe] [--tokens N] [--out DIR] [--smoke]
                                   [--parts P,...] [--paths P,...]

The step: router (x @ W_r, softmax in FP32, top-k, renormalised) -> dispatch -> SwiGLU experts
(`torch._grouped_mm`, each GEMM's backward making its weight gradient first and letting its input go before
the input's gradient: `_grouped_linear`) -> weighted combine, then the backward of a fixed cotangent into x
and every weight. The layout is the padded expert-major one (16-row blocks, the grouped GEMM's alignment),
made on the device: no host sync, so each step is one CUDA graph timed by its replays.

Dispatch + combine paths (the rest of the step is the same code):
- xkern: `topk_permute_indices` (no sort), `permute_rows(x, idx, top_k=k)` from the token rows,
  `unpermute_rows(y, idx, T * k, top_k=k, probs=p)`: the FP32 weighted sum of the k copies in one kernel,
  its backward dy and dprobs in one kernel. The other paths share `layout` (a stable argsort of the ids,
  their counts, `generate_permute_indices`).
- torchtitan (its MoE.forward, single GPU with its padding wrapper, restated here): index gather, the padded
  gather (`vstack` a zero row, index), the experts, the padded scatter back (`index_put`), the unsort scatter
  into zeros, then `bmm` of the FP32 scores with the FP32 rows.
- plain: `repeat_interleave` + `index_select`, multiply by the weights in the rows' dtype, `index_add_`.
- liger: Liger-Kernel's `LigerFusedMoEFunction`: its own routing metadata (one host read per step, so it is
  timed eagerly), the gather fused into its up-projection, its own grouped GEMMs and weighted sum. No
  dispatch + combine row (the experts are inside it); on CPU its kernels do not run under Triton's
  interpreter (the row says skipped).

Reported per size and path: the whole step's device time, dispatch + combine alone (identity experts), peak
memory of one eager step above what was allocated before it, the relative L2 distance of the output and every
gradient to an FP32 reference (`reference_errors`; pass within `REF_TOL`), the output's difference to
torchtitan's, and whether two runs give the same bits. Results: `<out>/<gpu>-moe-layer[-<sizes>].json` and
`.md`; `--parts` / `--paths` measure some rows again, keeping the file's others.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import sys

from benchmarks.report import table

SIZES = {  # hidden, experts, top_k, expert width (intermediate), tokens (scaled to fit one GPU with grads)
    "deepseek-v3": dict(hidden=7168, experts=256, top_k=8, inter=2048, tokens=8192),
    "qwen3-moe": dict(hidden=2048, experts=128, top_k=8, inter=768, tokens=16384),
}
SMOKE_SIZE = dict(hidden=32, experts=4, top_k=2, inter=16, tokens=12)
ALIGN = 16  # rows per expert block: torch._grouped_mm's bf16 alignment (torchtitan pads the same way)
PATHS = ("xkern", "liger", "torchtitan", "plain")  # Liger's fused MoE: the strongest peer
PARTS = ("dispatch+combine", "layer")  # identity experts (the row ops alone), then the whole layer
# Relative L2 distance to the FP32 reference (`reference_errors`) within which a result passes. bf16 rounds
# each stored intermediate (x @ W13, the SwiGLU product, the expert outputs, the output) to 2^-9 relative;
# a tensor of such roundings sits near 2^-9 / sqrt(3) ~ 1e-3 relative L2, a few of them in a row a few
# times that: 1e-3-6e-3 at the smoke size, 5e-3-7e-3 on CPU up to 256 experts of H 1024, every result (the
# router's gradient through the softmax included). 2e-2 leaves a factor 3; a wrong row reads ~1.
REF_TOL = 2e-2


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


def grouped_mm_weight_grad(a, g, offs, like):
    """d(b) of `grouped_mm(a, b, offs)` for the output gradient g, in the layout of `like` (b): each expert's
    a-block transposed times its g-block, as torch's own backward of `_grouped_mm` computes it."""
    import torch

    if like.stride(-2) == 1:  # b is a transposed weight ([E, N, K] contiguous): make d(b) in that layout
        return grouped_mm_weight_grad(g, a, offs, like.transpose(-2, -1)).transpose(-2, -1)
    if a.is_cuda and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a.t(), g, offs=offs)
    out, start = a.new_zeros(offs.numel(), a.shape[1], g.shape[1]), 0
    for e, end in enumerate(offs.tolist()):
        out[e] = a[start:end].t() @ g[start:end]
        start = end
    return out


@functools.cache
def _grouped_linear():
    import torch

    class GroupedLinear(torch.autograd.Function):
        """`grouped_mm(a, b, offs)` whose backward makes d(b) first and lets `a` go before it makes d(a).
        torch's own node holds a, d(a) and d(b) at once: at the up projection (the step's peak, where dw13
        is made) that is one [rows, H] buffer more than the gradient needs. `experts` (every path's but
        Liger's, which runs its own) uses it."""

        @staticmethod
        def forward(ctx, a, b, offs):
            ctx.a, ctx.offs = a, offs  # not saved_tensors: the backward drops `a` midway
            ctx.save_for_backward(b)
            return grouped_mm(a, b, offs)

        @staticmethod
        def backward(ctx, g):
            (b,), a, offs = ctx.saved_tensors, ctx.a, ctx.offs
            del ctx.a
            g = g.contiguous()  # row-major, so that g.t() is a column-major operand of the grouped GEMM
            db = grouped_mm_weight_grad(a, g, offs, b) if ctx.needs_input_grad[1] else None
            del a
            da = grouped_mm(g, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
            return da, db, None

    return GroupedLinear.apply


def experts(xp, w13, w2, offs):
    """SwiGLU experts on the padded expert-major rows: w13 [E, 2I, H], w2 [E, H, I] (torchtitan's layout)."""
    import torch.nn.functional as F

    linear = _grouped_linear()
    gate, up = linear(xp, w13.transpose(-2, -1), offs).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w2.transpose(-2, -1), offs)


class Experts:
    """`experts` bound to its weights and the layout's offsets: the paths call it on their dispatched rows; a
    path that runs its own experts (Liger's) takes the weights from it."""

    def __init__(self, w13, w2, offs):
        self.w13, self.w2, self.offs = w13, w2, offs

    def __call__(self, xp):
        return experts(xp, self.w13, self.w2, self.offs)


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


def xkern_layout(ids, num_experts: int):
    """`layout`'s slot_copy and m_offsets by `topk_permute_indices`: the same values, no sort (the sorted order
    is not made: None in its places)."""
    import torch_api

    slot_copy, _, m_offsets = torch_api.topk_permute_indices(ids, num_experts, alignment=ALIGN)
    return slot_copy, None, None, m_offsets


# ---------------------------------------------------------------------------------------------------
# torch: dispatch + experts + combine, one function per path: (x, probs, routing, run_experts) -> [T, H]
# (`routing`: `layout`'s four results, then the expert ids; `LAYOUTS` names a path's own layout function)


def xkern_path(x, probs, routing, run_experts):
    import torch_api

    slot_copy = routing[0]
    k = probs.shape[1]
    y = run_experts(torch_api.permute_rows(x, slot_copy, top_k=k))
    return torch_api.unpermute_rows(y, slot_copy, x.shape[0] * k, top_k=k, probs=probs)



def torchtitan_path(x, probs, routing, run_experts):
    return torchtitan_combine(run_experts(torchtitan_dispatch(x, probs.shape[1], routing)), probs, routing)


def torchtitan_dispatch(x, k: int, routing):
    """torchtitan's token rows into the padded layout: [max_len, H]."""
    import torch

    sorted_slot, order = routing[1], routing[2]
    t, h = x.shape
    routed = x[order // k]                                       # index gather, [T * k, H]
    pad = torch.where(sorted_slot >= 0, sorted_slot, t * k).long()
    padded_in = torch.vstack((routed, routed.new_zeros(1, h)))
    return padded_in[pad]                                        # the padding wrapper's gather


def torchtitan_combine(y, probs, routing):
    """torchtitan's way back: the padded rows y [max_len, H] scattered to the routed order, unsorted, and each
    token's k rows summed with its probs in FP32: [T, H] in y's dtype."""
    import torch

    sorted_slot, order = routing[1], routing[2]
    (t, k), h = probs.shape, y.shape[1]
    pad = torch.where(sorted_slot >= 0, sorted_slot, t * k).long()
    back = y.new_empty(t * k + 1, h)
    back[pad] = y                                                # its scatter back (padding into the last row)
    routed_out = back[:-1]
    unsorted = torch.zeros(t * k, h, dtype=y.dtype, device=y.device)
    unsorted[order] = routed_out                                 # deterministic: each index once
    return torch.bmm(probs.reshape(t, 1, k).float(), unsorted.reshape(t, k, h).float()).to(y.dtype).squeeze(1)


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


def liger_path(x, probs, routing, run_experts):
    """Liger-Kernel's fused MoE: dispatch, experts and weighted combine in its own kernels (same weights, expert
    ids and probs)."""
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    if not isinstance(run_experts, Experts):
        raise TypeError("the Liger path fuses the experts: it has no dispatch + combine alone")
    import torch

    return LigerFusedMoEFunction.apply(x, run_experts.w13, run_experts.w2, routing[-1].to(torch.int32), probs)


def _import_status(module: str) -> str | None:
    """None where `module` imports, else why not (the benchmark's row says so)."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - ImportError, or a broken install raising anything
        return f"not importable: {type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
    return None


def liger_autotune() -> bool:
    """Whether Liger's fused MoE kernels autotune: its own `LIGER_FUSED_MOE_AUTOTUNE=0` pins one config per
    kernel, for a size whose autotuning (160 configs over six kernels) outlasts a run's time limit. A row
    measured so says it."""
    return os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "1").lower() not in ("0", "false", "no")


@contextlib.contextmanager
def parallel_autotune_compile(workers: int):
    """Inside the block, an autotuned Triton kernel's first call at a tuning key compiles all its configs at
    once in `workers` threads (Triton's `AsyncCompileMode` over `Autotuner.warmup`) before its autotuner
    benchmarks them one at a time as it always does: the configs, the timings and the choice stay the
    autotuner's own. Compiling releases the GIL (8 sm_90 variants of xkern's grouped GEMM: 5.7 s in one
    thread, 2.8 s in two on two cores); Liger's fused MoE compiles 160 configs at a new shape."""
    from concurrent.futures import ThreadPoolExecutor

    import triton
    from triton.runtime.autotuner import Autotuner

    run, warmed = Autotuner.run, set()

    def compile_first(self, *args, **kwargs):
        named = {**dict(zip(self.arg_names, args)), **kwargs}
        key = (id(self), *(named[k] for k in self.keys if k in named),
               *(str(v.dtype) for k, v in named.items() if k in self.arg_names and hasattr(v, "dtype")))
        if len(self.configs) > 1 and key not in warmed:
            warmed.add(key)
            with ThreadPoolExecutor(workers) as pool, triton.AsyncCompileMode(pool, ignore_errors=True):
                # a config that fails to compile fails again in the autotuner's own run, which skips it
                self.warmup(*args, **{k: v for k, v in kwargs.items() if k != "warmup"})
        return run(self, *args, **kwargs)

    Autotuner.run = compile_first
    try:
        yield
    finally:
        Autotuner.run = run


def liger_status(device: str) -> str | None:
    # Under Triton 3.6's interpreter (liger-kernel 0.8.5, smoke size) its routing metadata is right but its
    # forward's output is off by ~1e10 and its backward raises (a bf16 tl.atomic_add: "Unsupported data type").
    if device != "cuda":
        return "its kernels do not run under Triton's interpreter (wrong forward, bf16 atomic_add); GPU only"
    return _import_status("liger_kernel.ops.fused_moe")


def skip_reason(name: str, device: str, whole: bool) -> str | None:
    """Why a path has no row here (None: it runs)."""
    if name == "liger":
        if not whole:
            return "n/a: the gather and the weighted sum are fused into Liger's expert kernels"
        if (why := liger_status(device)) is not None:
            return f"skipped: Liger: {why}"
    return None


TORCH_PATHS = {"xkern": xkern_path, "torchtitan": torchtitan_path, "plain": plain_path, "liger": liger_path}
LAYOUTS = {xkern_path: xkern_layout}  # the paths that make their own layout from the ids (the others: `layout`)


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
        routing = (*LAYOUTS.get(path, layout)(ids, num_experts), ids)
        out = path(x, probs, routing, Experts(params[1], params[2], routing[3]))
        return (out, *torch.autograd.grad(out, [x, *params], inp["dout"]))
    with torch.no_grad():
        probs, ids = route(inp["x"], inp["w_router"], top_k)
        routing = (*LAYOUTS.get(path, layout)(ids, num_experts), ids)
    probs = probs.requires_grad_()
    out = path(x, probs, routing, lambda xp: xp)
    return (out, *torch.autograd.grad(out, [x, probs], inp["dout"]))


EXACT_BYTES = 256 * 2**20  # results up to this size are kept whole for the run-to-run check


FINGERPRINT_SLICE = 1 << 26  # elements per partial sum of `fingerprint`: 512 MiB in int64


def fingerprint(t):
    """What the run-to-run check compares: the tensor itself, or for a large one (the experts' weight
    gradients) two sums of its bits, in int64 and float64 (a changed rounding anywhere changes both)."""
    import torch

    t = t.detach()
    if t.numel() * t.element_size() <= EXACT_BYTES:
        return t.clone()
    flat = t.contiguous().view(-1)
    bits = flat.view({2: torch.int16, 4: torch.int32}[t.element_size()])
    # summed in slices: a sum with a wider dtype converts its whole input first (the DeepSeek-V3 size's
    # expert weight gradient, 7.5 G elements, would take 56 GiB in int64 or float64)
    at = range(0, flat.numel(), FINGERPRINT_SLICE)
    ints = sum(bits[i:i + FINGERPRINT_SLICE].sum(dtype=torch.int64) for i in at)
    floats = sum(flat[i:i + FINGERPRINT_SLICE].sum(dtype=torch.float64) for i in at)
    return torch.stack([ints.double(), floats]).cpu()


def same_bits(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def reference_errors(inp: dict, top_k: int, got, whole: bool) -> dict:
    """Relative L2 distance, ||got - ref|| / ||ref||, of each result of `torch_step` (named as `RESULT_NAMES`) to
    the FP32 reference: the same bf16 inputs (exact in FP32), the same expert choices (the bf16 router's top-k:
    FP32 logits could pick another expert at a near tie), every operation in FP32. The experts run one at a
    time and each weight gradient is compared as it is made (the DeepSeek-V3 size's weights alone would take
    45 GB in FP32)."""
    import torch
    import torch.nn.functional as F

    sums: dict = {}

    def add(name, value, ref):
        diff = value.detach().double() - ref.detach().double()
        sums.setdefault(name, []).append(torch.stack([(diff * diff).sum(), (ref.double() ** 2).sum()]))

    x32 = inp["x"].float().requires_grad_()
    dout = inp["dout"].float()
    with torch.no_grad():
        probs_bf16, ids = route(inp["x"], inp["w_router"], top_k)
    names = RESULT_NAMES[whole]
    if not whole:  # identity experts: out[t] = sum_j p[t, j] x[t]
        p32 = probs_bf16.float().requires_grad_()
        out = p32.sum(-1, keepdim=True) * x32
        refs = (out, *torch.autograd.grad(out, [x32, p32], dout))
        for name, value, ref in zip(names, got, refs, strict=True):
            add(name, value, ref)
    else:
        w_router = inp["w_router"].float().requires_grad_()
        top = torch.softmax(x32 @ w_router, dim=-1).gather(1, ids)
        probs = top / top.sum(-1, keepdim=True)
        t, h = x32.shape
        out, dx, dprobs = x32.new_zeros(t, h), x32.new_zeros(t, h), probs.new_zeros(t * top_k)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=inp["w13"].shape[0]).tolist()
        start = 0
        for e, n in enumerate(counts):
            copies, start = order[start:start + n], start + n
            token = copies // top_k
            xe = x32.detach()[token].requires_grad_()
            w13, w2 = (inp[w][e].float().requires_grad_() for w in ("w13", "w2"))
            pe = probs.detach().reshape(-1)[copies].requires_grad_()
            gate, up = (xe @ w13.T).chunk(2, dim=-1)
            part = pe[:, None] * ((F.silu(gate) * up) @ w2.T)
            out.index_add_(0, token, part.detach())
            gx, g13, g2, gp = torch.autograd.grad(part, [xe, w13, w2, pe], dout[token])
            dx.index_add_(0, token, gx)
            dprobs.index_add_(0, copies, gp)
            add("dw13", got[3][e], g13)
            add("dw2", got[4][e], g2)
        gx, gw = torch.autograd.grad(probs, [x32, w_router], dprobs.reshape(t, top_k))
        add("out", got[0], out)
        add("dx", got[1], dx + gx)
        add("dw_router", got[2], gw)
    errors = {}
    for name in names:
        diff2, ref2 = torch.stack(sums[name]).sum(0).tolist()
        errors[name] = (diff2 / ref2) ** 0.5 if ref2 > 0 else float(diff2 > 0)
    return errors


RESULT_NAMES = {True: ("out", "dx", "dw_router", "dw13", "dw2"), False: ("out", "dx", "dprobs")}


def ref_check(errors: dict, tol: float = REF_TOL) -> str:
    """"pass", or "fail: " naming the results past `tol` (relative L2 to the FP32 reference)."""
    bad = [f"{name} {err:.2e}" for name, err in errors.items() if not err <= tol]
    return f"fail: {', '.join(bad)} > {tol:g}" if bad else "pass"


def profile_time(row: dict, calls, sync: str) -> None:
    """The row's `profile_us` by the profiler's method too (`timing.profile_device_us`: the device's kernels
    of each call, the same for torch and JAX; GPU runs only; a failure is the row's `profile_status`, the
    rest of the row stands). `sync`: "torch_sync" or "jax_sync"."""
    from benchmarks import timing

    if timing.smoke():
        return
    try:
        row["profile_us"], row["profile_timing"], kernels = timing.profile_device_us(calls, getattr(timing, sync))
        row["profile_kernels"] = kernels[:8]
    except Exception as err:  # noqa: BLE001 - the CUDA-graph time above still stands
        row["profile_status"] = timing.error_status(err)


def measure_torch(name: str, inp: dict, top_k: int, num_experts: int, whole: bool, device: str) -> dict:
    import torch

    from benchmarks import timing

    path = TORCH_PATHS[name]
    row = {"framework": "torch", "impl": name, "part": "layer" if whole else "dispatch+combine"}
    if name == "liger" and not liger_autotune():
        row["liger_autotune"] = False
    # Liger autotunes at its first step: its configs compile in parallel first (the choice stays its own)
    first_step = (parallel_autotune_compile(os.cpu_count() or 1) if name == "liger" and device == "cuda"
                  else contextlib.nullcontext())
    try:
        with first_step:
            step = torch_step(path, inp, top_k, num_experts, whole)
        out = step[0].detach()
        row["ref_rel_l2"] = reference_errors(inp, top_k, step, whole)
        row["ref_check"] = ref_check(row["ref_rel_l2"])
        first = [fingerprint(t) for t in step]
        del step
        second = [fingerprint(t) for t in torch_step(path, inp, top_k, num_experts, whole)]
        row["bitwise_run_to_run"] = all(same_bits(a, b) for a, b in zip(first, second, strict=True))
        del first, second
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch_step(path, inp, top_k, num_experts, whole)
            torch.cuda.synchronize()
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row["us"], row["timing"] = timing.torch_device_us(
            lambda: [lambda: torch_step(path, inp, top_k, num_experts, whole)])
        profile_time(row, [lambda: torch_step(path, inp, top_k, num_experts, whole)], "torch_sync")
        row["status"] = "ok"
        row["_out"] = out
    except Exception as err:  # noqa: BLE001 - one failing path must not lose the others
        row["status"] = timing.error_status(err)
    return row


# ---------------------------------------------------------------------------------------------------
# The run


def run_size(label: str, size: dict, device: str, log, done=None, parts=PARTS, paths=PATHS) -> list[dict]:
    """The rows of the chosen `paths` and `parts` at one size; `done(rows so far)` after each (the run saves
    them: a crash keeps them)."""
    import torch

    inp = torch_inputs(size, device)
    rows = []
    for whole in [p == "layer" for p in PARTS if p in parts]:
        for name in [p for p in PATHS if p in paths]:
            part = "layer" if whole else "dispatch+combine"
            if (why := skip_reason(name, device, whole)) is not None:
                rows.append({"framework": "torch", "impl": name, "part": part, "status": why})
                continue
            row = measure_torch(name, inp, size["top_k"], size["experts"], whole, device)
            rows.append(row)
            if done is not None:
                done([{**{k: v for k, v in r.items() if not k.startswith("_")}, "size": label, **size} for r in rows])
            log(f"{label} torch {name} {part}: {row.get('us', float('nan')):.1f} us, "
                f"peak {row.get('peak_mib', float('nan')):.0f} MiB, FP32 reference {row.get('ref_check')}, "
                f"bitwise {row.get('bitwise_run_to_run')} [{row['status']}]")
            if device == "cuda":
                torch.cuda.empty_cache()
    # the output's distance to torchtitan's (both are FP32 weighted sums, rounded once to bf16)
    for part in ("layer", "dispatch+combine"):
        ref = next((r.get("_out") for r in rows if r["impl"] == "torchtitan" and r["part"] == part), None)
        for r in rows:
            if ref is not None and r.get("_out") is not None and r["part"] == part:
                diff = (r["_out"].float() - ref.float()).abs().max().item()
                r["max_abs_diff_vs_torchtitan"] = diff
                r["max_rel_diff_vs_torchtitan"] = diff / max(ref.float().abs().max().item(), 1e-30)
    for r in rows:
        r.pop("_out", None)
        r.update(size=label, **size)
    del inp
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


AUTOTUNE_OFF = " (Liger's autotune off: one config per kernel)"  # a Liger row's status, where so measured


def markdown(rows: list[dict], gpu: str) -> str:
    lines = [f"## MoE layer step (torch) on {gpu} (fwd + bwd, bf16; dispatch+combine = permute + weighted combine "
             f"alone; FP32 reference: worst relative L2 of the output and every gradient, pass <= {REF_TOL:g})", "",
             ]
    cols = []
    for r in rows:
        us, ratio, peak, ref = cells(r, rows, lambda p: p["impl"] != "xkern")
        rel = f"{r['max_rel_diff_vs_torchtitan']:.2e}" if "max_rel_diff_vs_torchtitan" in r else ""
        status = r["status"] + AUTOTUNE_OFF * (r.get("liger_autotune") is False)
        cols.append([f"{r['size']} (T={r['tokens']})", r["part"], r["impl"], us, ratio, peak, ref,
                     r.get("bitwise_run_to_run", ""), rel, status])
    return "\n".join(lines + table(["size", "part", "path", "µs", "xkern / best peer", "peak MiB", "FP32 reference",
                                    "bitwise run-to-run", "max rel diff vs torchtitan", "status"], cols))


def cells(r: dict, rows: list[dict], is_peer) -> tuple[str, str, str, str]:
    """A row's table cells: µs (the profiler's in brackets where measured), xkern's time over the best peer's
    (`is_peer(row)`) of its size and part, peak MiB, and the FP32 reference check with its worst relative L2."""
    peers = [p["us"] for p in rows if p["size"] == r["size"] and p["part"] == r["part"] and "us" in p and is_peer(p)]
    us = f"{r['us']:.1f}" + (f" ({r['profile_us']:.1f})" if "profile_us" in r else "") if "us" in r else ""
    ratio = f"{r['us'] / min(peers):.2f}x" if us and peers and r["impl"] == "xkern" else ""
    peak = "" if "peak_mib" not in r else f"{r['peak_mib']:.1f}" if r["peak_mib"] < 100 else f"{r['peak_mib']:.0f}"
    ref = f"{r['ref_check'].split(':')[0]} ({max(r['ref_rel_l2'].values()):.1e})" if "ref_rel_l2" in r else ""
    return us, ratio, peak, ref


def size_arguments(parser, name: str) -> None:
    """The arguments both MoE layer benchmarks take; `name` is the results' file name after `<gpu>-`."""
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: " + ", ".join(SIZES))
    parser.add_argument("--tokens", type=int, help="tokens per step (default: each size's own)")
    parser.add_argument("--out", help=f"directory for <gpu>-{name}[-<sizes>].json/.md (default: "
                        "benchmarks/results/<gpu kind>/ on a GPU, nothing on CPU)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, every path run through once")


def chosen_sizes(args, smoke: bool) -> dict:
    """{label: size} of the arguments (the smoke size alone when `smoke`), --tokens applied."""
    sizes = {"smoke": dict(SMOKE_SIZE)} if smoke else {s: dict(SIZES[s]) for s in args.sizes.split(",")}
    for size in sizes.values():
        if args.tokens and not smoke:
            size["tokens"] = args.tokens
    return sizes


def results_stem(out_dir: str, gpu: str, name: str, args, smoke: bool) -> str:
    """`<out_dir>/<gpu kind>-<name>[-<sizes>]`: where a run's results go."""
    from benchmarks.machine import gpu_kind

    chosen = "" if smoke or args.sizes == ",".join(SIZES) else "-" + args.sizes.replace(",", "-")
    return os.path.join(out_dir, gpu_kind(gpu) + "-" + name + chosen)


def kept_rows(stem: str, rows_of_run) -> tuple[list[dict], list[dict]]:
    """A run of some paths or parts updates its results file: the earlier rows it does not measure again
    (`rows_of_run(row)` False) and the earlier runs, from `<stem>.json` where it exists."""
    if not os.path.exists(stem + ".json"):
        return [], []
    with open(stem + ".json") as f:
        old = json.load(f)
    runs = old.get("runs") or [{k: old.get(k) for k in ("commit", "started_utc")}]
    return [r for r in old.get("rows", []) if not rows_of_run(r)], runs


def ordered(rows: list[dict]) -> list[dict]:
    """Rows by size (in the order met), part and path (`PARTS`, `PATHS`)."""
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    return sorted(rows, key=lambda r: (sizes.index(r["size"]), PARTS.index(r["part"]), PATHS.index(r["impl"])))


def write_results(out_dir: str, gpu: str, name: str, args, results: dict, md: str) -> str:
    """`results_stem(...)` .json (results) and .md: its stem."""
    os.makedirs(out_dir, exist_ok=True)
    stem = results_stem(out_dir, gpu, name, args, results["smoke"])
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(md + "\n")
    return stem


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size_arguments(parser, "moe-layer")
    for flag, names in (("parts", PARTS), ("paths", PATHS)):
        parser.add_argument(f"--{flag}", default=",".join(names),
                            help=f"comma-separated, of {', '.join(names)}; a subset updates the results file "
                            "in place (its other rows are kept)")
    args = parser.parse_args(argv)
    parts, paths = args.parts.split(","), args.paths.split(",")
    for flag, chosen, names in (("parts", parts, PARTS), ("paths", paths, PATHS)):
        if not set(chosen) <= set(names):
            parser.error(f"--{flag}: expected a comma-separated subset of {', '.join(names)}, got {chosen}")

    from benchmarks.machine import GPU, RESULTS, commit, gpu_kind, versions  # noqa: I001 - first: the platform env on CPU
    import torch

    from benchmarks import timing

    smoke = args.smoke or not GPU
    timing.set_smoke(smoke)
    device = "cuda" if GPU else "cpu"
    gpu = torch.cuda.get_device_name(0) if GPU else "cpu"
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out_dir = args.out or (os.path.join(RESULTS, gpu_kind(gpu)) if GPU and not smoke else None)
    sizes = chosen_sizes(args, smoke)
    kept, runs = [], []
    if out_dir and (set(parts) != set(PARTS) or set(paths) != set(PATHS)):
        kept, runs = kept_rows(results_stem(out_dir, gpu, "moe-layer", args, smoke),
                               lambda r: r["size"] in sizes and r["part"] in parts and r["impl"] in paths)
    run = {"commit": commit(), "started_utc": started, "parts": parts, "paths": paths}

    def save(rows, final=False):
        if out_dir:
            rows = ordered(kept + rows)
            write_results(out_dir, gpu, "moe-layer", args, {
                "gpu": gpu, "commit": commit(), "started_utc": started, "smoke": smoke, "align": ALIGN,
                "ref_tol": REF_TOL, "versions": versions(), "complete": final, "runs": runs + [run], "rows": rows},
                markdown(rows, gpu))

    rows = []
    for label, size in sizes.items():
        rows += run_size(label, size, device, lambda m: print(m, flush=True),
                         lambda partial, before=list(rows): save(before + partial), parts, paths)
    print("\n" + markdown(rows, gpu))
    save(rows, final=True)
    bad = [r for r in rows if r["impl"] == "xkern" and (r["status"] != "ok" or r.get("bitwise_run_to_run") is False
                                                         or r.get("ref_check", "pass") != "pass")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
