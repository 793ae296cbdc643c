"""What the sharded path costs over the plain one, on a 1-device mesh: the partitioning machinery alone.

RMSNorm forward + backward (bf16), each form checked against the plain call's results (bitwise where the
same kernels run; the width-sharded kernels sum each row in another order, so within the oracle's contract):
- JAX, device time of the jitted step (`timing.jax_device_us`): plain arrays (custom_partitioning with
  nothing to split), x sharded on rows (P("data", None): the rows rule, a psum over one device), x sharded
  on the width (P(None, "model"): the width-sharded kernels and their psums), and inside `jax.shard_map` (no
  custom_partitioning: the bare kernels).
- torch, host wall time per eager step (`torch.autograd.grad`, small x) and device time (large x): plain
  tensors, and DTensors on a 1-rank mesh sharded on rows (the sharding strategies) and on the width (the
  width-sharded handler).
"""

from __future__ import annotations

import functools

from benchmarks import timing
from benchmarks.rms_norm import EPS
from benchmarks.timing import error_status

SHAPES = {"cuda": (8192, 4096), "cpu": (8, 64)}       # device time
HOST_SHAPES = {"cuda": (16, 4096), "cpu": (4, 64)}    # torch host time per step
LOOP = 500


def _jax_rows(device: str, log) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_api
    from benchmarks.runner import jax_loop

    m, n = SHAPES[device]
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    keys = jax.random.split(jax.random.key(3), 3)
    x, cot = (jax.random.normal(k, (m, n), jnp.float32).astype(jnp.bfloat16) for k in keys[:2])
    w = (1 + 0.5 * jax.random.normal(keys[2], (n,), jnp.float32)).astype(jnp.bfloat16)

    def plain(x, w):
        return jax_api.rms_norm(x, w, EPS)

    def constrained(x_spec, w_spec):
        def fn(x, w):
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, x_spec))
            w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, w_spec))
            return jax_api.rms_norm(x, w, EPS)
        return fn

    forms = {"plain arrays": plain,
             "rows sharded (1-device mesh)": constrained(P("data", None), P(None)),
             "width sharded (1-device mesh)": constrained(P(None, "model"), P("model")),
             "jax.shard_map (bare kernels)": jax.shard_map(plain, mesh=mesh, in_specs=(P("data", None), P()),
                                                           out_specs=P("data", None))}
    step_of = {name: jax.jit(lambda x, w, cot, fn=fn: (lambda y, vjp: (y, *vjp(cot)))(*jax.vjp(fn, x, w)))
               for name, fn in forms.items()}
    want = [np.asarray(a.astype(jnp.float32)) for a in step_of["plain arrays"](x, w, cot)]
    rows = []
    for name, fn in forms.items():
        row = {"framework": "jax", "form": name, "shape": f"x {m}×{n} bf16"}
        rows.append(row)
        try:
            got = [np.asarray(a.astype(jnp.float32)) for a in step_of[name](x, w, cot)]
            row["bitwise_equal_plain"] = all(np.array_equal(a, b) for a, b in zip(got, want))
            row["max_rel_diff"] = max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
                                      for a, b in zip(got, want))
            step, consts, state = jax_loop(fn, "fwd+bwd", [([x, w], cot)], ())
            row["device_us"], row["timing"] = timing.jax_device_us(step, consts, state, 50.0)
        except Exception as err:  # noqa: BLE001 - one failing form must not lose the table
            row["status"] = error_status(err)
        log(f"sharded, jax, {name}: " + (f"{row['device_us']:.1f} µs/step" if "device_us" in row else row["status"]))
    return rows


@functools.cache
def _process_group(device: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)


def _torch_rows(device: str, log) -> list[dict]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import torch_api

    _process_group(device)
    mesh = init_device_mesh(device, (1,))
    forms = {"plain tensors": None, "DTensor, rows sharded (1-rank mesh)": ([Shard(0)], [Replicate()]),
             "DTensor, width sharded (1-rank mesh)": ([Shard(1)], [Shard(0)])}

    def leaves(shape, form):
        gen = torch.Generator(device=device).manual_seed(11)
        x, dy = (torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
        w = (1 + 0.5 * torch.randn(shape[-1], generator=gen, device=device)).to(torch.bfloat16)
        if form is not None:
            x, dy, w = (distribute_tensor(x, mesh, form[0]), distribute_tensor(dy, mesh, form[0]),
                        distribute_tensor(w, mesh, form[1]))
        return x.requires_grad_(), w.requires_grad_(), dy

    def step(x, w, dy):
        y = torch_api.rms_norm(x, w, EPS)
        return (y, *torch.autograd.grad(y, (x, w), dy))

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    want = [full(t).detach().float() for t in step(*leaves(SHAPES[device], None))]
    sync = (lambda _: torch.cuda.synchronize()) if device == "cuda" else (lambda _: None)
    rows = []
    for name, form in forms.items():
        row = {"framework": "torch", "form": name, "shape": f"x {SHAPES[device][0]}×{SHAPES[device][1]} bf16",
               "host_shape": f"x {HOST_SHAPES[device][0]}×{HOST_SHAPES[device][1]} bf16"}
        rows.append(row)
        try:
            args = leaves(SHAPES[device], form)
            got = [full(t).detach().float() for t in step(*args)]
            row["bitwise_equal_plain"] = all(torch.equal(a, b) for a, b in zip(got, want))
            row["max_rel_diff"] = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                                      for a, b in zip(got, want))
            small = leaves(HOST_SHAPES[device], form)
            row["wall_us"], row["issue_us"] = timing.host_us_per_call(functools.partial(step, *small), sync, LOOP)
            row["device_us"], row["timing"] = timing.torch_device_us(lambda args=args: [functools.partial(step, *args)])
        except Exception as err:  # noqa: BLE001
            row["status"] = error_status(err)
        log(f"sharded, torch, {name}: " + (f"wall {row['wall_us']:.0f} µs/step (small x), device "
                                            f"{row['device_us']:.1f} µs" if "device_us" in row else row["status"]))
    return rows


def sharded_table(device: str, log) -> list[dict]:
    """One row per (framework, form): results against the plain call, and its cost."""
    rows = []
    for table in (_jax_rows, _torch_rows):
        try:
            rows += table(device, log)
        except Exception as err:  # noqa: BLE001
            rows.append({"framework": table.__name__, "form": "setup", "status": error_status(err)})
    return rows
