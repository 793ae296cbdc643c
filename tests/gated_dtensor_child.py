"""Child of tests/test_gated_rms_norm.py::test_dtensor_rows_sharded: 2 gloo CPU ranks, the gated norm on
DTensors sharded on tokens and on heads; rank 0 prints one JSON line."""

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, init_file: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.device_mesh import init_device_mesh

    from torch_api.gated_rms_norm import gated_rms_norm

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    x, z, dy = (torch.randn(4, 4, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    w = (1 + 0.3 * torch.randn(64, generator=gen)).to(torch.bfloat16)
    out = {}
    for dim, opts in ((0, {}), (1, dict(group_size=16, norm_before_gate=False))):
        leaves = [t.clone().requires_grad_() for t in (x, z, w)]
        y = gated_rms_norm(*leaves, 1e-6, **opts)
        y.backward(dy.to(y.dtype))
        dleaves = [distribute_tensor(t, mesh, [Shard(dim)]).requires_grad_() for t in (x, z)]
        dw = distribute_tensor(w, mesh, [torch.distributed.tensor.Replicate()]).requires_grad_()
        dy_d = distribute_tensor(dy.to(y.dtype), mesh, [Shard(dim)])
        yd = gated_rms_norm(*dleaves, dw, 1e-6, **opts)
        yd.backward(dy_d)
        assert isinstance(yd, DTensor) and yd.placements == (Shard(dim),)
        same = [torch.equal(a.full_tensor(), b) for a, b in ((yd, y), (dleaves[0].grad, leaves[0].grad),
                                                              (dleaves[1].grad, leaves[1].grad))]
        dw_err = (dw.grad.full_tensor().float() - leaves[2].grad.float()).abs().max().item()
        out[f"shard {dim}"] = dict(bitwise=same, dw_err=dw_err, dw_max=leaves[2].grad.float().abs().max().item())
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, os.path.join(tmp, "init")), nprocs=2)
