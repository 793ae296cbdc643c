"""The torch ops on DTensors (torch_api/sharding.py), with gloo process groups of 2 and 4 CPU ranks.

- A Llama-style block under a torchtitan-style tensor/sequence-parallel plan (`parallelize_module`,
  `SequenceParallel` for the norms): xkern's norms run on the sequence-sharded DTensors; output and every
  gradient match the same block with eager norms on one rank.
- FSDP2 (`fully_shard`) of a small model with xkern norms: one SGD step matches the eager-norm model's.
- The gathers on DTensors: hidden-sharded and index-sharded, equal to the plain tensors' results.
- RMSNorm on a DTensor sharded on the hidden dim (1-D mesh, and rows x width on a 2-D mesh; w split like
  the width or replicated): no all-gather, y, dx and dw within the contract of the FP64 oracle.
- The other variants (Gemma, OLMo2, no weight) on DTensors sharded on rows (local) or on the width (gathered):
  y and dx bitwise equal to one rank's, dw within the oracle's contract.
- add_rms_norm on DTensors sharded on rows: y, residual_out and both input gradients bitwise one rank's; on
  the width: no all-gather, residual_out bitwise, y, the gradients and dw within the FP64 oracle's contract.
Each world size runs in one child process that spawns its ranks (rank 0 prints one line per case).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = ["tp block", "fsdp2", "gathers", "width sharded", "variants", "add rows sharded", "add width sharded"]
DIM, HEADS, SEQ, BATCH, EPS = 32, 4, 8, 2, 1e-6


@functools.cache
def _report(world: int) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, __file__, str(world)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dtensor(world, case):
    assert _report(world)[case] == "ok"


# ---------------------------------------------------------------------------------------------------
# The ranks


def _models():
    import torch
    from torch import nn
    from torch.nn import functional as F

    import torch_api

    class EagerRMSNorm(nn.Module):  # Hugging Face Llama's
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
            return self.weight * normed.to(x.dtype)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (w(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
            self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.attention_norm, self.attention = norm(DIM), Attention()
            self.ffn_norm, self.feed_forward = norm(DIM), FeedForward()

        def forward(self, x):
            h = x + self.attention(self.attention_norm(x))
            return h + self.feed_forward(self.ffn_norm(h))

    def pair(make):
        """The model with eager norms and with xkern's, the same weights (norm weights not all ones)."""
        torch.manual_seed(0)
        eager = make(EagerRMSNorm)
        with torch.no_grad():
            for name, p in eager.named_parameters():
                if "norm" in name or p.ndim == 1:
                    p.copy_(1 + 0.5 * torch.randn_like(p))
        ours = make(lambda dim: torch_api.RMSNorm(dim, EPS))
        ours.load_state_dict(eager.state_dict())
        return eager, ours

    return Block, pair


def _close(a, b, what, rtol=1e-5, atol=1e-5):
    import torch

    if not torch.allclose(a, b, rtol=rtol, atol=atol):
        raise AssertionError(f"{what}: max diff {(a - b).abs().max().item():.3g}")


def _tp_block(rank: int, world: int, mesh) -> None:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    Block, pair = _models()
    eager, ours = pair(Block)
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(ours, mesh, plan)
    seen = []
    ours.attention_norm.register_forward_hook(lambda m, i, o: seen.append((type(o), tuple(o.placements))))
    torch.manual_seed(1)
    x, dy = torch.randn(BATCH, SEQ, DIM), torch.randn(BATCH, SEQ, DIM)
    out = ours(x.chunk(world, dim=1)[rank])  # the sequence-parallel input: this rank's positions
    out.backward(dy.chunk(world, dim=1)[rank])
    want = eager(x)
    want.backward(dy)
    assert seen == [(DTensor, (Shard(1),))], f"the norm's output: {seen}"
    _close(out, want.chunk(world, dim=1)[rank], "block output")
    for (name, p), (_, q) in zip(ours.named_parameters(), eager.named_parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        _close(grad, q.grad, f"grad of {name}", rtol=1e-4)


def _fsdp2(rank: int, world: int, mesh) -> None:
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    _, pair = _models()
    eager, ours = pair(lambda norm: nn.Sequential(nn.Linear(DIM, DIM), norm(DIM), nn.Linear(DIM, DIM), norm(DIM)))
    for layer in ours:
        fully_shard(layer, mesh=mesh)
    fully_shard(ours, mesh=mesh)
    torch.manual_seed(2)
    x = torch.randn(world * 4, DIM)
    for model, batch in ((eager, x), (ours, x.chunk(world)[rank])):  # data parallel: this rank's examples
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            torch.sin(model(batch)).pow(2).mean().backward()
            opt.step()
    for (name, p), (_, q) in zip(ours.named_parameters(), eager.named_parameters()):
        _close(p.full_tensor(), q, f"{name} after two steps")


def _gathers(rank: int, world: int, mesh) -> None:
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import torch_api

    torch.manual_seed(3)
    x = torch.randn(16, 8 * world, requires_grad=True)
    idx = torch.randperm(16 + 4 * world).to(torch.int32)
    idx = torch.where(idx < 16, idx, -1)  # padding slots
    want = torch_api.permute_rows(x, idx)
    (want * 2).sum().backward()
    for x_place, idx_place in ((Shard(1), Replicate()), (Shard(0), Shard(0)), (Replicate(), Shard(0))):
        xd = distribute_tensor(x.detach(), mesh, [x_place]).requires_grad_()
        idd = distribute_tensor(idx, mesh, [idx_place])
        out = torch_api.permute_rows(xd, idd)
        (out * 2).sum().backward()
        assert torch.equal(out.full_tensor(), want), f"permute_rows, x {x_place}, idx {idx_place}"
        assert torch.equal(xd.grad.full_tensor(), x.grad), f"its grad, x {x_place}, idx {idx_place}"
        back = torch_api.unpermute_rows(out, idd, 16)
        assert torch.equal(back.full_tensor(), x.detach()), f"unpermute_rows, x {x_place}, idx {idx_place}"


def _width_sharded(rank: int, world: int, mesh) -> None:
    import torch
    from helpers import to_numpy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import torch_api
    from xkern import reference as R

    # (mesh, x's placements, w's): w split like the width, or replicated (then split by the op)
    meshes = [(mesh, [Shard(2)], [Shard(0)]), (mesh, [Shard(2)], [Replicate()])]
    if world == 4:
        meshes.append((init_device_mesh("cpu", (2, 2)), [Shard(1), Shard(2)], [Replicate(), Shard(0)]))  # rows x width
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(4)
        x, dy = torch.randn(2, 4, 8 * world).to(dtype), torch.randn(2, 4, 8 * world).to(dtype)
        w = (1 + 0.5 * torch.randn(8 * world)).to(dtype)
        want_y = R.rms_norm_fwd(to_numpy(x), to_numpy(w), EPS)
        want_dx, want_dw, dw_tol = R.rms_norm_bwd(to_numpy(x), to_numpy(w), to_numpy(dy), EPS)
        for m, places, w_places in meshes:
            xd = distribute_tensor(x, m, places).requires_grad_()
            wd = distribute_tensor(w, m, w_places).requires_grad_()
            with CommDebugMode() as comms:
                y = torch_api.rms_norm(xd, wd, EPS)
                y.backward(distribute_tensor(dy, m, places))
            counts = {str(k): v for k, v in comms.get_comm_counts().items()}
            assert not any("gather" in k for k in counts), f"{places}: {counts}"
            assert y.placements == tuple(places), y.placements
            R.check(to_numpy(y.full_tensor()), want_y, "fwd", R.rms_norm_fwd_tol(to_numpy(x), to_numpy(w), EPS))
            R.check(to_numpy(xd.grad.full_tensor()), want_dx, "dx")
            R.check(to_numpy(wd.grad.full_tensor()), want_dw, "dw", abs_ok=dw_tol)


def _variants(rank: int, world: int, mesh) -> None:
    import numpy as np
    import torch
    from helpers import to_numpy
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import torch_api
    from xkern import reference as R

    torch.manual_seed(5)
    x, dy = torch.randn(2, 4, 8 * world).to(torch.bfloat16), torch.randn(2, 4, 8 * world).to(torch.bfloat16)
    w = (0.5 * torch.randn(8 * world)).to(torch.bfloat16)
    for variant, weight in (("gemma", w), ("olmo2", w), ("llama", None)):
        xs = x.clone().requires_grad_()
        ws = None if weight is None else weight.clone().requires_grad_()
        want = torch_api.rms_norm(xs, ws, EPS, variant=variant)
        want.backward(dy)
        for place in (Shard(0), Shard(2)):  # rows: local; width: gathered (the width kernels are Llama's)
            xd = distribute_tensor(x, mesh, [place]).requires_grad_()
            wd = None if weight is None else distribute_tensor(weight, mesh, [Replicate()]).requires_grad_()
            y = torch_api.rms_norm(xd, wd, EPS, variant=variant)
            y.backward(distribute_tensor(dy, mesh, y.placements))
            what = f"{variant}, weight {weight is not None}, x {place}"
            assert torch.equal(y.full_tensor(), want), what
            assert torch.equal(xd.grad.full_tensor(), xs.grad), what
            if weight is not None:  # rows sharded: each rank's dw rounds to bf16 before the sum (one more rounding)
                want_dw = R.rms_norm_bwd(to_numpy(x), to_numpy(w), to_numpy(dy), EPS, variant)[1]
                err = np.abs(to_numpy(wd.grad.full_tensor()).astype(np.float64) - want_dw).max()
                assert err <= world * 2.0**-8 * np.abs(want_dw).max(), f"dw {what}: max error {err:.3g}"


def _add_rows_sharded(rank: int, world: int, mesh) -> None:
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import torch_api

    torch.manual_seed(6)
    x, r, dy, ds = (torch.randn(2 * world, 3, 16).to(torch.bfloat16) for _ in range(4))
    w = (1 + 0.5 * torch.randn(16)).to(torch.bfloat16)
    xs, rs = x.clone().requires_grad_(), r.clone().requires_grad_()
    want = torch_api.add_rms_norm(xs, rs, w, EPS)
    torch.autograd.backward(want, (dy, ds))
    xd, rd = (distribute_tensor(a, mesh, [Shard(0)]).requires_grad_() for a in (x, r))
    got = torch_api.add_rms_norm(xd, rd, distribute_tensor(w, mesh, [Replicate()]), EPS)
    assert all(g.placements == (Shard(0),) for g in got), [g.placements for g in got]
    torch.autograd.backward(got, tuple(distribute_tensor(a, mesh, [Shard(0)]) for a in (dy, ds)))
    for a, b in zip((*got, xd.grad, rd.grad), (*want, xs.grad, rs.grad)):
        assert torch.equal(a.full_tensor(), b)


def _add_width_sharded(rank: int, world: int, mesh) -> None:
    """The fused add on a width-sharded DTensor: no gather, residual_out bitwise one rank's, y, the inputs'
    gradient and dw within the contract of the FP64 oracle."""
    import torch
    from helpers import to_numpy
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import torch_api
    from xkern import reference as R

    torch.manual_seed(7)
    x, r, dy, ds = (torch.randn(2, 4, 8 * world).to(torch.bfloat16) for _ in range(4))
    w = (1 + 0.5 * torch.randn(8 * world)).to(torch.bfloat16)
    want_s = torch_api.add_rms_norm(x, r, w, EPS)[1]
    y64, s64 = R.add_rms_norm_fwd(to_numpy(x), to_numpy(r), to_numpy(w), EPS)
    dsum, want_dw, dw_tol = R.add_rms_norm_bwd(s64, to_numpy(w), to_numpy(dy), to_numpy(ds), EPS)
    xd, rd = (distribute_tensor(a, mesh, [Shard(2)]).requires_grad_() for a in (x, r))
    wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    with CommDebugMode() as comms:
        y, s = torch_api.add_rms_norm(xd, rd, wd, EPS)
        torch.autograd.backward((y, s), tuple(distribute_tensor(a, mesh, [Shard(2)]) for a in (dy, ds)))
    counts = {str(k): v for k, v in comms.get_comm_counts().items()}
    assert not any("gather" in k for k in counts), counts
    assert y.placements == s.placements == (Shard(2),), (y.placements, s.placements)
    assert torch.equal(s.full_tensor(), want_s)
    R.check(to_numpy(y.full_tensor()), y64, "fwd")
    R.check(to_numpy(xd.grad.full_tensor()), dsum, "dx")
    assert torch.equal(xd.grad.full_tensor(), rd.grad.full_tensor())
    R.check(to_numpy(wd.grad.full_tensor()), want_dw, "dw", abs_ok=dw_tol)


def _rank(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    report = {}
    for name, fn in zip(CASES, (_tp_block, _fsdp2, _gathers, _width_sharded, _variants, _add_rows_sharded,
                                 _add_width_sharded)):
        try:
            fn(rank, world, mesh)
            report[name] = "ok"
        except Exception as e:  # noqa: BLE001  one line per failing case, the others still run
            report[name] = f"rank {rank}: {type(e).__name__}: {e}"[:2000]
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        print(json.dumps({k: next((r[k] for r in reports if r[k] != "ok"), "ok") for k in CASES}), flush=True)
    dist.destroy_process_group()
    # Skip the interpreter's teardown: torch 2.11's gloo aborts there now and then ("terminate called without
    # an active exception"), after the report.
    os._exit(0)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    sys.path.insert(0, str(ROOT / "tests"))  # helpers, in the spawned ranks too (they inherit sys.path)
    world = int(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(world, os.path.join(tmp, "init")), nprocs=world)
