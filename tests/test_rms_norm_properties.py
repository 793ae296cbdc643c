"""Property-based RMSNorm tests (hypothesis): both front ends against the FP64 oracle over shapes, input and
weight layouts, dtype pairs, hostile values (NaN, Inf, subnormal, huge, rows whose FP32 sum of squares
overflows, zero rows) and eps.

Small by default (CPU CI: the interpreter runs every kernel). Larger on the GPU, or anywhere with
    XKERN_HYPOTHESIS_EXAMPLES=500 XKERN_HYPOTHESIS_MAX_WIDTH=70000 pytest tests/test_rms_norm_properties.py
The examples are split over XKERN_HYPOTHESIS_PARTS tests (4 on the GPU, where nearly every example compiles
new kernels: pytest-xdist runs the parts side by side), each seeded by its number, so every run draws the
same examples; set XKERN_HYPOTHESIS_SHRINK=1 to shrink a failure to a minimal example (slow under the
interpreter).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import GPU, TORCH_DTYPES, same_bits, to_numpy, to_torch

# scripts/setup.sh installs hypothesis on CPU machines; a GPU image without it skips this file (its wheel
# goes in .whl/, like jax-triton's) instead of failing the whole run's collection.
pytest.importorskip("hypothesis", reason="hypothesis is not installed (CPU: scripts/setup.sh; GPU: .whl/)")
from hypothesis import Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import jax_api  # noqa: E402
import torch_api  # noqa: E402
from xkern import reference as R  # noqa: E402

EXAMPLES = int(os.environ.get("XKERN_HYPOTHESIS_EXAMPLES", 200 if GPU else 30))
PARTS = int(os.environ.get("XKERN_HYPOTHESIS_PARTS", 4 if GPU else 1))
MAX_WIDTH = int(os.environ.get("XKERN_HYPOTHESIS_MAX_WIDTH", 70000 if GPU else 40))
PHASES = (Phase.explicit, Phase.reuse, Phase.generate) + ((Phase.shrink,) if os.environ.get(
    "XKERN_HYPOTHESIS_SHRINK") == "1" else ())
# Not derandomize (it seeds by the test's source: every part would draw the same examples): `seed(part)`.
SETTINGS = settings(max_examples=-(-EXAMPLES // PARTS), deadline=None, database=None, phases=PHASES,
                    print_blob=True)

DTYPES = ["bfloat16", "float16", "float32"]
X_LAYOUTS = ["contiguous", "row_slice", "col_stride", "lead_permuted"]
W_LAYOUTS = ["contiguous", "strided", "expanded", "offset"]
# What a row holds. "overflow": an element whose square passes FP32's range (the row's statistics are inf,
# as in eager); fp16 cannot overflow, so there it is "huge".
KINDS = ["normal", "scaled", "subnormal", "huge", "overflow", "special", "zero"]
POISON = float("nan")  # storage around a strided view: a read outside the view shows up as NaN


@st.composite
def cases(draw):
    x_dtype, w_dtype = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(DTYPES))
    lead = draw(st.lists(st.integers(0, 3), max_size=2))
    width = draw(st.integers(0, MAX_WIDTH))
    eps = draw(st.sampled_from([1e-6, 1e-5, 1e-2, 1.0, 0.0]))
    kinds = draw(st.lists(st.sampled_from(KINDS if eps else [k for k in KINDS if k != "subnormal"]),
                          min_size=1, max_size=3))
    w_kind = draw(st.sampled_from(["near_one", "wide", "special"]))
    x_layout = draw(st.sampled_from(X_LAYOUTS if len(lead) >= 2 else X_LAYOUTS[:3]))
    w_layout = draw(st.sampled_from(W_LAYOUTS))
    seed = draw(st.integers(0, 2**32 - 1))
    return x_dtype, w_dtype, (*lead, width), eps, kinds, w_kind, x_layout, w_layout, seed


def _row_values(rng, n: int, dtype: str, kind: str) -> np.ndarray:
    finfo = ml_dtypes.finfo(R.np_dtype(dtype))
    v = rng.standard_normal(n)
    if kind == "scaled":
        v *= 10.0 ** rng.uniform(-3, 3)
    elif kind == "subnormal":
        v = np.sign(v) * float(finfo.smallest_subnormal) * rng.integers(1, 2**finfo.nmant, n)
    elif kind == "huge" or (kind == "overflow" and dtype == "float16"):
        v = np.clip(v * 2e4, -6e4, 6e4) if dtype == "float16" else v * 1e18  # squares, sums: inside FP32's range
    elif kind == "overflow" and n:
        v[rng.integers(n)] = 3e19 * np.sign(v[0] or 1.0)  # 9e38 > FP32 max
    elif kind == "special" and n:
        at = rng.choice(n, size=min(n, 2), replace=False)
        v[at] = rng.choice([np.nan, np.inf, -np.inf], size=at.size)
    elif kind == "zero":
        v[:] = 0.0
    return v.astype(R.np_dtype(dtype))


def _inputs(x_dtype, w_dtype, shape, kinds, w_kind, w_layout, seed):
    rng = np.random.default_rng(seed)
    n = shape[-1]
    rows = [_row_values(rng, n, x_dtype, kinds[i % len(kinds)]) for i in range(int(np.prod(shape[:-1])))]
    x = np.stack(rows).reshape(shape) if rows else np.zeros(shape, R.np_dtype(x_dtype))
    if w_layout == "expanded":  # one stored value read n times
        w = np.full(n, 1.0 + 0.5 * rng.standard_normal())
    elif w_kind == "near_one":
        w = 1.0 + 0.5 * rng.standard_normal(n)
    elif w_kind == "wide":
        w = rng.standard_normal(n) * 10.0 ** rng.uniform(-2, 2, n)
    else:
        w = 1.0 + 0.5 * rng.standard_normal(n)
        if n:
            w[rng.integers(n)] = rng.choice([np.nan, np.inf, -np.inf])
    w = w.astype(R.np_dtype(w_dtype))
    dy = rng.standard_normal(shape).astype(R.promote(x.dtype, w.dtype))
    return x, w, dy


def _torch_x(x: np.ndarray, layout: str) -> torch.Tensor:
    """x in the given torch layout (values equal to x), poison in the storage around it."""
    n = x.shape[-1]
    if layout == "row_slice":  # rows padded: a row stride larger than the width
        big = np.full((*x.shape[:-1], n + 3), POISON, x.dtype)
        big[..., :n] = x
        return to_torch(big)[..., :n]
    if layout == "col_stride":  # every other element: the last dim not contiguous
        big = np.full((*x.shape[:-1], 2 * n), POISON, x.dtype)
        big[..., ::2] = x
        return to_torch(big)[..., ::2]
    if layout == "lead_permuted":  # leading dims that do not collapse into one row stride
        return to_torch(np.ascontiguousarray(x.swapaxes(0, 1))).transpose(0, 1)
    return to_torch(x)


def _torch_w(w: np.ndarray, layout: str) -> torch.Tensor:
    n = w.shape[0]
    if layout == "strided":
        big = np.full(2 * n, POISON, w.dtype)
        big[::2] = w
        return to_torch(big)[::2]
    if layout == "expanded":
        return to_torch(w[:1].copy()).expand(n) if n else to_torch(w)
    if layout == "offset":
        big = np.full(n + 5, POISON, w.dtype)
        big[3:3 + n] = w
        return to_torch(big)[3:3 + n]
    return to_torch(w)


def _assert_close(got, ref64, tol, kind: str) -> None:
    """NaN exactly where the oracle has NaN, infinities equal; finite values within the contract's ULPs (16-bit:
    the max only, the fractions need more elements than these) or its 32-bit error measures."""
    got = to_numpy(got)
    ref64 = np.asarray(ref64, np.float64)
    want = ref64.astype(got.dtype)
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{kind}: NaN at other places"
    inf = np.isinf(want) | np.isinf(got)
    assert np.array_equal(got[inf], want[inf]), f"{kind}: infinities differ"
    fin = ~(np.isnan(want) | inf)
    if not fin.any():
        return
    allowance = np.broadcast_to(np.maximum(tol, 1e-7 if kind == "dx" else 0.0), ref64.shape)[fin]
    stats = R.error_stats(got[fin], ref64[fin], abs_ok=np.nan_to_num(allowance))
    if got.dtype.itemsize == 2:
        assert stats["max_ulp"] <= (2 if kind == "fwd" else 8), f"{kind}: {stats}"
    else:
        assert stats["rel_l2"] <= 1e-6 and stats["max_err_rel_to_max_ref"] <= 1e-5, f"{kind}: {stats}"


def _finite_statistics(x, w, eps) -> bool:
    """Inputs whose backward the oracle models: finite, no FP32 overflow of the statistics, eps > 0; width 1
    only with eps >= 1e-2 (dx is then a cancellation FP32 resolves to ~6e-8 / eps: see README)."""
    x64 = x.astype(np.float64)
    return bool(eps > 0 and (x.shape[-1] != 1 or eps >= 1e-2) and np.all(np.isfinite(x64))
                and np.all(np.isfinite(w.astype(np.float64))) and np.all((x64 * x64).sum(-1) <= R.FP32_MAX))


def _part(part: int):
    @seed(part)
    @SETTINGS
    @given(cases())
    def test(case):
        _check_case(case)

    return test


for _part_number in range(PARTS):  # test_rms_norm_properties_0, _1, ...: one pytest item each
    globals()[f"test_rms_norm_properties_{_part_number}"] = _part(_part_number)


def _check_case(case):
    x_dtype, w_dtype, shape, eps, kinds, w_kind, x_layout, w_layout, seed = case
    x, w, dy = _inputs(x_dtype, w_dtype, shape, kinds, w_kind, w_layout, seed)
    out_dtype = R.promote(x.dtype, w.dtype)
    ref = R.rms_norm_fwd(x, w, eps)
    tol = R.rms_norm_fwd_tol(x, w, eps)
    backward = _finite_statistics(x, w, eps)

    tx = _torch_x(x, x_layout).requires_grad_()
    tw = _torch_w(w, w_layout).detach().requires_grad_()  # a leaf with the layout (expand: stride 0)
    assert same_bits(tx.detach().contiguous(), x) and same_bits(tw.detach().contiguous(), w)
    ty = torch_api.rms_norm(tx, tw, eps)
    assert ty.dtype == torch.promote_types(TORCH_DTYPES[x_dtype], TORCH_DTYPES[w_dtype]) and ty.shape == x.shape
    _assert_close(ty, ref, tol, "fwd")

    jx, jw = jnp.asarray(x), jnp.asarray(w)
    if backward:
        ty.backward(to_torch(dy))
        dx_ref, dw_ref, dw_tol = R.rms_norm_bwd(x, w, dy, eps)
        _assert_close(tx.grad, dx_ref, 0.0, "dx")
        _assert_close(tw.grad, dw_ref, dw_tol, "dw")
        jy, vjp = jax.vjp(lambda a, b: jax_api.rms_norm(a, b, eps), jx, jw)
        jdx, jdw = vjp(jnp.asarray(dy))
        assert same_bits(jdx, tx.grad) and same_bits(jdw, tw.grad), "torch and JAX gradients differ"
    else:
        jy = jax_api.rms_norm(jx, jw, eps)
    assert jy.dtype == out_dtype
    assert same_bits(jy, ty), "torch and JAX differ"
