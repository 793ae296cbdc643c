"""What a call costs the host: every torch op of xkern at a small shape beside its peers and the floor of
this host.

Per call: a tight eager loop of calls with one synchronize at the end, every entry's loop taken in turn
in rounds (median), so the host's drift falls on all of them alike. `wall_us` counts that synchronize
(per call), `issue_us` stops before it (the host's time while the device keeps up), `device_us` is the
call captured in a CUDA graph and replayed (`timing.torch_device_us`). Forward calls run without autograd
(inputs that do not require grad); forward + backward is `torch.autograd.grad(f(x, w), (x, w), dy)`,
backward `torch.autograd.grad` through one kept forward. The fused add (`add_rms_norm`) and the MoE forms
(`permute_rows(top_k)`, the weighted combine) beside their peers. The floor of this host: an empty
`torch.library` custom op, an empty Triton kernel launch, an autograd.Function of (x, w) that only
allocates, and `torch.autograd.grad` through a native op (F.rms_norm's row). Public calls only, so the table
measures the same thing before and after a change to a front end's internals.
"""

from __future__ import annotations

import functools

import triton

from benchmarks import permute as P
from benchmarks import rms_norm as RN
from benchmarks import timing
from benchmarks.timing import error_status

HOST_ROWS = {"cuda": (16, 4096), "cpu": (4, 256)}          # x of the RMSNorm calls
HOST_TOKENS = {"cuda": (16, 4096), "cpu": (4, 32)}         # (T, H) of the gathers: T x top-8 rows
LOOP = 2000


@triton.jit
def _empty_kernel(X):
    pass


@functools.cache
def _empty_op():
    import torch

    @torch.library.custom_op("xkern_bench::empty", mutates_args=(), schema="(Tensor x) -> ()")
    def empty(x):
        return None

    return torch.ops.xkern_bench.empty


def _sync(device: str):
    import torch

    return (lambda _: torch.cuda.synchronize()) if device == "cuda" else (lambda _: None)


def _device_time(call) -> dict:
    """Device time of one call, in a CUDA graph (`timing.torch_device_us`): a grad row's own calls where it
    has them (`_on_device`). Where the capture fails there is no device time (an eager timing would be the
    host's)."""
    make = getattr(call, "device_calls", None) or (lambda: [call])
    try:
        us, how = timing.torch_device_us(make, eager_fallback=False)
        return {"device_us": us, "timing": how}
    except Exception as err:  # noqa: BLE001 - one failing entry must not lose the table
        return {"timing": error_status(err)}


def _on_device(call, make_calls):
    """`call` (timed on the host) with `make_calls` for its device time: a grad call's leaves and forward must
    be made on the capture's stream (`runner.torch_make_calls`). With the timed loop's leaves, made on the
    default stream, the engine synchronized with that stream and every grad row's capture failed
    (2026-12-04: the table then showed eager times as device times)."""
    call.device_calls = make_calls
    return call


def rms_inputs(device: str):
    """x, w, dy of the RMSNorm calls (HOST_ROWS, bf16, fixed seed), and x, w again as leaves that require grad."""
    import torch

    m, n = HOST_ROWS[device]
    gen = torch.Generator(device=device).manual_seed(7)
    x, dy = (torch.randn(m, n, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(n, generator=gen, device=device, dtype=torch.bfloat16)
    return x, w, dy, x.detach().requires_grad_(), w.detach().requires_grad_()


def _rms_entries(device: str):
    import torch

    from benchmarks.runner import Inputs, torch_make_calls

    x, w, dy, xg, wg = rms_inputs(device)
    inputs = Inputs([([x, w], dy)])
    shape = "x {}×{} bf16".format(*x.shape)
    for name, fn in RN.torch_impls(None).items():
        if not callable(fn):
            yield "rms_norm", "fwd", name, shape, fn
            continue
        yield "rms_norm", "fwd", name, shape, functools.partial(fn, x, w)
        yield "rms_norm", "fwd+bwd", name, shape, _on_device(
            lambda fn=fn: torch.autograd.grad(fn(xg, wg), (xg, wg), dy), torch_make_calls(fn, "fwd+bwd", inputs))
        yield "rms_norm", "bwd", name, shape, _on_device(
            functools.partial(_backward_alone, fn, xg, wg, dy, {}), torch_make_calls(fn, "bwd", inputs))


def _backward_alone(fn, x, w, dy, kept: dict):
    """The backward's share of a step: torch.autograd.grad through one forward, made on the first call."""
    import torch

    if "y" not in kept:
        kept["y"] = fn(x, w)
    return torch.autograd.grad(kept["y"], (x, w), dy, retain_graph=True)


def _gather_entries(device: str):
    import torch

    import torch_api as tp

    t, h = HOST_TOKENS[device]
    counts, n, n_pad = P.routing(t, h)
    counts_t = torch.from_numpy(counts).to(device)
    idx = P.layout(counts_t, n_pad, tp)
    idx64 = idx.long()
    inv64 = tp.inverse_permutation(idx, n).long()
    x = torch.randn(n, h, device=device, dtype=torch.bfloat16)
    y = torch.randn(n_pad, h, device=device, dtype=torch.bfloat16)
    shape = f"{t}×top-{P.TOP_K} rows, H {h} bf16"

    def index_put_inverse():
        # Padding slots write to a spare last row: a boolean mask would read its count back to the host, which
        # no CUDA graph can capture (and a failed capture leaves torch's allocator holding every freed block).
        inv = torch.full((n + 1,), -1, dtype=torch.int64, device=device)
        inv.index_put_((torch.where(idx64 >= 0, idx64, n),), torch.arange(n_pad, device=device))
        return inv[:n]

    yield "permute_rows", "fwd", "xkern (torch)", shape, functools.partial(tp.permute_rows, x, idx)
    yield "permute_rows", "fwd", "torchtitan (vstack + index)", shape, functools.partial(P.prev_permute, x, idx,
                                                                                        idx64, inv64)
    yield "permute_rows", "fwd", "index_select (no zero rows)", shape, functools.partial(
        x.index_select, 0, idx64.clamp(min=0))
    yield "unpermute_rows", "fwd", "xkern (torch)", shape, functools.partial(tp.unpermute_rows, y, idx, n)
    yield "unpermute_rows", "fwd", "index_select", shape, functools.partial(y.index_select, 0, inv64)
    yield "unpermute_rows", "fwd", "torchtitan (zeros + index_put)", shape, functools.partial(
        P.prev_unpermute, y, idx, idx64, inv64)
    yield "inverse_permutation", "fwd", "xkern (torch)", shape, functools.partial(tp.inverse_permutation, idx, n)
    yield "inverse_permutation", "fwd", "torch (full + index_put)", shape, index_put_inverse
    yield "generate_permute_indices", "fwd", "xkern (torch)", shape, functools.partial(P.layout, counts_t, n_pad, tp)


def _fused_add_entries(device: str):
    """add_rms_norm, forward and forward + backward (both outputs' cotangents), at the RMSNorm rows' shape:
    xkern and each peer of the fused-add table, and torch's native path (the add, then F.rms_norm)."""
    import torch
    import torch.nn.functional as F

    from benchmarks import add_rms_norm as AR

    x, w, dy, xg, wg = rms_inputs(device)
    r = torch.randn_like(x)
    rg = r.detach().requires_grad_()
    shape = "x {}×{} bf16".format(*x.shape)

    def native(x, r, w):
        s = x + r
        return F.rms_norm(s, (s.shape[-1],), w, RN.EPS), s

    impls = {**AR.torch_impls(), "F.rms_norm": native}
    impls.pop("torch.compile (xkern norm, fusion pass)")  # the compile path: its step is the compiled one's
    for name, fn in impls.items():
        if not callable(fn):
            yield "add_rms_norm", "fwd", name, shape, fn
            continue
        yield "add_rms_norm", "fwd", name, shape, functools.partial(fn, x, r, w)
        yield "add_rms_norm", "fwd+bwd", name, shape, \
            lambda fn=fn: torch.autograd.grad(fn(xg, rg, wg), (xg, rg, wg), (dy, dy))


def _moe_entries(device: str):
    """The MoE forms: permute_rows(top_k) from the token rows and the weighted combine unpermute_rows(top_k,
    probs), forward, against torchtitan's dispatch and combine (`benchmarks.moe_layer`), T tokens x top-8."""
    import torch

    import torch_api as tp
    from benchmarks import moe_layer as ML

    (t, h), k, e = HOST_TOKENS[device], P.TOP_K, 64
    gen = torch.Generator(device=device).manual_seed(11)
    x = torch.randn(t, h, generator=gen, device=device, dtype=torch.bfloat16)
    probs, ids = ML.route(x, torch.randn(h, e, generator=gen, device=device, dtype=torch.bfloat16), k)
    routing = ML.layout(ids, e)
    slot_copy = routing[0]
    y = torch.randn(slot_copy.numel(), h, generator=gen, device=device, dtype=torch.bfloat16)
    flat = probs.to(torch.bfloat16)
    shape = f"{t} tokens×top-{k}, H {h} bf16"
    # the layout from the router's ids: xkern's one op against the sort, counts and generate of `layout`
    yield "topk_permute_indices", "fwd", "xkern (torch)", f"{t} tokens×top-{k}, {e} experts", functools.partial(
        tp.topk_permute_indices, ids, e, alignment=ML.ALIGN)
    yield "topk_permute_indices", "fwd", "argsort + counts + generate", f"{t} tokens×top-{k}, {e} experts", \
        functools.partial(ML.layout, ids, e)
    yield "permute_rows(top_k)", "fwd", "xkern (torch)", shape, functools.partial(tp.permute_rows, x, slot_copy,
                                                                                   top_k=k)
    yield "permute_rows(top_k)", "fwd", "torchtitan", shape, functools.partial(ML.torchtitan_dispatch, x, k, routing)
    yield "unpermute_rows(top_k, probs)", "fwd", "xkern (torch)", shape, functools.partial(
        tp.unpermute_rows, y, slot_copy, t * k, top_k=k, probs=flat)
    yield "unpermute_rows(top_k, probs)", "fwd", "torchtitan", shape, functools.partial(
        ML.torchtitan_combine, y, flat, routing)


def _floor_entries(device: str):
    import torch

    x = torch.zeros(16, device=device)
    yield "floor", "fwd", "empty torch.library custom op", "x 16 fp32", functools.partial(_empty_op(), x)
    yield "floor", "fwd", "empty Triton kernel launch", "x 16 fp32", functools.partial(_empty_kernel[(1,)], x)
    # What any Python-defined differentiable op of (x, w) pays in a torch.autograd.grad step before its own
    # work: the autograd.Function machinery and one allocation per result.
    xg, wg, dy = x.clone().requires_grad_(), x.clone().requires_grad_(), torch.ones_like(x)
    alloc_only = _alloc_only_function()
    yield "floor", "fwd+bwd", "autograd.Function of (x, w), allocations only", "x 16 fp32", \
        lambda: torch.autograd.grad(alloc_only.apply(xg, wg), (xg, wg), dy)


@functools.cache
def _alloc_only_function():
    import torch

    class AllocOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, dy):
            return torch.empty_like(dy), torch.empty_like(dy)

    return AllocOnly


def host_table(device: str, log) -> list[dict]:
    """One row per (op, pass, implementation) plus the floor rows. Wall times are taken in turn
    (`timing.host_us_interleaved`), so every row of the table sees the same drift of the host."""
    rows, calls = [], {}
    for entries in (_floor_entries, _rms_entries, _fused_add_entries, _gather_entries, _moe_entries):
        try:
            for op, pass_, impl, shape, call in entries(device):
                row = {"op": op, "pass": pass_, "impl": impl, "shape": shape}
                if callable(call):
                    calls[len(rows)] = call
                else:
                    row["status"] = call
                rows.append(row)
        except Exception as err:  # noqa: BLE001
            rows.append({"op": entries.__name__, "impl": "setup", "status": error_status(err)})
    for i, got in timing.host_us_interleaved(calls, _sync(device), LOOP).items():
        if isinstance(got, BaseException):
            rows[i]["status"] = error_status(got)
            continue
        rows[i]["wall_us"], rows[i]["issue_us"] = got
        if rows[i]["op"] != "floor":
            rows[i].update(_device_time(calls[i]))
    ok = [r for r in rows if "wall_us" in r and r["impl"].startswith("xkern")]
    log("host overhead (wall µs per call): " + ", ".join(f"{r['op']} {r['pass']} {r['wall_us']:.1f}" for r in ok))
    return rows
