"""Padded expert row gather for MoE, both front ends, against the numpy oracle (CPU: Triton's interpreter).

Every comparison is bitwise (`same_bits`): the ops only move rows, so -0.0, infinities and NaN payloads in
x must come out as they went in, and torch_api and jax_api must agree exactly.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import DEVICE, rand, same_bits, to_numpy, to_torch

import jax_api
import torch_api
from xkern import reference as R
from xkern.permute import (
    ONE_LAUNCH_SLOTS,
    generate_recipe,
    inverse_recipe,
    plan_gather_rows,
    plan_generate_indices,
    plan_inverse,
    plan_route_indices,
    plan_scatter_inverse,
    unpermute_recipe,
)
from xkern.testing import launch

NAN_BITS = {"bfloat16": (np.uint16, 0x7FA5), "float16": (np.uint16, 0x7E05), "float32": (np.uint32, 0x7FC00123)}
TORCH_INDEX = {"int32": torch.int32, "int64": torch.int64}


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _counts(rng, experts: int, ranks: int, empty: bool) -> np.ndarray:
    """Rank-major counts [ranks * experts]; with `empty`, a few experts get no token on any rank and a
    few (rank, expert) pairs are zero."""
    c = rng.integers(1, 9, (ranks, experts))
    if empty:
        c[rng.random((ranks, experts)) < 0.3] = 0
        c[:, rng.permutation(experts)[: max(1, experts // 3)]] = 0
    return c.reshape(-1)


def _padded_len(counts, experts: int, alignment: int) -> int:
    return int(R.generate_permute_indices(counts, experts, len(counts) // experts, 0, alignment)[2][-1])


def _max_len(counts, experts: int, alignment: int, slack: str) -> int:
    n = _padded_len(counts, experts, alignment)
    return {"fit": n, "extra": n + 13, "short": max(1, n - n // 3)}[slack]


def _specials(x: np.ndarray) -> np.ndarray:
    """-0.0, -inf and a NaN with a payload in the first rows: they must pass through bit for bit."""
    x = x.copy()
    flat = x.reshape(-1)
    flat[0] = -0.0
    if flat.size > 2:
        flat[2] = -np.inf
    uint, bits = NAN_BITS[str(x.dtype)]
    flat.view(uint)[min(1, flat.size - 1)] = bits
    return x


# (experts_per_rank, num_ranks, alignment, empty experts, max_len slack)
LAYOUTS = [
    (4, 1, 1, False, "extra"),
    (4, 2, 8, True, "fit"),
    (3, 3, 16, False, "extra"),
    (2, 4, 128, True, "fit"),
    (5, 2, 8, True, "short"),
    (1, 1, 16, False, "fit"),
    (6, 4, 1, True, "extra"),
    (8, 1, 8, True, "short"),
]


def _layout(key, experts, ranks, alignment, empty, slack):
    counts = _counts(_rng("counts", *key), experts, ranks, empty)
    return counts, _max_len(counts, experts, alignment, slack)


# ---------------------------------------------------------------------------------------------------
# generate_permute_indices


@pytest.mark.parametrize("counts_dtype", ["int32", "int64"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_generate_matches_oracle(layout, counts_dtype):
    experts, ranks, alignment, _, _ = layout
    counts, max_len = _layout(layout, *layout)
    counts = counts.astype(counts_dtype)
    ref = R.generate_permute_indices(counts, experts, ranks, max_len, alignment)
    got_t = torch_api.generate_permute_indices(to_torch(counts), experts, ranks, max_len, alignment)
    with jax.enable_x64(counts_dtype == "int64"):
        got_j = jax.jit(jax_api.generate_permute_indices, static_argnums=(1, 2, 3, 4))(
            jnp.asarray(counts), experts, ranks, max_len, alignment)
    for name, r, t, j in zip(("permuted_indices", "m_sizes", "m_offsets"), ref, got_t, got_j, strict=True):
        assert same_bits(t, r), name
        assert same_bits(j, r), name


@pytest.mark.parametrize("case", ["one_expert", "zero_tokens", "max_len_zero", "many_experts"])
def test_generate_edge_cases(case):
    rng = _rng("edge", case)
    experts, ranks, alignment = {"one_expert": (5, 3, 8), "zero_tokens": (3, 2, 8), "max_len_zero": (2, 2, 4),
                                 "many_experts": (37, 3, 1)}[case]
    counts = rng.integers(0, 5, ranks * experts)
    if case == "one_expert":
        counts = np.zeros((ranks, experts), np.int64)
        counts[:, 2] = rng.integers(1, 30, ranks)
        counts = counts.reshape(-1)
    if case == "zero_tokens":
        counts[:] = 0
    max_len = 0 if case == "max_len_zero" else _max_len(counts, experts, alignment, "extra")
    ref = R.generate_permute_indices(counts, experts, ranks, max_len, alignment)
    got_t = torch_api.generate_permute_indices(to_torch(counts.astype(np.int32)), experts, ranks, max_len,
                                               alignment)
    got_j = jax_api.generate_permute_indices(jnp.asarray(counts, jnp.int32), experts, ranks, max_len, alignment)
    assert all(same_bits(t, r) and same_bits(j, r) for r, t, j in zip(ref, got_t, got_j, strict=True))
    if case == "zero_tokens":  # every expert still gets one aligned block, all padding
        assert np.all(ref[1] == alignment) and np.all(ref[0] == -1)


# ---------------------------------------------------------------------------------------------------
# topk_permute_indices

# (tokens, top_k, experts, alignment, max_len: None (room for all), "short" (copies dropped) or an int)
ROUTES = [
    (5, 2, 4, 1, None),
    (300, 8, 128, 16, None),    # three chunks of ROUTE_CHUNK copies, the last partial
    (700, 2, 5, 8, "short"),
    (64, 3, 7, 4, 0),
    (0, 2, 3, 2, None),
    (1, 1, 1, 1, None),
    (130, 4, 1000, 2, None),    # more experts than copies: most blocks all padding
]


def _route_ids(key, tokens, top_k, experts):
    """Random expert ids with an expert that gets no copy, and (for several experts) a run of one expert."""
    ids = _rng("route", *key).integers(0, experts, (tokens, top_k))
    if experts > 2:
        ids[ids == 1] = 2
        ids[: tokens // 3, 0] = 0
    return ids


@pytest.mark.parametrize("ids_dtype", ["int32", "int64"])
@pytest.mark.parametrize("route", ROUTES)
def test_topk_indices_match_oracle(route, ids_dtype):
    """Both front ends (JAX under jit) give the oracle's layout bit for bit: argsort of the ids (stable), their
    counts and generate_permute_indices, each slot naming its copy."""
    tokens, top_k, experts, alignment, max_len = route
    ids = _route_ids(route, tokens, top_k, experts).astype(ids_dtype)
    if max_len == "short":
        max_len = tokens * top_k // 2
    ref = R.topk_permute_indices(ids, experts, tokens * top_k + experts * alignment if max_len is None else max_len,
                                 alignment)
    got_t = torch_api.topk_permute_indices(to_torch(ids), experts, max_len, alignment)
    with jax.enable_x64(ids_dtype == "int64"):
        got_j = jax.jit(jax_api.topk_permute_indices, static_argnums=(1, 2, 3))(jnp.asarray(ids), experts, max_len,
                                                                               alignment)
    for name, r, t, j in zip(("permuted_indices", "m_sizes", "m_offsets"), ref, got_t, got_j, strict=True):
        assert same_bits(t, r), name
        assert same_bits(j, r), name
    # the same layout as generate_permute_indices over the counts, the copies named through a stable sort
    counts = np.bincount(ids.reshape(-1), minlength=experts)
    rows, sizes, offsets = R.generate_permute_indices(counts, experts, 1, len(ref[0]), alignment)
    assert np.array_equal(sizes, ref[1]) and np.array_equal(offsets, ref[2]) and np.array_equal(rows < 0, ref[0] < 0)


def test_topk_indices_feed_the_top_k_gathers():
    """The layout is the one permute_rows(top_k) and the weighted combine take: dispatch then combine with
    identity experts gives sum_j p[t, j] * x[t] (exact for p = 1 / top_k powers of two)."""
    tokens, top_k, experts = 40, 4, 6
    ids = _route_ids(("feed",), tokens, top_k, experts)
    x = rand(_rng("feed-x"), (tokens, 33), "float32")
    probs = np.full((tokens, top_k), 1 / top_k, np.float32)
    idx, _, _ = torch_api.topk_permute_indices(to_torch(ids), experts, alignment=8)
    xp = torch_api.permute_rows(to_torch(x), idx, top_k=top_k)
    token = np.where(to_numpy(idx) >= 0, to_numpy(idx) // top_k, -1)  # the token row each slot reads
    assert same_bits(xp, R.permute_rows(x, token))
    out = torch_api.unpermute_rows(xp, idx, tokens * top_k, top_k=top_k, probs=to_torch(probs))
    assert same_bits(out, x)


def test_topk_indices_under_torch_compile():
    """torch.compile(fullgraph=True) traces the router's ids -> layout -> dispatch -> combine (the op's fake
    implementation gives the shapes); the compiled result equals eager's."""
    tokens, top_k, experts = 24, 2, 5
    ids = to_torch(_route_ids(("compile",), tokens, top_k, experts))
    x = to_torch(rand(_rng("compile-x"), (tokens, 16), "float32"))
    probs = to_torch(rand(_rng("compile-p"), (tokens, top_k), "float32"))

    def f(ids, x, probs):
        idx, _, _ = torch_api.topk_permute_indices(ids, experts, alignment=4)
        xp = torch_api.permute_rows(x, idx, top_k=top_k)
        return torch_api.unpermute_rows(xp.sin(), idx, tokens * top_k, top_k=top_k, probs=probs)

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(ids, x, probs)
    assert same_bits(got, f(ids, x, probs))


def test_topk_indices_every_slot_written():
    """The three kernels on poisoned outputs and scratch: every slot, size and offset comes out written (the fill
    runs its copies' programs beside the padding programs; a slot left to neither would keep the poison)."""
    tokens, top_k, experts, alignment = 300, 8, 9, 4
    ids = to_torch(_route_ids(("poison",), tokens, top_k, experts).astype(np.int32))
    n = tokens * top_k

    def poisoned(*shape):
        return torch.full(shape, -7, dtype=torch.int32, device=DEVICE)

    for max_len in (n + experts * alignment + 5, n // 2):  # slots past the last block; copies dropped
        count, tables, fill = plan_route_indices(n, experts, max_len)
        chunks = count.grid[0]
        counts, rank = poisoned(chunks, experts), poisoned(n)
        sizes, offsets, totals, base, idx = (poisoned(experts), poisoned(experts), poisoned(experts),
                                             poisoned(chunks, experts), poisoned(max_len))
        launch(count, ids, counts, rank, n_copies=n, n_experts=experts)
        launch(tables, counts, sizes, offsets, totals, base, n_chunks=chunks, n_experts=experts, alignment=alignment)
        launch(fill, ids, rank, base, sizes, offsets, totals, idx, n_copies=n, n_chunks=chunks, n_experts=experts,
               max_len=max_len)
        ref = R.topk_permute_indices(to_numpy(ids), experts, max_len, alignment)
        assert same_bits(idx, ref[0]) and same_bits(sizes, ref[1]) and same_bits(offsets, ref[2])
        assert (ref[0] == -1).any()


def test_validate_topk_indices():
    ids = np.array([[0, 2], [2, 1], [2, 2]], np.int32)  # expert 2: 4 copies -> its block ends at slot 4 + 4 + 4
    for fn, conv in ((torch_api.topk_permute_indices, to_torch), (jax_api.topk_permute_indices, jnp.asarray)):
        assert fn(conv(ids), 3, None, 4, validate=True)[0].shape == (6 + 3 * 4,)
        fn(conv(ids), 3, 12, 4, validate=True)
        with pytest.raises(ValueError, match="max_len=11 is too small: expert 2"):
            fn(conv(ids), 3, 11, 4, validate=True)
        with pytest.raises(ValueError, match=r"expert_ids \(flattened\) \[3\] = 5 is not an expert"):
            fn(conv(np.array([[0, 2], [2, 5]], np.int32)), 3, validate=True)
        # without validate: the out-of-range copy gets no slot, the others theirs
        got = fn(conv(np.array([[0, 2], [2, 5]], np.int32)), 3)[0]
        assert same_bits(got, R.topk_permute_indices(np.array([0, 2, 2, 5]), 3, 7, 1)[0])
        for err, message, bad, args in (
                (ValueError, "expert_ids must be 1-D or 2-D", ids[None], (3,)),
                (TypeError, "expert_ids must be int32 or int64", ids * 1.0, (3,)),
                (ValueError, "num_experts must be >= 1", ids, (0,)),
                (ValueError, "num_experts must be <= 16384", ids, (16385,)),
                (ValueError, "alignment must be >= 1", ids, (3, None, 0)),
                (ValueError, "max_len must be >= 0", ids, (3, -1)),
                (ValueError, "can pad to 3221225478 slots", ids, (3, None, 2**30))):
            with pytest.raises(err, match=message):
                fn(conv(bad), *args)
    for fn in (torch_api.topk_permute_indices, jax_api.topk_permute_indices):
        with pytest.raises(TypeError, match="expert_ids must be a"):
            fn([[0, 1]], 3)
    with pytest.raises(ValueError, match="needs a concrete"):
        jax.jit(lambda i: jax_api.topk_permute_indices(i, 3, validate=True))(jnp.asarray(ids))


def test_generate_results_share_one_aligned_allocation():
    """The eager call carves its 1-D int32 buffers from one allocation (host time): each result must sit at
    a 16-byte boundary (the launcher's fast path, the binary JAX runs), none may overlap another or a
    scratch table still being written, and a second call must not hand back the first call's memory."""
    experts, ranks, alignment = 3, 3, 8  # 3 and 9 int32: pieces that need padding to 16 bytes
    counts = _counts(_rng("pool"), experts, ranks, True)
    max_len = _max_len(counts, experts, alignment, "extra")
    ref = R.generate_permute_indices(counts, experts, ranks, max_len, alignment)
    first = torch_api.generate_permute_indices(to_torch(counts.astype(np.int32)), experts, ranks, max_len, alignment)
    second = torch_api.generate_permute_indices(to_torch(counts.astype(np.int32)), experts, ranks, max_len, alignment)
    for got in (first, second):
        assert all(same_bits(t, r) for t, r in zip(got, ref, strict=True))
        assert all(t.data_ptr() % 16 == 0 and t.is_contiguous() for t in got)
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in got)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        assert len({t.untyped_storage().data_ptr() for t in got}) == 1
    assert first[0].untyped_storage().data_ptr() != second[0].untyped_storage().data_ptr()


def test_executor_fast_allocations_match_torch_empty(monkeypatch):
    """The eager call allocates through the current device's caching allocator as Inductor's code does (no
    torch.empty argument parsing); its buffers must equal torch.empty's: the same results bit for bit, shapes,
    strides, dtypes and 16-byte alignment. On CPU the CPU twin of that allocator stands in, so the fast path
    runs here too."""
    import torch_api._launch as L
    from xkern.permute import generate_recipe, unpermute_recipe
    from xkern.rms_norm import rms_norm_bwd_recipe

    if DEVICE == "cpu":
        monkeypatch.setattr(L, "_ALLOC", torch._C._dynamo.guards._empty_strided_cpu)
        monkeypatch.setattr(L, "_CURRENT_DEVICE", lambda: None)
    fast_calls, alloc = [], L._ALLOC
    monkeypatch.setattr(L, "_ALLOC", lambda *a: fast_calls.append(a) or alloc(*a))
    rng = _rng("fast alloc")
    counts = _counts(rng, 3, 3, True)
    max_len = _max_len(counts, 3, 8, "extra")
    idx_np = R.generate_permute_indices(counts, 3, 3, max_len, 8)[0]
    n = int(counts.sum())
    y = to_torch(rand(rng, (max_len, 40), "bfloat16"))
    x, dy = (to_torch(rand(rng, (6, 256), "bfloat16")) for _ in range(2))
    w = to_torch(rand(rng, (256,), "bfloat16"))
    cases = [(generate_recipe(3, 3, max_len, 8), ("counts",), None, (to_torch(counts.astype(np.int32)),)),
             (unpermute_recipe(max_len, 40, n, "bfloat16", 40, "int32"), ("y", "idx"), None, (y, to_torch(idx_np))),
             (rms_norm_bwd_recipe(6, 256, 1e-6, "bfloat16", "bfloat16", 256, 256), ("x", "w", "dy"),
              {"dx": (2, 3, 256)}, (x, w, dy))]
    for recipe, names, shapes, inputs in cases:
        ex = L.Executor(recipe, names, shapes)
        fast_calls.clear()
        fast = ex(*inputs)
        assert fast_calls  # the fast path, not the torch.empty one
        with monkeypatch.context() as m:
            m.setattr(L, "_ALLOC", None)
            slow = ex(*inputs)
        for a, b in zip(fast, slow, strict=True):
            assert (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)
            assert a.data_ptr() % 16 == 0 and same_bits(a, b)


def test_oracle_follows_torchtitan_layout():
    """A hand-worked example: 2 ranks x 2 experts, alignment 4."""
    counts = np.array([2, 1,   # rank 0: rows 0-1 -> expert 0, row 2 -> expert 1
                       0, 3])  # rank 1: rows 3-5 -> expert 1
    idx, sizes, offsets = R.generate_permute_indices(counts, 2, 2, 12, 4)
    assert sizes.tolist() == [4, 4] and offsets.tolist() == [4, 8]
    assert idx.tolist() == [0, 1, -1, -1, 2, 3, 4, 5, -1, -1, -1, -1]


# ---------------------------------------------------------------------------------------------------
# permute_rows / unpermute_rows / inverse_permutation, forward and backward


def _case(layout, dtype, hidden, index):
    experts, ranks, alignment, _, _ = layout
    counts, max_len = _layout(layout, *layout)
    idx = R.generate_permute_indices(counts, experts, ranks, max_len, alignment)[0].astype(index)
    n = int(counts.sum())
    rng = _rng("rows", layout, dtype, hidden, index)
    x = _specials(rand(rng, (n, hidden), dtype)) if n else rand(rng, (0, hidden), dtype)
    y = rand(rng, (max_len, hidden), dtype)
    y[idx < 0] = np.nan  # padding rows of y must never be read
    dout_p = rand(rng, (max_len, hidden), dtype)
    dout_u = _specials(rand(rng, (n, hidden), dtype)) if n else rand(rng, (0, hidden), dtype)
    return idx, n, x, y, dout_p, dout_u


def _torch_run(idx, n, x, y, dout_p, dout_u):
    tidx = to_torch(idx)
    tx, ty = to_torch(x).requires_grad_(), to_torch(y).requires_grad_()
    p = torch_api.permute_rows(tx, tidx)
    p.backward(to_torch(dout_p))
    u = torch_api.unpermute_rows(ty, tidx, n)
    u.backward(to_torch(dout_u))
    return p, tx.grad, u, ty.grad, torch_api.inverse_permutation(tidx, n)


def _jax_run(idx, n, x, y, dout_p, dout_u):
    jidx = jnp.asarray(idx)
    p, vjp_p = jax.vjp(jax.jit(jax_api.permute_rows), jnp.asarray(x), jidx)
    u, vjp_u = jax.vjp(jax.jit(lambda y, i: jax_api.unpermute_rows(y, i, n)), jnp.asarray(y), jidx)
    inv = jax.jit(lambda i: jax_api.inverse_permutation(i, n))(jidx)
    return p, vjp_p(jnp.asarray(dout_p))[0], u, vjp_u(jnp.asarray(dout_u))[0], inv


OP_CASES = [  # (layout, dtype, hidden)
    (LAYOUTS[0], "float32", 16),
    (LAYOUTS[1], "bfloat16", 1),
    (LAYOUTS[2], "float16", 24),
    (LAYOUTS[3], "bfloat16", 64),
    (LAYOUTS[4], "float32", 1025),
    (LAYOUTS[5], "bfloat16", 1025),
    (LAYOUTS[6], "float32", 3),
    (LAYOUTS[7], "bfloat16", 40),
]


@pytest.mark.parametrize("index", ["int32", "int64"])
@pytest.mark.parametrize("layout,dtype,hidden", OP_CASES)
def test_ops_match_oracle_and_torch_equals_jax(layout, dtype, hidden, index):
    idx, n, x, y, dout_p, dout_u = args = _case(layout, dtype, hidden, index)
    ref = (R.permute_rows(x, idx), R.unpermute_rows(dout_p, idx, n),
           R.unpermute_rows(y, idx, n), R.permute_rows(dout_u, idx), R.inverse_permutation(idx, n))
    names = ("permute", "permute dx", "unpermute", "unpermute dy", "inverse")
    got_t = _torch_run(*args)
    with jax.enable_x64(index == "int64"):
        got_j = _jax_run(*args)
    for name, r, t, j in zip(names, ref, got_t, got_j, strict=True):
        assert same_bits(t, r), f"torch {name}"
        assert same_bits(j, t), f"jax {name}"


@pytest.mark.parametrize("seed", range(10))
def test_random_layouts(seed):
    """Random expert/rank counts, alignments and slack; ops on a small hidden size, both front ends."""
    rng = _rng("random", seed)
    experts, ranks = int(rng.integers(1, 10)), int(rng.integers(1, 5))
    alignment = int(rng.choice([1, 8, 16, 128]))
    layout = (experts, ranks, alignment, bool(rng.integers(2)), str(rng.choice(["fit", "extra", "short"])))
    counts, max_len = _layout(("random", seed), *layout)
    ref = R.generate_permute_indices(counts, experts, ranks, max_len, alignment)
    got_t = torch_api.generate_permute_indices(to_torch(counts), experts, ranks, max_len, alignment)
    with jax.enable_x64(True):
        got_j = jax_api.generate_permute_indices(jnp.asarray(counts), experts, ranks, max_len, alignment)
    assert all(same_bits(t, r) and same_bits(j, r) for r, t, j in zip(ref, got_t, got_j, strict=True))
    index, dtype = str(rng.choice(["int32", "int64"])), str(rng.choice(["bfloat16", "float16", "float32"]))
    idx, n = ref[0].astype(index), int(counts.sum())
    x = _specials(rand(rng, (n, 8), dtype)) if n else rand(rng, (0, 8), dtype)
    y, dout_p, dout_u = rand(rng, (max_len, 8), dtype), rand(rng, (max_len, 8), dtype), rand(rng, (n, 8), dtype)
    ref = (R.permute_rows(x, idx), R.unpermute_rows(dout_p, idx, n), R.unpermute_rows(y, idx, n),
           R.permute_rows(dout_u, idx), R.inverse_permutation(idx, n))
    got_t = _torch_run(idx, n, x, y, dout_p, dout_u)
    with jax.enable_x64(index == "int64"):
        got_j = _jax_run(idx, n, x, y, dout_p, dout_u)
    assert all(same_bits(t, r) and same_bits(j, r) for r, t, j in zip(ref, got_t, got_j, strict=True))


@pytest.mark.parametrize("max_len", [pytest.param(ONE_LAUNCH_SLOTS, marks=pytest.mark.slow),  # one program, 4096 slots
                                     ONE_LAUNCH_SLOTS + 1])
def test_both_regimes_of_the_index_ops(max_len):
    """generate_permute_indices, unpermute_rows and inverse_permutation take one launch up to ONE_LAUNCH_SLOTS
    slots and two above: both match the oracle (rows dropped past max_len included) in both front ends."""
    counts = _rng("regimes").integers(500, 800, 8).astype(np.int32)  # ~5200 rows: more than max_len holds
    idx, _, _ = R.generate_permute_indices(counts, 4, 2, max_len, 8)
    n = int(counts.sum())
    rng = _rng("regimes", max_len)
    x, y = rand(rng, (n, 2), "bfloat16"), rand(rng, (max_len, 2), "bfloat16")
    ref = (R.permute_rows(x, idx), R.unpermute_rows(y, idx, n), R.unpermute_rows(y, idx, n),
           R.permute_rows(x, idx), R.inverse_permutation(idx, n))
    assert (ref[4] < 0).any()
    launches = 1 if max_len <= ONE_LAUNCH_SLOTS else 2
    assert len(unpermute_recipe(max_len, 2, n, "bfloat16", 2, "int32").steps) == launches
    assert len(inverse_recipe(max_len, n, "int32").steps) == launches
    ref_g = R.generate_permute_indices(counts, 4, 2, max_len, 8)
    got_g = (torch_api.generate_permute_indices(to_torch(counts), 4, 2, max_len, 8),
             jax_api.generate_permute_indices(jnp.asarray(counts), 4, 2, max_len, 8))
    assert all(same_bits(g, r) for got in got_g for g, r in zip(got, ref_g, strict=True))
    assert len(generate_recipe(4, 2, max_len, 8).steps) == launches
    got_t = _torch_run(idx, n, x, y, y, x)
    got_j = _jax_run(idx, n, x, y, y, x)
    for name, r, t, j in zip(("permute", "permute dx", "unpermute", "unpermute dy", "inverse"), ref, got_t, got_j,
                             strict=True):
        assert same_bits(t, r), f"torch {name}"
        assert same_bits(j, r), f"jax {name}"


def test_indices_naming_no_row_are_ignored():
    """Without validate=True, an index that names no row (below -1, past num_rows, past int32 in int64) names
    nothing: its slot is never read, the row it would name is -1 / a zero row (the search kernels compare in
    int32 after mapping such indices to -1)."""
    idx = np.array([0, 2**40, 1, -5, 2, 7], np.int64)
    y = rand(_rng("naming-no-row"), (6, 8), "float32")
    want_inv = np.array([0, 2, 4, -1], np.int64)
    want_out = np.concatenate([y[[0, 2, 4]], np.zeros((1, 8), np.float32)])
    ti = to_torch(idx)
    assert torch.equal(torch_api.inverse_permutation(ti, 4).cpu(), torch.from_numpy(want_inv))
    assert same_bits(torch_api.unpermute_rows(to_torch(y), ti, 4), want_out)
    with jax.enable_x64(True):
        assert np.array_equal(np.asarray(jax_api.inverse_permutation(jnp.asarray(idx), 4)), want_inv)
        assert same_bits(jax_api.unpermute_rows(jnp.asarray(y), jnp.asarray(idx), 4), want_out)


def test_zero_tokens():
    counts = np.zeros(6, np.int32)
    idx, sizes, offsets = torch_api.generate_permute_indices(to_torch(counts), 3, 2, 30, 8)
    assert torch.all(idx == -1) and sizes.tolist() == [8, 8, 8]
    for hidden in (1, 7):
        x = torch.zeros((0, hidden), device=DEVICE, requires_grad=True)
        p = torch_api.permute_rows(x, idx)
        assert p.shape == (30, hidden) and torch.count_nonzero(p) == 0
        p.sum().backward()
        assert x.grad.shape == (0, hidden)
        y = torch.randn((30, hidden), device=DEVICE, requires_grad=True)
        u = torch_api.unpermute_rows(y, idx, 0)
        assert u.shape == (0, hidden)
        u.sum().backward()
        assert torch.count_nonzero(y.grad) == 0
        assert torch_api.inverse_permutation(idx, 0).shape == (0,)
        jidx = jnp.asarray(to_numpy(idx))
        jp = jax_api.permute_rows(jnp.zeros((0, hidden)), jidx)
        assert jp.shape == (30, hidden) and not np.any(np.asarray(jp))
        gy = jax.grad(lambda y, i: jax_api.unpermute_rows(y, i, 0).sum())(jnp.ones((30, hidden)), jidx)
        assert not np.any(np.asarray(gy))


# ---------------------------------------------------------------------------------------------------
# Higher-order gradients


def _second_order_inputs():
    layout = LAYOUTS[1]
    experts, ranks, alignment, _, _ = layout
    counts, max_len = _layout(layout, *layout)
    idx = R.generate_permute_indices(counts, experts, ranks, max_len, alignment)[0]
    n = int(counts.sum())
    rng = _rng("second-order")
    x, c, d = (rand(rng, (n, 8), "float32") for _ in range(3))
    w = rand(rng, (max_len, 8), "float32")
    return idx, n, x, w, c, d


def test_torch_double_backward():
    """gx = d/dx sum(unpermute(permute(x) * w) * c) = unpermute(permute(c) * w), recorded with the ops;
    then d/dw sum(gx * d) = permute(d) * permute(c) runs the backward of the backward."""
    idx, n, x, w, c, d = _second_order_inputs()
    tidx, tc, td = to_torch(idx), to_torch(c), to_torch(d)
    tx, tw = to_torch(x).requires_grad_(), to_torch(w).requires_grad_()
    loss = (torch_api.unpermute_rows(torch_api.permute_rows(tx, tidx) * tw, tidx, n) * tc).sum()
    (gx,) = torch.autograd.grad(loss, tx, create_graph=True)
    assert same_bits(gx, R.unpermute_rows(R.permute_rows(c, idx) * w, idx, n))
    (gw,) = torch.autograd.grad((gx * td).sum(), tw)
    assert same_bits(gw, R.permute_rows(d, idx) * R.permute_rows(c, idx))
    # and once more through a fresh graph: grad of grad of the same op pair
    ty = to_torch(w).requires_grad_()
    (gy,) = torch.autograd.grad((torch_api.permute_rows(torch_api.unpermute_rows(ty, tidx, n), tidx) ** 2).sum(),
                                ty, create_graph=True)
    (ggy,) = torch.autograd.grad(gy.sum(), ty)
    valid = (idx >= 0)[:, None].astype(np.float32)
    assert same_bits(ggy, np.broadcast_to(2 * valid, w.shape).astype(np.float32))


def test_jax_grad_of_composition():
    idx, n, x, w, c, d = _second_order_inputs()
    jidx, jc, jd = jnp.asarray(idx), jnp.asarray(c), jnp.asarray(d)

    def loss(x, w):
        return jnp.sum(jax_api.unpermute_rows(jax_api.permute_rows(x, jidx) * w, jidx, n) * jc)

    gx = jax.jit(jax.grad(loss))(jnp.asarray(x), jnp.asarray(w))
    assert same_bits(gx, R.unpermute_rows(R.permute_rows(c, idx) * w, idx, n))
    gw = jax.jit(jax.grad(lambda x, w: jnp.sum(jax.grad(loss)(x, w) * jd), argnums=1))(jnp.asarray(x), jnp.asarray(w))
    assert same_bits(gw, R.permute_rows(d, idx) * R.permute_rows(c, idx))
    # torch agrees bit for bit
    tx, tw = to_torch(x).requires_grad_(), to_torch(w).requires_grad_()
    tidx = to_torch(idx)
    tl = (torch_api.unpermute_rows(torch_api.permute_rows(tx, tidx) * tw, tidx, n) * to_torch(c)).sum()
    (tgx,) = torch.autograd.grad(tl, tx, create_graph=True)
    assert same_bits(tgx, gx)
    assert same_bits(torch.autograd.grad((tgx * to_torch(d)).sum(), tw)[0], gw)


# ---------------------------------------------------------------------------------------------------
# torchtitan's implementation: padded gather with an appended zero row, zero-fill + index_put


def _old_permute(x, idx):
    # idx == -1 picks the appended zero row (the last one)
    return torch.cat([x, x.new_zeros(1, x.shape[1])])[idx.long()]


def _old_unpermute(y, idx, num_rows):
    valid = idx >= 0
    out = y.new_zeros(num_rows, y.shape[1])
    return out.index_put((idx[valid].long(),), y[valid])


@pytest.mark.parametrize("layout", [LAYOUTS[1], LAYOUTS[4], LAYOUTS[6]])
def test_matches_previous_implementation(layout):
    experts, ranks, alignment, _, _ = layout
    counts, max_len = _layout(layout, *layout)
    idx = torch_api.generate_permute_indices(to_torch(counts.astype(np.int32)), experts, ranks, max_len,
                                             alignment)[0]
    n = int(counts.sum())
    rng = _rng("previous", layout)
    x, dp = to_torch(rand(rng, (n, 48), "bfloat16")), to_torch(rand(rng, (max_len, 48), "bfloat16"))
    y, du = to_torch(rand(rng, (max_len, 48), "bfloat16")), to_torch(rand(rng, (n, 48), "bfloat16"))
    results = []
    for permute, unpermute in ((torch_api.permute_rows, torch_api.unpermute_rows), (_old_permute, _old_unpermute)):
        xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
        p, u = permute(xr, idx), unpermute(yr, idx, n)
        p.backward(dp)
        u.backward(du)
        results.append((p, xr.grad, u, yr.grad))
    for name, new, old in zip(("permute", "permute dx", "unpermute", "unpermute dy"), *results, strict=True):
        assert same_bits(new, old), name


# ---------------------------------------------------------------------------------------------------
# Every output element written, views, compile


def test_every_output_element_is_written():
    """Launch the plans on poisoned outputs (NaN rows, garbage in the inverse's scratch)."""
    layout = LAYOUTS[4]
    experts, ranks, alignment, _, _ = layout
    counts, max_len = _layout(layout, *layout)
    idx_np, sizes_np, offsets_np = R.generate_permute_indices(counts, experts, ranks, max_len, alignment)
    n = int(counts.sum())
    # generate: every output poisoned, in one launch (up to ONE_LAUNCH_SLOTS slots) and in two
    tc = to_torch(counts.astype(np.int32))
    scalars = dict(n_experts=experts, n_ranks=ranks, alignment=alignment, max_len=max_len)
    (one,), (sizes, fill) = plan_generate_indices(experts, ranks, max_len), plan_generate_indices(
        experts, ranks, ONE_LAUNCH_SLOTS + 1)
    for launches in ((one,), (sizes, fill)):
        outs = [torch.full((k,), -7, dtype=torch.int32, device=DEVICE)
                for k in (experts, experts, len(counts), len(counts), max_len)]
        if launches == (one,):
            launch(one, tc, *outs, **scalars)
        else:
            launch(sizes, tc, *outs[:4], **scalars)
            launch(fill, tc, *outs, **scalars)  # planned for more slots: its extra programs store nothing
        assert same_bits(outs[4], idx_np) and same_bits(outs[0], sizes_np) and same_bits(outs[1], offsets_np)
    # gather: NaN-filled output, zero rows included
    idx = to_torch(idx_np)
    for dtype, hidden in (("bfloat16", 1025), ("float32", 5)):
        x = rand(_rng("poison", dtype), (n, hidden), dtype)
        out = torch.full((max_len, hidden), float("nan"), dtype=to_torch(x).dtype, device=DEVICE)
        launch(plan_gather_rows(max_len, hidden, out.element_size()), to_torch(x), idx, out, n_rows=max_len,
               n_cols=hidden, n_src_rows=n, src_row_stride=hidden)
        assert same_bits(out, R.permute_rows(x, idx_np))
    # inverse: the scatter's scratch holds garbage, some of it naming valid slots of other rows
    scatter, settle = plan_scatter_inverse(max_len), plan_inverse(ONE_LAUNCH_SLOTS + 1, n)[1]
    for fill_value in (-1, 0, 3, 2**30):
        raw = torch.full((n,), fill_value, dtype=torch.int32, device=DEVICE)
        inv = torch.full((n,), -5, dtype=torch.int32, device=DEVICE)
        launch(scatter, idx, raw, n_slots=max_len, n_rows=n)
        launch(settle, idx, raw, inv, n_slots=max_len, n_rows=n)
        assert same_bits(inv, R.inverse_permutation(idx_np, n))
        assert (inv < 0).any()  # the "short" layout drops rows: they must read -1, whatever raw held
    # the one-launch forms (`one_launch`): every output poisoned, dropped rows included
    (search,) = plan_inverse(max_len, n)
    inv = torch.full((n,), -5, dtype=torch.int32, device=DEVICE)
    launch(search, idx, inv, n_slots=max_len, n_rows=n)
    assert same_bits(inv, R.inverse_permutation(idx_np, n))
    for dtype, hidden in (("bfloat16", 1025), ("float32", 5)):
        y = rand(_rng("poison-unpermute", dtype), (max_len, hidden), dtype)
        out = torch.full((n, hidden), float("nan"), dtype=to_torch(y).dtype, device=DEVICE)
        launch(plan_gather_rows(n, hidden, out.element_size(), search=True), to_torch(y), idx, out, n_rows=n,
               n_cols=hidden, n_src_rows=max_len, src_row_stride=hidden)
        assert same_bits(out, R.unpermute_rows(y, idx_np, n))


def test_strided_views_read_in_place():
    layout = LAYOUTS[2]
    experts, ranks, alignment, _, _ = layout
    counts, max_len = _layout(layout, *layout)
    idx = to_torch(R.generate_permute_indices(counts, experts, ranks, max_len, alignment)[0])
    n = int(counts.sum())
    big = to_torch(rand(_rng("views"), (n, 70), "bfloat16"))
    view = big[:, 5:37]  # column slice: row stride 70
    assert view.stride() == (70, 1)
    assert same_bits(torch_api.permute_rows(view, idx), torch_api.permute_rows(view.contiguous(), idx))
    transposed = big[:, :32].t().contiguous().t()  # last dim not contiguous: copied
    assert transposed.stride(1) != 1
    assert same_bits(torch_api.permute_rows(transposed, idx), torch_api.permute_rows(big[:, :32].contiguous(), idx))
    ys = torch.full((max_len, 70), 1.5, dtype=torch.bfloat16, device=DEVICE)[:, 1:33]
    assert same_bits(torch_api.unpermute_rows(ys, idx, n), torch_api.unpermute_rows(ys.contiguous(), idx, n))


def test_torch_compile_fullgraph():
    layout = LAYOUTS[1]
    experts, ranks, alignment, _, _ = layout
    counts, max_len = _layout(layout, *layout)
    n = int(counts.sum())
    tc = to_torch(counts.astype(np.int32))

    def f(x, counts):
        idx, _, _ = torch_api.generate_permute_indices(counts, experts, ranks, max_len, alignment)
        return torch_api.unpermute_rows(torch_api.permute_rows(x, idx) * 2, idx, n)

    x = to_torch(rand(_rng("compile"), (n, 16), "float32"))
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(xc, tc)
    want = f(xe, tc)
    assert same_bits(got, want) and same_bits(want, x * 2)
    got.sum().backward()
    want.sum().backward()
    assert same_bits(xc.grad, xe.grad)


# ---------------------------------------------------------------------------------------------------
# validate=True and bad inputs


def _bad_indices():
    # 4 rows, 6 slots
    return {
        "duplicate": (np.array([0, 1, -1, 1, 2, 3]), "names row 1 twice: at slots 1 and 3"),
        "missing": (np.array([0, -1, -1, 1, 3, -1]), "never names row 2"),
        "out of range": (np.array([0, 1, 2, 3, 4, -1]), r"\[4\] = 4 is out of range"),
        "below -1": (np.array([0, 1, 2, -2, 3, -1]), r"\[3\] = -2 is out of range"),
    }


@pytest.mark.parametrize("kind", list(_bad_indices()))
def test_validate_catches_bad_permutations(kind):
    idx, message = _bad_indices()[kind]
    ti, ji = to_torch(idx.astype(np.int32)), jnp.asarray(idx, jnp.int32)
    x, y = torch.ones(4, 3, device=DEVICE), torch.ones(6, 3, device=DEVICE)
    calls = [
        lambda: torch_api.permute_rows(x, ti, validate=True),
        lambda: torch_api.unpermute_rows(y, ti, 4, validate=True),
        lambda: torch_api.inverse_permutation(ti, 4, validate=True),
        lambda: jax_api.permute_rows(jnp.ones((4, 3)), ji, validate=True),
        lambda: jax_api.unpermute_rows(jnp.ones((6, 3)), ji, 4, validate=True),
        lambda: jax_api.inverse_permutation(ji, 4, validate=True),
    ]
    for fn in calls:
        with pytest.raises(ValueError, match=message):
            fn()
    good = np.array([0, 1, -1, 3, 2, -1], np.int32)
    torch_api.permute_rows(x, to_torch(good), validate=True)
    jax_api.unpermute_rows(jnp.ones((6, 3)), jnp.asarray(good), 4, validate=True)


def test_validate_generate():
    counts = np.array([5, 3, 2, 4], np.int32)  # experts of 7 and 7 rows -> blocks of 8 and 8
    for fn, conv in ((torch_api.generate_permute_indices, to_torch), (jax_api.generate_permute_indices, jnp.asarray)):
        fn(conv(counts), 2, 2, 15, 8, validate=True)  # expert 1's last row is slot 14
        with pytest.raises(ValueError, match="max_len=14 is too small: expert 1"):
            fn(conv(counts), 2, 2, 14, 8, validate=True)
        assert same_bits(fn(conv(counts), 2, 2, 14, 8)[0],  # without validate the row is dropped
                         R.generate_permute_indices(counts, 2, 2, 14, 8)[0])
        with pytest.raises(ValueError, match=r"tokens_per_expert_group\[1\] = -3 is negative"):
            fn(conv(np.array([5, -3, 2, 4], np.int32)), 2, 2, 64, 8, validate=True)
    with pytest.raises(ValueError, match="needs a concrete"):
        jax.jit(lambda c: jax_api.generate_permute_indices(c, 2, 2, 16, 8, validate=True))(jnp.asarray(counts))


def _bad_calls(api, x, y, idx, counts):
    return [
        (ValueError, "x must be 2-D", lambda: api.permute_rows(x[0], idx)),
        (ValueError, "permuted_indices must be 1-D", lambda: api.permute_rows(x, idx[None])),
        (TypeError, "permuted_indices must be int32 or int64", lambda: api.permute_rows(x, idx * 1.0)),
        (TypeError, "x must be float16, bfloat16 or float32", lambda: api.permute_rows(idx[:, None], idx)),
        (TypeError, "permuted_indices must be a", lambda: api.permute_rows(x, [0, 1])),
        (ValueError, "y must have one row per slot", lambda: api.unpermute_rows(x, idx, 4)),
        (ValueError, "y must be 2-D", lambda: api.unpermute_rows(y[None], idx, 4)),
        (ValueError, "num_rows must be >= 0", lambda: api.unpermute_rows(y, idx, -1)),
        (TypeError, "num_rows must be an int", lambda: api.inverse_permutation(idx, 4.0)),
        (ValueError, "alignment must be >= 1", lambda: api.generate_permute_indices(counts, 2, 2, 16, -8)),
        (ValueError, "alignment must be >= 1", lambda: api.generate_permute_indices(counts, 2, 2, 16, 0)),
        (ValueError, "must have experts_per_rank \\* num_ranks = 6 entries, got 4",
         lambda: api.generate_permute_indices(counts, 3, 2, 16, 8)),
        (ValueError, "experts_per_rank must be >= 1", lambda: api.generate_permute_indices(counts, 0, 2, 16, 8)),
        (ValueError, "num_ranks must be >= 1", lambda: api.generate_permute_indices(counts[:0], 2, 0, 16, 8)),
        (ValueError, "max_len must be >= 0", lambda: api.generate_permute_indices(counts, 2, 2, -1, 8)),
        (TypeError, "tokens_per_expert_group must be int32 or int64",
         lambda: api.generate_permute_indices(counts * 1.0, 2, 2, 16, 8)),
        (ValueError, "tokens_per_expert_group must be 1-D",
         lambda: api.generate_permute_indices(counts.reshape(2, 2), 2, 2, 16, 8)),
    ]


def test_bad_inputs_raise_clear_errors():
    x, y = torch.ones(4, 3, device=DEVICE), torch.ones(6, 3, device=DEVICE)
    idx = torch.tensor([0, 1, -1, 3, 2, -1], dtype=torch.int32, device=DEVICE)
    counts = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device=DEVICE)
    calls = _bad_calls(torch_api, x, y, idx, counts)
    calls += _bad_calls(jax_api, *(jnp.asarray(to_numpy(t)) for t in (x, y, idx, counts)))
    for exc, message, fn in calls:
        with pytest.raises(exc, match=message):
            fn()
    # Eager calls check on the first call of a signature: a cached one must not let a bad argument through
    # (True == 1 and 4.0 == 4 hash alike).
    torch_api.inverse_permutation(idx, 1)
    torch_api.inverse_permutation(idx, 4)
    torch_api.generate_permute_indices(counts, 2, 2, 16, 1)
    for exc, message, fn in [
        (TypeError, "num_rows must be an int", lambda: torch_api.inverse_permutation(idx, True)),
        (TypeError, "num_rows must be an int", lambda: torch_api.inverse_permutation(idx, 4.0)),
        (TypeError, "alignment must be an int", lambda: torch_api.generate_permute_indices(counts, 2, 2, 16, True)),
        (TypeError, "max_len must be an int", lambda: torch_api.generate_permute_indices(counts, 2, 2, 16.0, 1)),
        (TypeError, "permuted_indices must be a", lambda: torch_api.inverse_permutation(idx.tolist(), 4)),
    ]:
        with pytest.raises(exc, match=message):
            fn()
    with pytest.raises(ValueError, match="permuted_indices must be on"):
        torch_api.permute_rows(x, idx.to("meta"))
    with pytest.raises(ValueError, match="y must be a CUDA tensor"):
        torch_api.unpermute_rows(y.to("meta"), idx.to("meta"), 4)
