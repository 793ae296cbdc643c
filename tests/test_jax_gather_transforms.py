"""The JAX gathers under vmap (any batch axes, per-example or shared indices) and inside shard_map."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from helpers import same_bits

import jax_api

ROOT = Path(__file__).resolve().parents[1]


def _layout():
    counts = jnp.asarray(np.array([3, 0, 2, 4], np.int32))  # 2 ranks x 2 experts, an empty expert
    idx, _, _ = jax_api.generate_permute_indices(counts, 2, 2, 24, 4)
    return counts, idx


def test_vmap_gathers():
    counts, idx = _layout()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 9, 5)).astype(np.float32))
    shared = jax.jit(jax.vmap(jax_api.permute_rows, in_axes=(0, None)))(x, idx)  # one launch, B*H columns
    idxs = jnp.stack([idx, jnp.roll(idx, 1), idx[::-1]])
    own = jax.vmap(jax_api.permute_rows)(x, idxs)  # per-example indices
    back = jax.vmap(lambda y: jax_api.unpermute_rows(y, idx, 9))(shared)
    inv = jax.vmap(lambda i: jax_api.inverse_permutation(i, 9))(idxs)
    for i in range(3):
        assert same_bits(shared[i], jax_api.permute_rows(x[i], idx))
        assert same_bits(own[i], jax_api.permute_rows(x[i], idxs[i]))
        assert same_bits(inv[i], jax_api.inverse_permutation(idxs[i], 9))
    assert same_bits(back, x)
    nested = jax.vmap(jax.vmap(jax_api.permute_rows, in_axes=(0, None)), in_axes=(1, None), out_axes=1)(
        x[:, None], idx)
    assert same_bits(nested[:, 0], shared)
    moved = jax.vmap(jax_api.permute_rows, in_axes=(2, None), out_axes=2)(x.transpose(1, 2, 0), idx)
    assert same_bits(moved, shared.transpose(1, 2, 0))
    grads = jax.vmap(jax.grad(lambda x: jnp.sum(jax_api.permute_rows(x, idx) ** 2)))(x)
    np.testing.assert_allclose(np.asarray(grads), 2 * np.asarray(x), rtol=1e-6)
    both = jnp.stack([counts, counts[::-1]])
    gen = jax.vmap(lambda c: jax_api.generate_permute_indices(c, 2, 2, 24, 4))(both)
    for i in range(2):
        for a, b in zip(gen, jax_api.generate_permute_indices(both[i], 2, 2, 24, 4)):
            assert same_bits(a[i], b)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 3, (2, 5, 2)).astype(np.int32))  # 2 examples, top 2
    routes = jax.vmap(lambda i: jax_api.topk_permute_indices(i, 3, alignment=4))(ids)
    for i in range(2):
        for a, b in zip(routes, jax_api.topk_permute_indices(ids[i], 3, alignment=4)):
            assert same_bits(a[i], b)


_SHARD_MAP = textwrap.dedent("""
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import jax_api

    mesh = jax.make_mesh((4,), ("d",))
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 5, (4, 4)).astype(np.int32)  # per shard: 2 ranks x 2 experts
    n = counts.sum(axis=1)
    rows = int(n.max())
    x = jnp.asarray(rng.standard_normal((4 * rows, 8)).astype(np.float32))

    def local(c, x):  # each shard lays out its own rows expert-major and back
        idx, _, _ = jax_api.generate_permute_indices(c, 2, 2, rows + 8, 4)
        y = jax_api.permute_rows(x, idx)
        return jax_api.unpermute_rows(y * 2.0, idx, x.shape[0])

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d")))
    shard = jax.sharding.NamedSharding(mesh, P("d"))
    cs, x = jax.device_put(jnp.asarray(counts.reshape(-1)), shard), jax.device_put(x, shard)
    out = f(cs, x)
    g = jax.jit(jax.grad(lambda x: jnp.sum(f(cs, x) ** 2)))(x)
    x, out, g = np.asarray(x), np.asarray(out), np.asarray(g)
    for s in range(4):  # rows a shard's counts do not name come back as zeros
        k, part = int(n[s]), slice(s * rows, (s + 1) * rows)
        assert np.array_equal(out[part][:k], 2 * x[part][:k]) and not out[part][k:].any(), s
        assert np.allclose(g[part][:k], 8 * x[part][:k])
    print("shard_map ok")
""")


def test_gathers_inside_shard_map():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = subprocess.run([sys.executable, "-c", _SHARD_MAP], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "shard_map ok" in run.stdout
