"""Expert-parallel dispatch/combine (torch_api.ep) over real collectives: correctness, then timing.

    torchrun --nproc-per-node 2 -m benchmarks.ep_nccl --backend nccl --out DIR          # 2 GPUs
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 -m benchmarks.ep_nccl --backend gloo --device cpu \
        --tokens 64 --hidden 32                                                        # CPU smoke run

Correctness (every rank): random tokens, top-8 of 16/32 experts, alignment 16, through ep_dispatch -> a
per-expert linear on each m_sizes block -> ep_combine; forward and grads of x and topk_weights against a
plain-torch single-process reference over the all-gathered inputs; identity experts with unit weights
must give K*x exactly. Timing (GPU): forward dispatch+permute+unpermute+combine, xkern vs torchtitan's
permutes (zero-row vstack + index; zero-fill + index_put) around the same all-to-alls, bf16, identity
experts; per iteration the slowest rank counts (the step ends when both have), median over iterations.
"""

from __future__ import annotations

import os

# NVLink multicast can take the shared host's GPUs out of service (device docs): off before any process
# group or CUDA context exists, whatever the caller's environment says.
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(_NO_MULTICAST)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_api  # noqa: E402
from torch_api.permute import generate_permute_indices  # noqa: E402

TOP_K, ALIGN = 8, 16


def log(*a) -> None:
    print(f"[rank {dist.get_rank()}]", *a, flush=True)


# ---------------------------------------------------------------------------------------------------
# Correctness


def gather_rows(t: torch.Tensor) -> list[torch.Tensor]:
    """All ranks' t (row counts may differ): pad to the longest, all_gather, cut (gloo and NCCL alike)."""
    n = torch.tensor([t.shape[0]], device=t.device)
    ns = [torch.empty_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(ns, n)
    ns = [int(v) for v in ns]
    pad = t.new_zeros((max(ns), *t.shape[1:]))
    pad[: t.shape[0]] = t
    out = [torch.empty_like(pad) for _ in ns]
    dist.all_gather(out, pad)
    return [o[:k] for o, k in zip(out, ns)]


def pick_experts(t: int, num_experts: int, empty: list[int], g: torch.Generator) -> torch.Tensor:
    """Distinct top-k experts per token, never one of `empty`."""
    allowed = torch.tensor([e for e in range(num_experts) if e not in empty])
    if t == 0:
        return torch.empty(0, TOP_K, dtype=torch.long)
    return allowed[torch.rand(t, len(allowed), generator=g).argsort(1)[:, :TOP_K]]


def reference(xs, ids, ws, lin):
    """Single-process MoE over all ranks' tokens: out[t] = sum_k w[t,k] * x[t] @ lin[ids[t,k]]."""
    x, i, w = torch.cat(xs), torch.cat(ids), torch.cat(ws)
    out = x.new_zeros(x.shape[0], lin.shape[2])
    for e in range(lin.shape[0]):
        t, k = torch.nonzero(i == e, as_tuple=True)
        out = out.index_add(0, t, w[t, k, None] * (x[t] @ lin[e]))
    return out


def check_case(name, tokens, num_experts, empty, hidden, dev, seed) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    e_local = num_experts // world
    g = torch.Generator().manual_seed(seed * 1000 + rank)  # this rank's own tokens
    # Small integers over 4: K*x and the reference sums are exact in fp32 and bf16 whatever the order.
    x = (torch.randint(-16, 17, (tokens, hidden), generator=g) / 4).to(dev)
    ids = pick_experts(tokens, num_experts, empty, g).to(dev)
    w = torch.rand(tokens, TOP_K, generator=g).to(dev)
    dout = torch.randn(tokens, hidden, generator=g).to(dev)
    lin = (torch.randn(num_experts, hidden, hidden, generator=torch.Generator().manual_seed(seed))
           / hidden ** 0.5).to(dev)  # expert weights: the same on every rank

    xs, idss, wss, douts = gather_rows(x), gather_rows(ids), gather_rows(w), gather_rows(dout)
    ok, why = True, []

    # forward + backward through the collectives
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    xp, m_sizes, m_offsets, handle = torch_api.ep_dispatch(xg, ids, num_experts, alignment=ALIGN)
    sizes = m_sizes.tolist()
    n_e = [int((torch.cat(idss) == rank * e_local + e).sum()) for e in range(e_local)]
    want_sizes = [-(-max(n, ALIGN) // ALIGN) * ALIGN for n in n_e]
    if sizes != want_sizes or m_offsets.tolist() != torch.tensor(want_sizes).cumsum(0).tolist():
        ok, why = False, why + [f"m_sizes {sizes} != {want_sizes}"]
    yp = torch.cat([blk @ lin[rank * e_local + e] for e, blk in enumerate(xp.split(sizes))])
    out = torch_api.ep_combine(yp, wg, handle)
    (out * dout).sum().backward()

    xr = [t.clone().requires_grad_() for t in xs]
    wr = [t.clone().requires_grad_() for t in wss]
    ref = reference(xr, idss, wr, lin)
    (ref * torch.cat(douts)).sum().backward()
    lo, hi = sum(len(t) for t in xs[:rank]), sum(len(t) for t in xs[: rank + 1])
    for what, got, want in [("out", out, ref[lo:hi]), ("dx", xg.grad, xr[rank].grad),
                            ("dw", wg.grad, wr[rank].grad)]:
        if got is None and want is None:
            continue
        try:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        except (AssertionError, TypeError) as err:
            ok, why = False, why + [f"{what}: {str(err).splitlines()[0]}"]

    # every token returns to its place: identity experts, unit weights -> K*x bit for bit (fp32 and bf16)
    for dtype in (torch.float32, torch.bfloat16):
        xb = x.to(dtype)
        xp, _, _, handle = torch_api.ep_dispatch(xb, ids, num_experts, alignment=ALIGN)
        back = torch_api.ep_combine(xp, torch.ones(tokens, TOP_K, device=dev), handle)
        if not torch.equal(back, xb * TOP_K):
            ok, why = False, why + [f"identity {dtype} not exact"]

    log(f"{'PASS' if ok else 'FAIL'} {name} (T={tokens}, E={num_experts}, K={TOP_K}, H={hidden})"
        + ("" if ok else ": " + "; ".join(why)))
    return ok


def correctness(args, dev) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    t = args.tokens
    cases = [  # name, tokens on this rank, num_experts, experts nobody picks
        ("uniform-16", t, 16, []),
        ("uniform-32", t, 32, []),
        # rank 1's first expert and one of rank 0's receive nothing: empty blocks are padding only
        ("empty-experts-32", t, 32, [32 // world, 3]),
        # the last rank sends nothing (and one expert of every rank stays empty)
        ("zero-tokens-last-rank-16", 0 if rank == world - 1 else t, 16,
         [r * (16 // world) + 1 for r in range(world)]),
    ]
    results = {}
    for i, (name, tokens, e, empty) in enumerate(cases):
        results[name] = check_case(name, tokens, e, empty, args.hidden, dev, seed=i + 1)
    return results


# ---------------------------------------------------------------------------------------------------
# Timing: forward dispatch + permute + (identity experts) + unpermute + combine


def _a2a(x, out_splits, in_splits):
    out = x.new_empty((sum(out_splits), x.shape[1]))
    dist.all_to_all_single(out, x, out_splits, in_splits)
    return out


def previous_step(x, ids, w, num_experts):
    """The same collectives and index generation, with torchtitan's permutes (zero-row vstack +
    index; zero-fill + index assignment)."""
    world = dist.get_world_size()
    el = num_experts // world
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    send_counts = torch.bincount(flat, minlength=num_experts)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    host = torch.cat([send_counts, recv_counts]).tolist()
    send = [sum(host[r * el:(r + 1) * el]) for r in range(world)]
    recv_h = host[num_experts:]
    recv = [sum(recv_h[r * el:(r + 1) * el]) for r in range(world)]
    max_len = sum(-(-max(sum(recv_h[r * el + e] for r in range(world)), ALIGN) // ALIGN) * ALIGN
                  for e in range(el))
    rows = _a2a(x[order // TOP_K], recv, send)
    idx, _, _ = generate_permute_indices(recv_counts, el, world, max_len, ALIGN)
    idx = idx.long()
    xp = torch.vstack((rows, rows.new_zeros((1, rows.shape[1]))))[idx]   # permute: -1 reads the zero row
    yp = xp                                                                # identity experts
    back = yp.new_zeros((rows.shape[0] + 1, yp.shape[1]))
    back[idx] = yp                                                         # unpermute: padding -> last row
    got = _a2a(back[:-1], send, recv)
    tk = x.new_zeros((flat.shape[0], x.shape[1]))
    tk[order] = got
    return (tk.view(-1, TOP_K, x.shape[1]) * w.unsqueeze(-1)).sum(1)


def xkern_step(x, ids, w, num_experts):
    xp, _, _, handle = torch_api.ep_dispatch(x, ids, num_experts, alignment=ALIGN)
    return torch_api.ep_combine(xp, w, handle)


def time_step(fn, inputs, iters, warmup, dev) -> float:
    """Median over iterations of the slowest rank's time, µs. Barrier first so ranks start together."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(*inputs)
            b.record()
            b.synchronize()
            us = 1e3 * a.elapsed_time(b)
        else:
            t0 = time.perf_counter()
            fn(*inputs)
            us = 1e6 * (time.perf_counter() - t0)
        if i >= warmup:
            times.append(us)
    t = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def timing(args, dev) -> list[dict]:
    rank = dist.get_rank()
    if dev.type == "cuda":
        shapes, iters, warmup = [(t, h) for t in (8192, 16384) for h in (2048, 7168)], args.iters, 5
    else:  # interpreter: one iteration at the tiny size only exercises the code
        shapes, iters, warmup = [(args.tokens, args.hidden)], 1, 0
    rows = []
    for t, h in shapes:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(t, h, generator=g).to(dev, torch.bfloat16)
        ids = pick_experts(t, args.experts, [], g).to(dev)
        w = torch.rand(t, TOP_K, generator=g).to(dev, torch.bfloat16)
        with torch.no_grad():
            same = torch.equal(xkern_step(x, ids, w, args.experts), previous_step(x, ids, w, args.experts))
            row = {"tokens_per_rank": t, "hidden": h, "experts": args.experts, "top_k": TOP_K, "dtype": "bfloat16",
                   "iters": iters, "outputs_equal": same,
                   "xkern_us": time_step(xkern_step, (x, ids, w, args.experts), iters, warmup, dev),
                   "previous_us": time_step(previous_step, (x, ids, w, args.experts), iters, warmup, dev)}
        row["speedup"] = row["previous_us"] / row["xkern_us"]
        rows.append(row)
        del x, ids, w
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------------


def versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton
        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    if torch.cuda.is_available():
        v["cuda"] = torch.version.cuda
        nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in old ones
        v["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    try:
        v["git"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        v["git"] = None
    return v


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank for correctness (and CPU timing)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size for correctness (and CPU timing)")
    p.add_argument("--experts", type=int, default=32, help="experts for timing")
    p.add_argument("--iters", type=int, default=30, help="timed iterations on GPU (median)")
    args = p.parse_args()

    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 reference comparisons at 1e-4
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print({k: os.environ[k] for k in _NO_MULTICAST}, flush=True)
        print(f"world={world} backend={args.backend} device={args.device} "
              f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}", flush=True)
    try:
        checks = correctness(args, dev)
        bad = torch.tensor([0 if all(checks.values()) else 1], device=dev)
        dist.all_reduce(bad)  # one verdict for all ranks
        all_checks = [None] * world
        dist.all_gather_object(all_checks, checks)
        rows = timing(args, dev)
        if rank == 0:
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
                if args.device == "cuda" else []
            tag = re.sub(r"[^A-Za-z0-9]+", "-", gpus[0]).strip("-").lower() if gpus else "cpu"
            report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "versions": versions(),
                      "gpus": gpus, "world_size": world, "backend": args.backend,
                      "env": {k: os.environ[k] for k in _NO_MULTICAST},
                      "correctness": {f"rank{r}": c for r, c in enumerate(all_checks)},
                      "correctness_pass": int(bad) == 0, "timing": rows}
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, f"ep-nccl-{tag}-{datetime.date.today().isoformat()}.json")
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
            print(f"\n{'T/rank':>7} {'H':>5} {'xkern us':>10} {'previous us':>12} {'speedup':>8} equal")
            for r in rows:
                print(f"{r['tokens_per_rank']:>7} {r['hidden']:>5} {r['xkern_us']:>10.1f} "
                      f"{r['previous_us']:>12.1f} {r['speedup']:>8.2f} {r['outputs_equal']}")
            print(f"correctness: {'PASS' if int(bad) == 0 else 'FAIL'}; wrote {path}", flush=True)
    finally:
        dist.destroy_process_group()
    return 1 if int(bad) else 0


if __name__ == "__main__":
    sys.exit(main())
