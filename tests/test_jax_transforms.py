"""The transformation matrix of docs/transformations.md: every public jax_api op under every JAX transformation,
each result judged against a float64 jnp expression of the op's math (`jax.enable_x64`), at float32, bfloat16
and float16. This process (one CPU device): jit, jvp, linearize, jacfwd, jacrev, vjp, grad, grad of grad,
hessian, forward-over-reverse, vmap (over every argument, the weight included, and over x alone), vmap of grad,
scan over layers, checkpoint with policies. A child per device count (4, and 8 in the slow tier): shard_map,
auto-sharded jit, expert parallelism; a compiler child: jax.export for CUDA. Tiny shapes: Triton's interpreter.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_api as xj

ROOT = Path(__file__).resolve().parent.parent
EPS = 1e-6
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# normwise: max |got - ref| <= TOL * max(1, max |ref|); a few roundings of the dtype, in sums of a few terms
TOL = {"float32": 1e-4, "bfloat16": 6e-2, "float16": 8e-3}
H = 8  # the hidden width of every case


# ---------------------------------------------------------------------------------------------------
# The ops: each `make(dtype, rows)` gives (f, ref, args): f(*args) one array through xkern, ref the same math in
# jnp (called on float64 arrays), args the differentiable inputs (indices and offsets are closed over).


def _rand(rng, shape, dtype, lo=None):
    a = rng.standard_normal(shape) if lo is None else lo + rng.random(shape)
    return jnp.asarray(a, dtype)


def _norm(x, w=None, variant="llama"):
    n = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)
    return n if w is None else n * (1 + w) if variant == "gemma" else n * w


def _slots(rows: int, rng):
    """A permutation of `rows` rows into rows * 3 / 2 slots, a third of them padding (-1)."""
    idx = np.concatenate([rng.permutation(rows), [-1] * (rows // 2)])
    return jnp.asarray(rng.permutation(idx), jnp.int32)


def _take(a, idx, scale=1):
    """a's rows at idx // scale, a zero row at -1 (jnp)."""
    return jnp.where((idx >= 0)[:, None], a[jnp.maximum(idx, 0) // scale], 0)


def _inverse(idx, n):
    slots = jnp.arange(idx.shape[0], dtype=idx.dtype)
    return jnp.full(n, -1, idx.dtype).at[jnp.where(idx >= 0, idx, n)].set(slots, mode="drop")


def make(op: str, dtype, rows: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = _rand(rng, (rows, H), dtype)
    w = _rand(rng, (H,), dtype, lo=0.5)
    if op in ("rms_norm", "rms_norm gemma"):
        variant = op.split()[-1] if " " in op else "llama"
        return (lambda x, w: xj.rms_norm(x, w, EPS, variant=variant),
                lambda x, w: _norm(x, w, variant), (x, w))
    if op == "rms_norm no weight":
        return lambda x: xj.rms_norm(x, None, EPS), _norm, (x,)
    if op == "add_rms_norm":
        def f(x, r, w):
            y, res = xj.add_rms_norm(x, r, w, EPS)
            return y + res
        return f, lambda x, r, w: _norm(x + r, w) + x + r, (x, _rand(rng, (rows, H), dtype), w)
    if op.startswith("gated_rms_norm"):  # groups of 4 columns; "gate first": the gate before the norm, sigmoid
        first = op.endswith("gate first")
        opts = dict(group_size=4, norm_before_gate=not first, activation="sigmoid" if first else "silu")

        def ref(x, z, w):
            a = jax.nn.sigmoid(z) if first else z * jax.nn.sigmoid(z)
            h = x * a if first else x
            n = _norm(h.reshape(rows, 2, 4)).reshape(rows, H) * w
            return n if first else n * a

        return lambda x, z, w: xj.gated_rms_norm(x, z, w, EPS, **opts), ref, (x, _rand(rng, (rows, H), dtype), w)
    idx = _slots(rows, rng)
    if op == "permute_rows":
        return lambda x: xj.permute_rows(x, idx), lambda x: _take(x, idx), (x,)
    if op == "unpermute_rows":
        y = _rand(rng, (rows + rows // 2, H), dtype)
        return (lambda y: xj.unpermute_rows(y, idx, rows), lambda y: _take(y, _inverse(idx, rows)), (y,))
    top_k, tokens = 2, rows // 2
    if op == "permute_rows top_k":  # dispatch from token rows: slot s reads token idx[s] // top_k
        return (lambda x: xj.permute_rows(x, idx, top_k=top_k), lambda x: _take(x, idx, top_k), (x[:tokens],))
    if op == "unpermute_rows probs":  # the weighted combine, differentiable in y and probs
        y, probs = _rand(rng, (rows + rows // 2, H), dtype), _rand(rng, (tokens, top_k), dtype, lo=0.0)

        def ref(y, p):
            copies = _take(y, _inverse(idx, rows)).reshape(tokens, top_k, H)
            return jnp.einsum("tkh,tk->th", copies, p)

        return (lambda y, p: xj.unpermute_rows(y, idx, rows, top_k=top_k, probs=p), ref, (y, probs))
    if op == "grouped_mm":  # two experts over rows slots, the last row past the last offset
        offs = jnp.asarray([rows // 2, rows - 1], jnp.int32)
        wg = _rand(rng, (2, H, H), dtype) / 3

        def ref(x, w):
            e = jnp.searchsorted(offs, jnp.arange(x.shape[0]), side="right")
            return jnp.where((e < 2)[:, None], jnp.einsum("sk,skn->sn", x, w[jnp.minimum(e, 1)]), 0)

        return lambda x, w: xj.grouped_mm(x, w, offs), ref, (x, wg)
    raise ValueError(op)


OPS = ["rms_norm", "rms_norm gemma", "rms_norm no weight", "add_rms_norm", "gated_rms_norm",
       "gated_rms_norm gate first", "permute_rows", "permute_rows top_k", "unpermute_rows",
       "unpermute_rows probs", "grouped_mm"]


# ---------------------------------------------------------------------------------------------------
# The transformations: each `T(f, args, tangents, cts, acc)` gives a pytree of arrays; acc is the dtype of the
# loss's arithmetic (float32 here, float64 for the reference).


def _loss(f, acc):
    return lambda *a: jnp.sum(jnp.sin(f(*a).astype(acc)))


def _all(args):
    return tuple(range(len(args)))


def _scan(f, args, acc):
    """Two layers, each its own inputs (the weight too), the losses summed in a scan; and its gradient."""
    stacked = tuple(jnp.stack([a, a * 0.75]) for a in args)

    def total(*layers):
        return jax.lax.scan(lambda c, a: (c + _loss(f, acc)(*a), None), jnp.zeros((), acc), layers)[0]

    return total(*stacked), jax.grad(total, _all(args))(*stacked)


def _grad_dot(f, args, acc):
    """<grad L, v> for a fixed v: linear in the gradient, so its gradient (a Hessian-vector product) is as well
    conditioned as the gradient itself at a 16-bit dtype."""
    def dot(*a):
        grads = jax.grad(_loss(f, acc), _all(args))(*a)
        return sum(jnp.sum(g.astype(acc) * jnp.linspace(-1, 1, g.size, dtype=acc).reshape(g.shape)) for g in grads)

    return dot


def _remat(f, args, acc):
    policies = (jax.checkpoint_policies.nothing_saveable, jax.checkpoint_policies.dots_saveable,
                jax.checkpoint_policies.everything_saveable)
    return [jax.grad(jax.checkpoint(_loss(f, acc), policy=p), _all(args))(*args) for p in policies]


TRANSFORMS = {
    "jit": lambda f, a, t, c, acc: jax.jit(f)(*a),
    "jvp": lambda f, a, t, c, acc: jax.jvp(f, a, t),
    "linearize": lambda f, a, t, c, acc: jax.linearize(f, *a)[1](*t),
    "jacfwd": lambda f, a, t, c, acc: jax.jacfwd(f)(*a),  # in the first argument: tiny Jacobians
    "jacrev": lambda f, a, t, c, acc: jax.jacrev(f)(*a),
    "vjp": lambda f, a, t, c, acc: jax.vjp(f, *a)[1](c),
    "grad": lambda f, a, t, c, acc: jax.grad(_loss(f, acc), _all(a))(*a),
    "grad of grad": lambda f, a, t, c, acc: jax.grad(_grad_dot(f, a, acc), _all(a))(*a),
    "hessian": lambda f, a, t, c, acc: jax.hessian(_loss(f, acc))(*a),
    "hvp": lambda f, a, t, c, acc: jax.jvp(jax.grad(_loss(f, acc), _all(a)), a, t)[1],
    "vmap": lambda f, a, t, c, acc: jax.vmap(f)(*(jnp.stack([u, v]) for u, v in zip(a, t))),
    "vmap x": lambda f, a, t, c, acc: jax.vmap(f, (0,) + (None,) * (len(a) - 1))(jnp.stack([a[0], t[0]]), *a[1:]),
    "vmap grad": lambda f, a, t, c, acc: jax.vmap(jax.grad(_loss(f, acc), _all(a)), (0,) + (None,) * (len(a) - 1))(
        jnp.stack([a[0], t[0]]), *a[1:]),
    "scan": lambda f, a, t, c, acc: _scan(f, a, acc),
    "remat": lambda f, a, t, c, acc: _remat(f, a, acc),
}
# The default tier (under 30 s in the interpreter) samples the matrix: forward mode and second order of each op
# family at float32, one 16-bit cell; every other cell runs in the slow tier.
DEFAULT = {("rms_norm", "float32", "jvp"), ("rms_norm", "float32", "grad of grad"), ("rms_norm", "bfloat16", "jvp"),
           ("add_rms_norm", "float32", "hvp"), ("permute_rows", "float32", "jvp"),
           ("unpermute_rows probs", "float32", "hvp"), ("grouped_mm", "float32", "jvp"),
           ("gated_rms_norm", "float32", "vmap grad"), ("gated_rms_norm", "float32", "grad of grad"),
           ("gated_rms_norm gate first", "float32", "hessian"), ("gated_rms_norm", "bfloat16", "jacrev")}


def compare(got, want, dtype_name: str, what: str) -> None:
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, (what, g.shape, w.shape)
        err = np.abs(g - w).max() if g.size else 0.0
        bound = TOL[dtype_name] * max(1.0, np.abs(w).max() if w.size else 0.0)
        assert err <= bound, f"{what}: max error {err:.3g} over {bound:.3g}"


def run_cell(op: str, dtype_name: str, transform: str, rows: int = 4) -> None:
    f, ref, args = make(op, DTYPES[dtype_name], rows)
    rng = np.random.default_rng(1)
    tangents = tuple(_rand(rng, a.shape, a.dtype) for a in args)
    out = jax.eval_shape(f, *args)
    cts = _rand(rng, out.shape, out.dtype)
    got = TRANSFORMS[transform](f, args, tangents, cts, jnp.float32)
    with jax.enable_x64(True):
        as64 = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
        want = TRANSFORMS[transform](ref, tuple(map(as64, args)), tuple(map(as64, tangents)), as64(cts), jnp.float64)
    compare(got, want, dtype_name, f"{op} {dtype_name} {transform}")


CELLS = [pytest.param(op, d, t, marks=() if (op, d, t) in DEFAULT else pytest.mark.slow)
         for op in OPS for d in DTYPES for t in TRANSFORMS]


@pytest.mark.parametrize("op,dtype,transform", CELLS)
def test_transform(op, dtype, transform):
    run_cell(op, dtype, transform)


# ---------------------------------------------------------------------------------------------------
# What the transforms must keep: jax.grad runs the backward kernels (not a jnp transpose), and a vmapped
# backward is one launch per kernel.


def _launches(monkeypatch, fn, *args) -> list[str]:
    from jax_api import _launch

    names = []
    inner = _launch._interpret

    def counted(plan, *rest):
        names.append(plan.kernel.fn.__name__)
        return inner(plan, *rest)

    monkeypatch.setattr(_launch, "_interpret", counted)
    jax.block_until_ready(fn(*args))
    return names


# The launches are counted in the interpreter's callback; on a GPU, tests/test_export_cuda.py names the kernels of
# the exported grad.
interpreter_only = pytest.mark.skipif("jax.default_backend() != 'cpu'", reason="counts the interpreter's launches")


@interpreter_only
def test_grad_runs_the_backward_kernels(monkeypatch):
    f, _, (x, w) = make("rms_norm", jnp.float32)
    ran = _launches(monkeypatch, jax.jit(jax.grad(_loss(f, jnp.float32), (0, 1))), x, w)
    assert ran == ["_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"], ran  # one program: it writes dw itself
    # vmapped over x: still one forward and one backward launch (a batch grid axis), not one per example
    vmapped = jax.jit(jax.vmap(jax.grad(_loss(f, jnp.float32), (0, 1)), (0, None)))
    ran = _launches(monkeypatch, vmapped, jnp.stack([x, -x, 2 * x]), w)
    assert ran == ["_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"], ran
    # forward mode: the forward kernel and a jnp tangent, no backward kernel
    ran = _launches(monkeypatch, jax.jit(lambda a, b: jax.jvp(f, (a, b), (b * a, b))), x, w)
    assert ran == ["_rms_norm_fwd_kernel"], ran


@interpreter_only
def test_grad_of_permute_and_grouped_mm_run_their_kernels(monkeypatch):
    f, _, (x,) = make("permute_rows", jnp.float32)
    ran = _launches(monkeypatch, jax.jit(jax.grad(_loss(f, jnp.float32))), x)
    assert sorted(ran) == sorted(["_gather_rows_kernel", "_gather_rows_kernel", "_inverse_search_kernel"]), ran
    f, _, (x, w) = make("grouped_mm", jnp.float32)
    ran = _launches(monkeypatch, jax.jit(jax.grad(_loss(f, jnp.float32), (0, 1))), x, w)
    assert len(ran) == 3, ran  # forward, dx, dw


@interpreter_only
def test_gated_grad_runs_the_backward_kernel(monkeypatch):
    """jax.grad of gated_rms_norm runs the joint backward kernel; per-example gradients (vmap over x, gate and the
    weight) are each example's own grad bit for bit, one forward and one backward per example (a dw each)."""
    f, _, (x, z, w) = make("gated_rms_norm", jnp.float32)
    grad = jax.grad(_loss(f, jnp.float32), (0, 1, 2))
    ran = _launches(monkeypatch, jax.jit(grad), x, z, w)
    assert ran == ["_gated_rms_norm_fwd_kernel", "_gated_rms_norm_bwd_kernel", "_dw_reduce_kernel"], ran
    batch = [(x, z, w), (-x, 2 * z, 2 * w)]
    stacked = [jnp.stack(a) for a in zip(*batch)]
    ran = _launches(monkeypatch, jax.jit(jax.vmap(grad)), *stacked)
    assert sorted(ran) == sorted(["_gated_rms_norm_fwd_kernel", "_gated_rms_norm_bwd_kernel", "_dw_reduce_kernel"]
                                 * 2), ran
    per_example = jax.jit(jax.vmap(grad))(*stacked)
    for k, args in enumerate(batch):
        for got, want in zip(per_example, jax.jit(grad)(*args)):
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want))
    ran = _launches(monkeypatch, jax.jit(lambda *a: jax.jvp(f, a, a)), x, z, w)
    assert ran == ["_gated_rms_norm_fwd_kernel"], ran


def test_integer_inputs_get_float0_tangents():
    """The index ops run under jvp and grad of a float function (their outputs carry no tangent)."""
    ids = jnp.asarray([[0, 2], [1, 0], [2, 1]], jnp.int32)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, H)), jnp.float32)

    def f(x, ids):
        idx, _, offs = xj.topk_permute_indices(ids, 3, alignment=1)
        return xj.permute_rows(x, idx, top_k=2)

    y, t = jax.jvp(f, (x, ids), (x, np.zeros(ids.shape, jax.dtypes.float0)))
    np.testing.assert_array_equal(np.asarray(t), np.asarray(y))  # linear in x
    g = jax.grad(lambda x, ids: jnp.sum(f(x, ids)), allow_int=True, argnums=(0, 1))(x, ids)
    assert g[1].dtype == jax.dtypes.float0
    np.testing.assert_array_equal(np.asarray(g[0]), 2.0)  # each token in top_k = 2 slots


def test_index_ops_under_jit_vmap_scan_remat():
    """The integer ops (no derivative) under jit, vmap, scan and checkpoint: the oracle's values."""
    from xkern import reference as R

    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(0, 3, (2, 4, 2)), jnp.int32)  # two layers' routing, 4 tokens, top 2
    counts = jnp.asarray(rng.integers(0, 3, (2, 4)), jnp.int32)

    def layer(carry, a):
        i, c = a
        idx, sizes, offs = xj.topk_permute_indices(i, 3, 12, alignment=2)
        inv = xj.inverse_permutation(idx, 8)
        gen = xj.generate_permute_indices(c, 2, 2, 12, 2)
        return carry, (idx, sizes, offs, inv, *gen)

    scanned = jax.jit(lambda ids, counts: jax.lax.scan(jax.checkpoint(layer), 0, (ids, counts))[1])(ids, counts)
    vmapped = jax.vmap(lambda i, c: layer(0, (i, c))[1])(ids, counts)
    for k in range(2):
        topk = R.topk_permute_indices(np.asarray(ids[k]), 3, 12, 2)
        want = (*topk, R.inverse_permutation(topk[0], 8),
                *R.generate_permute_indices(np.asarray(counts[k]), 2, 2, 12, 2))
        for got in (scanned, vmapped):
            for g, w in zip(got, want):
                np.testing.assert_array_equal(np.asarray(g[k]), np.asarray(w))


# ---------------------------------------------------------------------------------------------------
# The device counts: shard_map and auto-sharded jit of every op (jit, jvp, grad), expert parallelism. The
# explicit-sharded jit column is tests/test_sharding.py's (explicit meshes).

# which arguments split by rows over the mesh (the rest replicated), per op: x, and add_rms_norm's residual, the
# gate and the combine's probs (one row per token)
ROW_ARGS = {op: (0, 1) if op in ("add_rms_norm", "unpermute_rows probs") or op.startswith("gated") else (0,)
            for op in OPS}
SHARDED_CELLS = [f"{op}: {mode}" for op in OPS for mode in ("shard_map", "sharded jit")] + [
    "rms_norm_tp: shard_map", "ep: shard_map", "index ops: sharded jit"]


def _sharded_transforms(F, args, tangents, acc):
    return {"out": jax.jit(F)(*args), "jvp": jax.jit(lambda *a: jax.jvp(F, a, tangents)[1])(*args),
            "grad": jax.jit(jax.grad(_loss(F, acc), _all(args)))(*args)}


def _check_sharded(op: str, mode: str, n_dev: int) -> None:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((n_dev,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = ROW_ARGS[op]
    if mode == "shard_map":  # each shard its own rows and local indices (the same on every shard)
        f, ref, local = make(op, jnp.float32, rows=4)
        args = tuple(jnp.concatenate([a * (1 + s / 4) for s in range(n_dev)]) if i in rows else a
                     for i, a in enumerate(local))
        specs = tuple(P("d") if i in rows else P() for i in range(len(args)))

        def per_shard(fn):
            return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("d"))

        F, F_ref = per_shard(f), per_shard(ref)
    else:  # one global op over the sharded arrays
        F, F_ref, args = make(op, jnp.float32, rows=4 * n_dev)
        args = tuple(jax.device_put(a, NamedSharding(mesh, P("d") if i in rows else P())) for i, a in enumerate(args))
    rng = np.random.default_rng(1)
    tangents = tuple(jax.device_put(_rand(rng, a.shape, a.dtype), a.sharding) for a in args)
    got = _sharded_transforms(F, args, tangents, jnp.float32)
    with jax.enable_x64(True):
        as64 = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
        want = _sharded_transforms(F_ref, tuple(map(as64, args)), tuple(map(as64, tangents)), jnp.float64)
    for key in got:
        compare(got[key], want[key], "float32", f"{op} {mode} {key}")
    if mode == "sharded jit" and "norm" in op:  # the rows stay split
        assert got["out"].sharding.spec[0] == "d", got["out"].sharding


def _check_tp(n_dev: int) -> None:
    """rms_norm_tp inside shard_map, the width split over "model" (rows over "data"): jit, jvp, grad and
    forward-over-reverse against the whole-width math."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, n_dev // 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    f, ref, args = make("rms_norm", jnp.float32, rows=4)
    x, w = (jnp.tile(a, (1,) * (a.ndim - 1) + (n_dev // 2,)) for a in args)  # H per device
    F = jax.shard_map(lambda x, w: xj.rms_norm_tp(x, w, EPS, axis_name="model"), mesh=mesh,
                      in_specs=(P("data", "model"), P("model")), out_specs=P("data", "model"))
    tangents = (jnp.flip(x, 1), jnp.flip(w))

    def transforms(F, args, tangents, acc):
        out = _sharded_transforms(F, args, tangents, acc)
        out["hvp"] = jax.jvp(jax.grad(_loss(F, acc), (0, 1)), args, tangents)[1]
        return out

    got = transforms(F, (x, w), tangents, jnp.float32)
    with jax.enable_x64(True):
        as64 = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
        want = transforms(ref, (as64(x), as64(w)), tuple(map(as64, tangents)), jnp.float64)
    for key in got:
        compare(got[key], want[key], "float32", f"rms_norm_tp {key}")


def _check_ep(n_dev: int) -> None:
    """ep_dispatch, identity experts, ep_combine inside shard_map: out = x * sum_k w (no row dropped), under jit,
    jvp and grad (in x and the routing weights)."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((n_dev,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    tokens, top_k, experts = 3 * n_dev, 2, 2 * n_dev
    x = _rand(rng, (tokens, H), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]), jnp.int32)
    wts = _rand(rng, (tokens, top_k), jnp.float32, lo=0.0)

    def step(x, wts, ids):
        xp, _, _, handle = xj.ep_dispatch(x, ids, experts, "ep", capacity=3 * top_k, alignment=1)
        return xj.ep_combine(xp, wts, handle)

    sharded = jax.shard_map(step, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"))  # check_vma=True
    got = _sharded_transforms(lambda x, w: sharded(x, w, ids), (x, wts), (wts[:, :1] * x, wts), jnp.float32)
    with jax.enable_x64(True):
        as64 = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
        want = _sharded_transforms(lambda x, w: x * jnp.sum(w, 1, keepdims=True), (as64(x), as64(wts)),
                                   (as64(wts[:, :1] * x), as64(wts)), jnp.float64)
    for key in got:
        compare(got[key], want[key], "float32", f"ep {key}")


def _check_index_ops(n_dev: int) -> None:
    """The integer ops under sharded jit and vmap: the oracle's values (xkern.reference)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from xkern import reference as R

    mesh = jax.make_mesh((n_dev,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 4, (2 * n_dev, 2)), jnp.int32)
    got = jax.jit(lambda i: xj.topk_permute_indices(i, 4, alignment=2))(jax.device_put(ids, NamedSharding(
        mesh, P("d"))))
    want = R.topk_permute_indices(np.asarray(ids), 4, int(got[0].shape[0]), 2)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    idx = got[0]
    inv = jax.jit(lambda i: xj.inverse_permutation(i, ids.size))(jax.device_put(idx, NamedSharding(mesh, P("d"))))
    np.testing.assert_array_equal(np.asarray(inv), R.inverse_permutation(np.asarray(idx), ids.size))
    counts = jnp.asarray(rng.integers(0, 3, (2 * 2,)), jnp.int32)
    got = jax.vmap(lambda c: xj.generate_permute_indices(c, 2, 2, 16, 2))(jnp.stack([counts, counts[::-1]]))
    for k, c in enumerate((counts, counts[::-1])):
        for g, w in zip(got, R.generate_permute_indices(np.asarray(c), 2, 2, 16, 2)):
            np.testing.assert_array_equal(np.asarray(g[k]), w)


def _check_all(n_dev: int) -> dict:
    assert jax.device_count() == n_dev
    report = {}
    for cell in SHARDED_CELLS:
        op, mode = cell.split(": ")
        try:
            if op == "ep":
                _check_ep(n_dev)
            elif op == "rms_norm_tp":
                _check_tp(n_dev)
            elif op == "index ops":
                _check_index_ops(n_dev)
            else:
                _check_sharded(op, mode, n_dev)
            report[cell] = "ok"
        except Exception as e:  # noqa: BLE001 - the parent names the failing cell
            report[cell] = f"{type(e).__name__}: {str(e)[:400]}"
    return report


@functools.cache
def _report(n_dev: int) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n_dev}", JAX_PLATFORMS="cpu",
               TRITON_INTERPRET="1", PYTHONPATH=path)
    run = subprocess.run([sys.executable, __file__, "sharded", str(n_dev)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cell", SHARDED_CELLS)
@pytest.mark.host_devices
@pytest.mark.slow  # one child per device count: about a minute of interpreter each
@pytest.mark.parametrize("n_dev", [4, 8])
def test_sharded(n_dev, cell):
    assert _report(n_dev)[cell] == "ok"


# ---------------------------------------------------------------------------------------------------
# export: the transformed functions lower for CUDA through jax-triton (a child without the interpreter)

EXPORTED = ["jit", "grad", "jvp", "hessian", "vmap", "scan"]


def _export_all() -> dict:
    from jax_api._launch import gpu_lowering

    checks = [jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call")]
    report = {}
    with gpu_lowering():
        for op in OPS:
            f, _, args = make(op, jnp.bfloat16)
            specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
            fns = {"jit": f, "grad": jax.grad(_loss(f, jnp.float32), _all(args)),
                   "jvp": lambda *a, f=f: jax.jvp(f, a, a), "hessian": jax.hessian(_loss(f, jnp.float32)),
                   "vmap": jax.vmap(f, (0,) + (None,) * (len(args) - 1)),
                   "scan": lambda *a, f=f: _scan(f, a, jnp.float32)}
            for name, fn in fns.items():
                s = specs if name != "vmap" else [jax.ShapeDtypeStruct((2,) + specs[0].shape, specs[0].dtype)] + \
                    specs[1:]
                try:
                    exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*s)
                    text = exported.mlir_module()
                    report[f"{op}: {name}"] = "ok" if "triton_kernel_call" in text else "no kernel in the module"
                except Exception as e:  # noqa: BLE001
                    report[f"{op}: {name}"] = f"{type(e).__name__}: {str(e)[:400]}"
    return report


@functools.cache
def _export_report() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, __file__, "export"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.sm90_static
@pytest.mark.slow  # one child compiling every kernel of 66 exports for sm_90
@pytest.mark.parametrize("cell", [f"{op}: {name}" for op in OPS for name in EXPORTED])
def test_exports_for_cuda(cell):
    assert _export_report()[cell] == "ok"


if __name__ == "__main__":
    print(json.dumps(_check_all(int(sys.argv[2])) if sys.argv[1] == "sharded" else _export_all()))
