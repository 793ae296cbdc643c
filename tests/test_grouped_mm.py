"""The grouped GEMM over MoE's padded expert-major layout: `grouped_mm(x, w, m_offsets)`, its x and w gradients,
against the FP64 oracle (CPU: Triton's interpreter). Layouts have empty experts, experts whose rows are not a
multiple of the row tile, and rows past the last offset (written zero). The kernels sum in FP32 and round once:
results are held to `reference.combine_tolerance` of the terms' magnitudes.

The core's kernels run with a small tile (the plans' `tile` parameter) so that experts span several row tiles
and bands; the torch front end with its plan's tiles.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch
from helpers import DEVICE, GPU, TORCH_DTYPES, rand, same_bits, to_numpy, to_torch

import torch_api
from xkern import reference as R
from xkern.grouped_mm import GemmTile, grouped_mm_dw_recipe, grouped_mm_dx_recipe, grouped_mm_recipe
from xkern.testing import launch

SMALL = GemmTile(16, 16, 16, 4, 2, group_m=2)  # 16-row tiles in bands of two: several tiles and bands per expert
DTYPES = ("float32", "bfloat16", "float16")


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _operands(key, n_slots: int, n_inner: int, n_cols: int, n_experts: int, dtype: str):
    rng = _rng(*key)
    return (rand(rng, (n_slots, n_inner), dtype), rand(rng, (n_experts, n_inner, n_cols), dtype),
            rand(rng, (n_slots, n_cols), dtype))


def _within(got, ref64, mag64, n_terms: int, dtype: str, what: str) -> None:
    R.check_sum(to_numpy(got), ref64, mag64, n_terms, dtype, what)


def _oracle(x, w, dy, offs):
    """(y, dx, dw) in float64 and the same on the operands' magnitudes."""
    ref = (R.grouped_mm(x, w, offs), *R.grouped_mm_bwd(x, w, dy, offs))
    a = [np.abs(np.asarray(t, np.float64)) for t in (x, w, dy)]
    return ref, (R.grouped_mm(a[0], a[1], offs), *R.grouped_mm_bwd(*a, offs))


def _poisoned(shape, dtype: str) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=TORCH_DTYPES[dtype], device=DEVICE)


def _run_core(recipe, *arrays) -> torch.Tensor:
    """A one-step recipe launched on `arrays` into a NaN-poisoned result."""
    (step,) = recipe.steps
    (buf,) = step.outputs
    if step.launch is None:  # nothing to multiply: the recipe allocates zeros
        return torch.zeros(buf.shape, dtype=TORCH_DTYPES[buf.dtype], device=DEVICE)
    out = _poisoned(buf.shape, buf.dtype)
    launch(step.launch, *arrays, out, **step.scalars)
    return out


def _core(x, w, dy, offs, dtype: str, tile=SMALL, w_t=None):
    """(y, dx, dw) from the core's recipes; `w_t` [E, N, K] (contiguous) read through its transpose as w."""
    s, k = x.shape
    e, _, n = w.shape
    tx, tw, tdy, toffs = (to_torch(a) for a in (x, w, dy, offs))
    strides = (k * n, n, 1)
    if w_t is not None:
        tw, strides = to_torch(w_t), (k * n, 1, k)
    y = _run_core(grouped_mm_recipe(s, k, n, e, dtype, k, strides, tile), tx, tw, toffs)
    dx = _run_core(grouped_mm_dx_recipe(s, k, n, e, dtype, n, strides, tile), tdy, tw, toffs)
    dw = _run_core(grouped_mm_dw_recipe(s, k, n, e, dtype, k, n, tile), tx, tdy, toffs)
    return y, dx, dw


# expert sizes 21, 0, 16, 35, 0 (two empty experts, one a whole tile, others not), 28 rows past the last offset
OFFSETS = np.array([21, 21, 37, 72, 72], np.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_core_kernels_match_oracle(dtype):
    s, k, n = 100, 40, 36
    x, w, dy = _operands(("core", dtype), s, k, n, len(OFFSETS), dtype)
    ref, mag = _oracle(x, w, dy, OFFSETS)
    y, dx, dw = _core(x, w, dy, OFFSETS, dtype)
    for got, want, m, terms, what in zip((y, dx, dw), ref, mag, (k, n, s), ("y", "dx", "dw"), strict=True):
        _within(got, want, m, terms, dtype, what)
    assert not torch.any(y[72:]) and not torch.any(dx[72:]), "rows past the last offset must be zeros"
    assert not torch.any(dw[1]) and not torch.any(dw[4]), "an expert without rows gets a zero gradient"
    # w read through a transpose (K contiguous): the same products, the same bits
    w_t = np.ascontiguousarray(np.swapaxes(w, 1, 2))
    again = _core(x, np.swapaxes(w_t, 1, 2), dy, OFFSETS, dtype, w_t=w_t)
    assert all(same_bits(a, b) for a, b in zip(again, (y, dx, dw), strict=True))


def test_core_kernels_bitwise_run_to_run_and_ragged_widths():
    """Widths that no alignment divides (ALIGN 1), every row in experts (no tail), one expert: the oracle, and
    the same bits on a second run."""
    for s, k, n, offs in ((50, 19, 23, np.array([3, 50], np.int32)), (33, 17, 5, np.array([33], np.int32))):
        x, w, dy = _operands(("ragged", s, k, n), s, k, n, len(offs), "bfloat16")
        ref, mag = _oracle(x, w, dy, offs)
        first = _core(x, w, dy, offs, "bfloat16")
        for got, want, m, terms, what in zip(first, ref, mag, (k, n, s), ("y", "dx", "dw"), strict=True):
            _within(got, want, m, terms, "bfloat16", what)
        assert all(same_bits(a, b) for a, b in zip(_core(x, w, dy, offs, "bfloat16"), first, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_grouped_mm_and_gradients_match_oracle(dtype):
    s, k, n = 150, 32, 48
    offs = np.array([0, 60, 61, 130], np.int32)  # an empty first expert, a one-row expert, 20 tail rows
    x, w, dy = _operands(("torch", dtype), s, k, n, len(offs), dtype)
    ref, mag = _oracle(x, w, dy, offs)
    tx, tw = (to_torch(a).requires_grad_() for a in (x, w))
    y = torch_api.grouped_mm(tx, tw, to_torch(offs))
    y.backward(to_torch(dy))
    for got, want, m, terms, what in zip((y, tx.grad, tw.grad), ref, mag, (k, n, s), ("y", "dx", "dw"), strict=True):
        _within(got, want, m, terms, dtype, what)
    assert not torch.any(y[130:]) and not torch.any(tx.grad[130:]) and not torch.any(tw.grad[0])


def test_torch_weight_views_strided_rows_and_torch_compile():
    """w as a transpose of a contiguous [E, N, K] (torchtitan's w13.transpose(-2, -1)) and x with a row stride
    are read in place; torch.compile(fullgraph=True) traces the ops, gradients included, to the same bits."""
    s, k, n, offs = 40, 16, 24, to_torch(np.array([10, 10, 33], np.int32))
    rng = _rng("views")
    x_wide = to_torch(rand(rng, (s, k + 8), "float32"))[:, :k]
    w_t = to_torch(rand(rng, (3, n, k), "float32"))
    dy = to_torch(rand(rng, (s, n), "float32"))
    want = R.grouped_mm(to_numpy(x_wide), np.swapaxes(to_numpy(w_t), 1, 2), to_numpy(offs))
    mag = R.grouped_mm(np.abs(to_numpy(x_wide)), np.abs(np.swapaxes(to_numpy(w_t), 1, 2)), to_numpy(offs))
    _within(torch_api.grouped_mm(x_wide, w_t.transpose(1, 2), offs), want, mag, k, "float32", "y of views")

    def f(x, w):
        return torch_api.grouped_mm(x, w.transpose(1, 2), offs)

    args_c = [t.clone().requires_grad_() for t in (x_wide, w_t)]
    args_e = [t.clone().requires_grad_() for t in (x_wide, w_t)]
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*args_c)
    ref = f(*args_e)
    assert same_bits(got, ref)
    got.backward(dy)
    ref.backward(dy)
    assert all(same_bits(a.grad, b.grad) for a, b in zip(args_c, args_e, strict=True))


def _torch_oracle(x, w, offs):
    """grouped_mm in float64 torch (per-expert matmuls): its autograd gives exact derivatives of any order."""
    ends = [int(v) for v in offs]
    blocks = [x[(ends[e - 1] if e else 0):end] @ w[e] for e, end in enumerate(ends)]
    return torch.cat([*blocks, x.new_zeros(x.shape[0] - ends[-1], w.shape[2])])


def test_double_backward_and_forward_mode_against_float64_autograd():
    s, k, n, offs_np = 30, 16, 20, np.array([7, 7, 25], np.int32)
    rng, offs = _rng("second"), to_torch(offs_np)
    x, w, dy, v = (to_torch(rand(rng, shape, "float32")) for shape in ((s, k), (3, k, n), (s, n), (s, k)))
    tx, tw = (t.clone().requires_grad_() for t in (x, w))

    def second(fn, a, b):
        gx, gw = torch.autograd.grad(fn(a, b, offs), (a, b), dy, create_graph=True)
        return torch.autograd.grad((gx * v).sum() + gw.square().sum(), (a, b))

    got = second(torch_api.grouped_mm, tx, tw)
    want = second(_torch_oracle, *(t.double().requires_grad_() for t in (x, w)))
    for g, r in zip(got, want, strict=True):
        assert torch.allclose(g.double(), r, rtol=1e-4, atol=1e-4 * float(r.abs().max()))
    _, tangent = torch.func.jvp(lambda a, b: torch_api.grouped_mm(a, b, offs), (x, w), (v, w.flip(0)))
    _, exact = torch.func.jvp(lambda a, b: _torch_oracle(a, b, offs), (x.double(), w.double()),
                              (v.double(), w.flip(0).double()))
    assert torch.allclose(tangent.double(), exact, rtol=1e-4, atol=1e-4 * float(exact.abs().max()))


def test_empty_layouts_and_zero_sizes():
    w = torch.ones(3, 8, 16, device=DEVICE, requires_grad=True)
    x = torch.ones(20, 8, device=DEVICE, requires_grad=True)
    y = torch_api.grouped_mm(x, w, torch.zeros(3, dtype=torch.int32, device=DEVICE))  # every expert empty
    assert y.shape == (20, 16) and not torch.any(y)
    y.sum().backward()
    assert not torch.any(x.grad) and not torch.any(w.grad)
    for s, k, n in ((0, 8, 16), (20, 0, 16), (20, 8, 0)):
        x = torch.ones(s, k, device=DEVICE, requires_grad=True)
        w = torch.ones(3, k, n, device=DEVICE, requires_grad=True)
        offs = torch.tensor([0, min(s, 5), s], dtype=torch.int32, device=DEVICE)
        y = torch_api.grouped_mm(x, w, offs)
        assert y.shape == (s, n) and not torch.any(y)
        y.sum().backward()
        assert x.grad.shape == (s, k) and w.grad.shape == (3, k, n) and not torch.any(w.grad)


def test_bad_arguments_raise_clear_errors():
    x, w = torch.ones(8, 4, device=DEVICE), torch.ones(2, 4, 6, device=DEVICE)
    offs = torch.tensor([3, 8], dtype=torch.int32, device=DEVICE)
    calls = [
        (ValueError, r"x must be 2-D \[slots, K\]", lambda: torch_api.grouped_mm(x[0], w, offs)),
        (ValueError, r"w must be 3-D \[experts, K, N\]", lambda: torch_api.grouped_mm(x, w[0], offs)),
        (TypeError, "w must have x's dtype float32, got bfloat16",
         lambda: torch_api.grouped_mm(x, w.bfloat16(), offs)),
        (TypeError, "x must be float16, bfloat16 or float32, got float64",
         lambda: torch_api.grouped_mm(x.double(), w.double(), offs)),
        (ValueError, r"K = x.shape\[1\] = 4", lambda: torch_api.grouped_mm(x, torch.ones(2, 5, 6), offs)),
        (TypeError, "m_offsets must be int32", lambda: torch_api.grouped_mm(x, w, offs.long())),
        (ValueError, r"m_offsets must be 1-D", lambda: torch_api.grouped_mm(x, w, offs[None])),
        (ValueError, r"one entry per expert \(w.shape\[0\] = 2\), got 3",
         lambda: torch_api.grouped_mm(x, w, torch.tensor([1, 2, 3], dtype=torch.int32))),
        (TypeError, "m_offsets must be a torch.Tensor", lambda: torch_api.grouped_mm(x, w, [3, 8])),
        (ValueError, "m_offsets must be non-decreasing",
         lambda: torch_api.grouped_mm(x, w, torch.tensor([5, 3], dtype=torch.int32, device=DEVICE),
                                            validate=True)),
        (ValueError, r"m_offsets\[-1\] = 9 is past x's 8 rows",
         lambda: torch_api.grouped_mm(x, w, torch.tensor([5, 9], dtype=torch.int32, device=DEVICE),
                                            validate=True)),
        (ValueError, r"m_offsets\[0\] = -1 is negative",
         lambda: torch_api.grouped_mm(x, w, torch.tensor([-1, 3], dtype=torch.int32, device=DEVICE),
                                            validate=True)),
        (ValueError, "w must be on", lambda: torch_api.grouped_mm(x, w.to("meta"), offs)),
    ]
    for exc, message, fn in calls:
        with pytest.raises(exc, match=message):
            fn()
    torch_api.grouped_mm(x, w, offs, validate=True)  # a valid layout passes


def test_unchecked_offsets_stay_in_bounds():
    """Offsets past S or decreasing (no validate): clamped, never out of bounds; every element still written."""
    x, w = torch.ones(8, 16, device=DEVICE), torch.ones(2, 16, 16, device=DEVICE)
    y = torch_api.grouped_mm(x, w, torch.tensor([6, 99], dtype=torch.int32, device=DEVICE))
    assert torch.equal(y, torch.full((8, 16), 16.0, device=DEVICE))
    y = torch_api.grouped_mm(x, w, torch.tensor([6, 2], dtype=torch.int32, device=DEVICE))
    assert torch.isfinite(y).all() and not torch.any(y[6:])


def test_opcheck_grouped_mm_ops():
    offs = torch.tensor([3, 3, 7], dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(*s, generator=g).to(DEVICE).requires_grad_() for s in ((9, 16), (9, 16)))
    w = torch.randn(3, 16, 16, generator=g).to(DEVICE).requires_grad_()
    torch.library.opcheck(torch.ops.xkern.grouped_mm.default, (x, w, offs))
    torch.library.opcheck(torch.ops.xkern.grouped_mm_dx.default, (dy, w, offs))
    torch.library.opcheck(torch.ops.xkern.grouped_mm_dw.default, (x, dy, offs))


EXAMPLES = int(os.environ.get("XKERN_HYPOTHESIS_EXAMPLES", 100 if GPU else 8))


def test_layouts_property():
    """Random layouts (hypothesis): expert counts, sizes (empty, partial tiles, several tiles), tails, widths."""
    hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
    st = hypothesis.strategies

    @hypothesis.seed(0)
    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None)
    @hypothesis.given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(0, 20),
                      st.integers(1, 40), st.integers(1, 40), st.integers(0, 2**32 - 1))
    def check(sizes, tail, k, n, key):
        offs = np.cumsum(sizes).astype(np.int32)
        s = int(offs[-1]) + tail
        x, w, dy = _operands(("property", key), s, k, n, len(sizes), "float32")
        ref, mag = _oracle(x, w, dy, offs)
        for got, want, m, terms, what in zip(_core(x, w, dy, offs, "float32"), ref, mag, (k, n, s), ("y", "dx", "dw"),
                                             strict=True):
            _within(got, want, m, terms, "float32", what)

    check()


def test_core_recipes_under_jax_execute_match_torch_bitwise():
    """The core's recipes as a JAX front end runs them (`jax_api._launch.execute`, arrays by the recipes' input
    names, contiguous w) give torch's forward and gradients bit for bit."""
    import jax.numpy as jnp

    from jax_api._launch import execute

    s, k, n = 60, 32, 48
    offs = np.array([10, 10, 50], np.int32)
    x, w, dy = _operands(("jax",), s, k, n, len(offs), "bfloat16")
    jx, jw, jdy, joffs = (jnp.asarray(a) for a in (x, w, dy, offs))
    strides = (k * n, n, 1)  # a contiguous [E, K, N]
    (y,) = execute(grouped_mm_recipe(s, k, n, len(offs), "bfloat16", k, strides), x=jx, w=jw, offs=joffs)
    (dx,) = execute(grouped_mm_dx_recipe(s, k, n, len(offs), "bfloat16", n, strides), dy=jdy, w=jw, offs=joffs)
    (dw,) = execute(grouped_mm_dw_recipe(s, k, n, len(offs), "bfloat16", k, n), x=jx, dy=jdy, offs=joffs)
    tx, tw = (to_torch(a).requires_grad_() for a in (x, w))
    ty = torch_api.grouped_mm(tx, tw, to_torch(offs))
    ty.backward(to_torch(dy))
    assert same_bits(y, ty) and same_bits(dx, tx.grad) and same_bits(dw, tw.grad)


@pytest.fixture
def dw_split(monkeypatch):
    """The "dw_split" variant with 32-row chunks (DW_SPLIT_ROWS), its recipes made afresh; the default after."""
    from xkern.grouped_mm import plans, recipes

    monkeypatch.setattr(plans, "DW_SPLIT_ROWS", 32)
    recipes._dw_recipe.cache_clear()
    plans.set_variant("dw_split")
    yield
    plans.set_variant("default")
    recipes._dw_recipe.cache_clear()


@pytest.mark.parametrize("dtype", (pytest.param("float32", marks=pytest.mark.slow), "bfloat16"))
def test_split_dw_matches_oracle_and_jax_bitwise(dw_split, dtype):
    """The split dw: experts of 70 and 100 rows in 32-row chunks (a partial last chunk each), one of 10 rows and
    an empty one summed whole, a tail past the last offset. Against the FP64 oracle; torch's autograd and JAX's
    execute of the same recipe give the same bits; an expert that is not split has the default kernel's bits (a
split one's may differ: its FP32 sums run in another order)."""
    import jax.numpy as jnp

    from jax_api._launch import execute
    from torch_api._launch import run_recipe
    from xkern.grouped_mm import plans, set_variant

    s, k, n = 200, 20, 24
    offs = np.array([70, 70, 80, 180], np.int32)
    x, w, dy = _operands(("split", dtype), s, k, n, len(offs), dtype)
    (step1, step2) = grouped_mm_dw_recipe(s, k, n, len(offs), dtype, k, n, SMALL).steps
    assert step1.outputs[0].shape == (2 * s // 32, k, n) and step2.launch.kernel is plans._grouped_dw_split_kernel
    recipe = grouped_mm_dw_recipe(s, k, n, len(offs), dtype, k, n, SMALL)
    (dw,) = run_recipe(recipe, DEVICE, x=to_torch(x), dy=to_torch(dy), offs=to_torch(offs))
    ref, mag = R.grouped_mm_bwd(x, w, dy, offs)[1], R.grouped_mm_bwd(*map(np.abs, (x, w, dy)), offs)[1]
    _within(dw, ref, mag, s, dtype, "dw")
    assert not torch.any(dw[1]), "an expert without rows gets a zero gradient"
    (jdw,) = execute(recipe, x=jnp.asarray(x), dy=jnp.asarray(dy), offs=jnp.asarray(offs))
    set_variant("default")
    plain = _run_core(grouped_mm_dw_recipe(s, k, n, len(offs), dtype, k, n, SMALL), *map(to_torch, (x, dy, offs)))
    assert same_bits(jdw, dw) and same_bits(plain[2], dw[2])


def test_persistent_rows_kernel_is_the_default_bitwise():
    """The persistent rows kernel (variant "persistent"): three programs taking every tile of the forward and of
    dx in turn give the default kernel's bits (both front ends under the variant: the benchmark's test)."""
    from xkern import device
    from xkern.grouped_mm import set_variant

    s, k, n, offs = 40, 20, 16, np.array([10, 10, 30], np.int32)  # 6 row tiles (3 of the tail), 1 or 2 columns
    x, w, dy = _operands(("persistent",), s, k, n, len(offs), "bfloat16")
    tx, tw, tdy, toffs = (to_torch(a) for a in (x, w, dy, offs))
    strides = (k * n, n, 1)

    def recipes():
        return (grouped_mm_recipe(s, k, n, len(offs), "bfloat16", k, strides, SMALL),
                grouped_mm_dx_recipe(s, k, n, len(offs), "bfloat16", n, strides, SMALL))

    y, dx = (_run_core(r, a, tw, toffs) for r, a in zip(recipes(), (tx, tdy), strict=True))
    set_variant("persistent")
    try:
        with device.target(device.DeviceProperties(90, 3, 227 * 1024)):
            persistent = recipes()
    finally:
        set_variant("default")
    assert all(r.steps[0].launch.grid == (3,) for r in persistent)
    assert same_bits(_run_core(persistent[0], tx, tw, toffs), y)
    assert same_bits(_run_core(persistent[1], tdy, tw, toffs), dx)


@pytest.mark.skipif(GPU, reason="GPU: the benchmark itself runs there (`python -m benchmarks.grouped_mm --quick`)")
def test_gemm_table_benchmark_runs_every_row(tmp_path, monkeypatch):
    """`benchmarks.grouped_mm --smoke` (one routing and projection, every variant): each implementation's forward,
    dx and dw ran; xkern (torch) within tolerance of the CUTLASS stand-in, xkern (jax) torch's bits, the variants'
    too, for the passes they change (the split dw in 64-row chunks: its two launches run)."""
    import json

    from benchmarks import grouped_mm as bench
    from benchmarks import timing
    from xkern.grouped_mm import VARIANTS, plans

    monkeypatch.setattr(plans, "DW_SPLIT_ROWS", 32)
    variants = ("default", "dw_split", "persistent")  # "dw_narrow": the dw kernel on another tile
    try:
        assert bench.main(["--smoke", "--out", str(tmp_path), "--routings", "skewed", "--projections", "down",
                           "--variants", ",".join(variants)]) == 0
    finally:
        timing.set_smoke(False)
        plans.set_variant("default")
    results = json.loads((tmp_path / "cpu-grouped-mm.json").read_text())
    assert results["complete"] and results["variants"] == list(variants)
    rows = {(r["projection"], r["pass"], r["impl"]): r for r in results["rows"]}
    impls = [bench.XK_TORCH, bench.CUTLASS, bench.XK_JAX, bench.RAGGED]
    for name in variants[1:]:
        impls += [f"{bench.XK_TORCH} [{name}]", f"{bench.XK_JAX} [{name}]"]
    for projection in ("down",):
        for pass_ in bench.PASSES:
            for impl in impls:
                variant = impl.partition("[")[2].rstrip("]")
                if variant and pass_ not in VARIANTS[variant]:
                    assert (projection, pass_, impl) not in rows
                    continue
                r = rows[(projection, pass_, impl)]
                assert r["status"] == "ok" and r["us"] > 0, r
                if impl.startswith("xkern"):
                    assert r["vs_best_peer"] > 0
                if impl == bench.XK_TORCH:
                    assert r["check"] == "pass" and r["rel_l2_vs_cutlass"] <= bench.REL_TOL
                if impl.startswith(bench.XK_JAX):
                    assert r["bitwise_equal_torch"], r
                if variant and impl.startswith(bench.XK_TORCH):
                    assert r["rel_l2_vs_xkern_default"] <= bench.REL_TOL
    assert "| xkern / best peer |" in (tmp_path / "cpu-grouped-mm.md").read_text()


def test_variant_names_are_checked():
    from xkern.grouped_mm import set_variant, variant

    with pytest.raises(ValueError, match="variant must be one of default, dw_split, .*persistent, got 'tma'"):
        set_variant("tma")
    assert variant() == "default"


def test_gemm_table_sums_the_six_gemms_of_each_implementation():
    """The table's step sums: a variant's rows stand in for the default's only where it has them."""
    from benchmarks import grouped_mm as bench

    def row(impl, projection, pass_, us):
        return {"size": "s", "routing": "balanced", "impl": impl, "projection": projection, "pass": pass_, "us": us}

    rows = [row(impl, p, q, us) for impl, us in ((bench.XK_TORCH, 1.0), (bench.CUTLASS, 2.0))
            for p in bench.PROJECTIONS for q in bench.PASSES]
    rows += [row(f"{bench.XK_TORCH} [dw_split]", p, "dw", 0.5) for p in bench.PROJECTIONS]
    rows.append(row(bench.RAGGED, "down", "fwd", 9.0))  # not all six: no sum
    sums = {r["impl"]: (r["us"], r["vs_cutlass"]) for r in bench.step_sums(rows)}
    assert sums == {bench.XK_TORCH: (6.0, 0.5), bench.CUTLASS: (12.0, 1.0),
                    f"{bench.XK_TORCH} [dw_split]": (5.0, 5.0 / 12)}


def test_persistent_dw_kernel_is_the_default_bitwise():
    """The persistent dw kernel (variant "dw_persistent"): three programs taking every (expert, K tile, N tile) in
    turn, an empty expert among them, give the default kernel's bits."""
    from xkern import device
    from xkern.grouped_mm import set_variant

    s, k, n, offs = 40, 20, 16, np.array([10, 10, 30], np.int32)
    x, _, dy = _operands(("dw persistent",), s, k, n, len(offs), "bfloat16")
    args = tuple(to_torch(a) for a in (x, dy, offs))
    plain = _run_core(grouped_mm_dw_recipe(s, k, n, len(offs), "bfloat16", k, n, SMALL), *args)
    set_variant("dw_persistent")
    try:
        with device.target(device.DeviceProperties(90, 3, 227 * 1024)):
            recipe = grouped_mm_dw_recipe(s, k, n, len(offs), "bfloat16", k, n, SMALL)
    finally:
        set_variant("default")
    assert recipe.steps[0].launch.grid == (3,)
    assert same_bits(_run_core(recipe, *args), plain) and not torch.any(plain[1])
