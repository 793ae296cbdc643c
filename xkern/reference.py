"""FP64 reference oracles (numpy only) and ULP metrics, shared by both front ends' tests and benchmarks.

The oracles compute in float64 and round exactly where eager PyTorch rounds (Hugging Face's Llama RMSNorm,
and the Gemma, OLMo-2 and weightless variants),
so a kernel is judged against the truth of the contract, not against a peer. 16-bit dtypes come from
`ml_dtypes` (bfloat16) and numpy (float16).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"bfloat16": BF16, "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}


def np_dtype(name_or_dtype) -> np.dtype:
    """numpy dtype from a name ('bfloat16', 'torch.bfloat16') or anything numpy understands."""
    name = str(name_or_dtype).replace("torch.", "")
    return DTYPES[name] if name in DTYPES else np.dtype(name_or_dtype)


def _round(a: np.ndarray, dtype) -> np.ndarray:
    """Round float64 values to `dtype` (round to nearest even) and return them as float64 again."""
    return np.asarray(a, np.float64).astype(np_dtype(dtype)).astype(np.float64)


def promote(x_dtype, w_dtype) -> np.dtype:
    """Output dtype of `w * normed` under PyTorch promotion (w is x's dtype or float32)."""
    x_dtype, w_dtype = np_dtype(x_dtype), np_dtype(w_dtype)
    return x_dtype if x_dtype == w_dtype else np.dtype(np.float32)


def out_dtype(x_dtype, w_dtype, variant: str = "llama") -> np.dtype:
    """Output dtype of a variant: promote(x, w) for "llama" with a weight, x's dtype otherwise."""
    return promote(x_dtype, w_dtype) if variant == "llama" and w_dtype is not None else np_dtype(x_dtype)


FP32_MAX = float(np.finfo(np.float32).max)


def _rstd(x64: np.ndarray, eps: float) -> np.ndarray:
    """1 / sqrt(mean(x**2) + eps) per row, with FP32 statistics' range: in the contract (and in eager) a row
    whose sum of squares passes FP32's range has mean inf, so rstd 0."""
    if x64.shape[-1] == 0:
        return np.ones(x64.shape[:-1] + (1,))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        mean_sq = np.mean(x64 * x64, axis=-1, keepdims=True)
        mean_sq = np.where(mean_sq * x64.shape[-1] > FP32_MAX, np.inf, mean_sq)
        return 1.0 / np.sqrt(mean_sq + eps)


def rms_norm_fwd(x, w, eps: float, variant: str = "llama", x_dtype=None) -> np.ndarray:
    """float64 y with the variant's roundings before the last applied; the caller compares in the output
    dtype. `x_dtype` (default x's): the dtype `normed` is rounded to (add_rms_norm: x's, not the sum's).
    With normed = x * rstd (fp32 in eager, exact here):
    llama `w * normed.to(x.dtype)`; gemma `normed * (1 + w)` (1 + w rounded to fp32, as `1.0 + w.float()`);
    olmo2 `w * normed`; w None (any variant): `normed`."""
    x64 = np.asarray(x, np.float64)
    with np.errstate(invalid="ignore"):  # NaN and Inf inputs propagate as in IEEE arithmetic
        n = x64 * _rstd(x64, eps)
    if w is None:
        return n
    w64 = np.asarray(w, np.float64)
    if variant == "llama":
        return w64 * _round(n, x.dtype if x_dtype is None else x_dtype)
    if variant == "gemma":
        return n * _round(1.0 + w64, np.float32)
    if variant == "olmo2":
        return w64 * n
    raise ValueError(f"variant must be 'llama', 'gemma' or 'olmo2', got {variant!r}")


def rms_norm_fwd_tol(x, w, eps: float, variant: str = "llama") -> np.ndarray:
    """Allowance for a float32 output (llama, float32 weight, 16-bit x): `normed` computed in fp32 may round
    to the neighbouring x.dtype value of the fp64 one, moving y by 2**-p of |y|. Zero when y is x's dtype."""
    if out_dtype(x.dtype, None if w is None else w.dtype, variant) == np.dtype(x.dtype):
        return np.zeros(())
    return np.abs(rms_norm_fwd(x, w, eps)) * 2.0 ** -ml_dtypes.finfo(np_dtype(x.dtype)).nmant


def rms_norm_bwd(x, w, dy, eps: float, variant: str = "llama",
                 x_dtype=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 (dx, dw, dw_tol) with eager autograd's rounding points (dw and dw_tol None without a weight;
    `x_dtype` as in rms_norm_fwd, the dtype `normed` was rounded to):
    g = dL/d(normed): llama `dy * w` in the output dtype, then to x.dtype; gemma `dy * (1 + w)`; olmo2
    `dy * w`; no weight `dy`. dx = rstd * (g - n * mean(g * n)).
    dw = sum over rows of terms: llama `dy * normed.to(x.dtype)` rounded to the output dtype; olmo2
    `dy * normed` rounded to w's dtype (the backward of the promoted `w * normed`); gemma `dy * normed` (fp32).

    dw_tol is the cancellation allowance for dw: a term's operand computed in fp32 (normed, or the term
    before its rounding) may round one ULP away from the fp64 one, moving the term by 2**-p of its size;
    where the row sum cancels, that is many ULPs of the result. An element of dw within
    sum_rows |term| * 2**-(p+1) of the truth is accepted (p: mantissa bits of the term's rounding dtype)."""
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    x_dtype = np_dtype(x.dtype if x_dtype is None else x_dtype)
    rstd = _rstd(x64, eps)
    n = x64 * rstd
    w64 = None if w is None else np.asarray(w, np.float64)
    if w is None:
        g = dy64
    elif variant == "llama":
        g = _round(_round(dy64 * w64, promote(x_dtype, w.dtype)), x_dtype)
    elif variant == "gemma":
        g = dy64 * _round(1.0 + w64, np.float32)
    else:
        g = dy64 * w64
    dx = rstd * (g - n * np.mean(g * n, axis=-1, keepdims=True))
    if w is None:
        return dx, None, None
    if variant == "llama":
        term_dtype = promote(x_dtype, w.dtype)
        terms = _round(dy64 * _round(n, x_dtype), term_dtype)
        p = ml_dtypes.finfo(x_dtype).nmant
    else:
        term_dtype = np_dtype(w.dtype) if variant == "olmo2" else np.dtype(np.float32)
        terms = _round(dy64 * n, term_dtype)
        p = ml_dtypes.finfo(term_dtype).nmant
    terms = terms.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    return dx, terms.sum(axis=0), np.abs(terms).sum(axis=0) * 2.0 ** -(p + 1)


def add_rms_norm_fwd(x, r, w, eps: float, variant: str = "llama", residual_dtype=None):
    """Fused residual add + RMSNorm: (float64 y as rms_norm_fwd of the sum with `normed` rounded to x's dtype,
    residual_out exact: (x + r) rounded once to residual_dtype, default promote(x, r), as an array of it)."""
    res_dtype = promote(x.dtype, r.dtype) if residual_dtype is None else np_dtype(residual_dtype)
    s = (np.asarray(x, np.float64) + np.asarray(r, np.float64)).astype(res_dtype)
    return rms_norm_fwd(s, w, eps, variant, x_dtype=x.dtype), s


def add_rms_norm_bwd(s, w, dy, dres, eps: float, variant: str = "llama", x_dtype=None):
    """Backward of add_rms_norm from its saved residual_out `s`: (float64 d(sum), dw, dw_tol). d(sum) is the
    norm's dx rounded to s's dtype, plus `dres` (residual_out's gradient; None: none); the caller rounds it
    to s's dtype (then to x's and the residual's dtypes, as eager's add backward converts)."""
    dx, dw, dw_tol = rms_norm_bwd(s, w, dy, eps, variant, x_dtype=x_dtype)
    if dres is not None:
        dx = _round(dx, s.dtype) + np.asarray(dres, np.float64)
    return dx, dw, dw_tol


def add_rms_norm_dsum_tol(s, w, dy, eps: float, variant: str = "llama", x_dtype=None) -> np.ndarray:
    """Allowance for d(sum) with residual_out's gradient: the norm's dx, computed in fp32, is rounded to s's
    dtype before dres is added. Where its fp64 value lies within 2**-20 of itself of a rounding boundary, fp32
    may round it to the neighbouring value (the summation order decides), moving d(sum) by one ULP of the
    norm's dx: many ULPs of d(sum) where dres cancels it (16 at a 0.08 sum of 1.39 and -1.48). Those
    elements are allowed that ULP, every other element none."""
    dx = rms_norm_bwd(s, w, dy, eps, variant, x_dtype=x_dtype)[0]
    rounded = _round(dx, s.dtype)
    with np.errstate(divide="ignore"):  # log2(0): exact zeros are no boundary's neighbours
        ulp = np.exp2(np.floor(np.log2(np.abs(rounded))) - ml_dtypes.finfo(np_dtype(s.dtype)).nmant)
    near = np.abs(np.abs(dx - rounded) - ulp / 2) <= np.abs(dx) * 2.0 ** -20
    return np.where(near & (rounded != 0), ulp, 0.0)


def _act64(z64: np.ndarray, activation: str) -> tuple[np.ndarray, np.ndarray]:
    """(act(z), sigmoid(z)) in float64, act silu or sigmoid."""
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-z64))
    return (s if activation == "sigmoid" else z64 * s), s


def _grouped(a: np.ndarray, group_size: int) -> np.ndarray:
    return a.reshape(*a.shape[:-1], a.shape[-1] // group_size if group_size else 0, group_size)


def gated_rms_norm_fwd(x, z, w, eps: float, group_size: int | None = None, norm_before_gate: bool = True,
                       activation: str = "silu", rounding: str = "llama") -> np.ndarray:
    """Gated RMSNorm (xkern/gated_rms_norm/kernels.py): float64 y with eager's roundings before the last; the
    caller compares in y's dtype. a = act(z) (silu or sigmoid); h = x * a with the gate first, else x;
    normed = h * rstd over each group of `group_size` (default: the row); p = w * normed.to(x.dtype) rounded
    to promote(w, x) ("llama") or w * normed ("fp32"); y = p * a with the gate after, else p."""
    x64, z64, w64 = (np.asarray(t, np.float64) for t in (x, z, w))
    group_size = x64.shape[-1] if group_size is None else group_size
    a, _ = _act64(z64, activation)
    h = x64 if norm_before_gate else x64 * a
    with np.errstate(invalid="ignore"):
        hg = _grouped(h, group_size)
        n = (hg * _rstd(hg, eps)).reshape(h.shape)
    if rounding == "llama":
        p = _round(w64 * _round(n, x.dtype), promote(x.dtype, w.dtype))
    else:
        p = w64 * n
    return p * a if norm_before_gate else p


def gated_rms_norm_fwd_tol(x, z, w, eps: float, group_size: int | None = None, norm_before_gate: bool = True,
                           activation: str = "silu", rounding: str = "llama") -> np.ndarray:
    """Allowance for an fp32 y from 16-bit x (the gate first, Llama's rounding, an fp32 weight): `normed`
    computed in fp32 may round to the neighbouring x.dtype value, moving y by 2**-p of |y|. Else zero."""
    if norm_before_gate or rounding != "llama" or np_dtype(x.dtype).itemsize == 4 or np_dtype(w.dtype) == np_dtype(
            x.dtype):
        return np.zeros(())
    y = gated_rms_norm_fwd(x, z, w, eps, group_size, norm_before_gate, activation, rounding)
    return np.abs(y) * 2.0 ** -ml_dtypes.finfo(np_dtype(x.dtype)).nmant


def gated_rms_norm_bwd(x, z, w, dy, eps: float, group_size: int | None = None, norm_before_gate: bool = True,
                       activation: str = "silu", rounding: str = "llama"):
    """float64 (dx, dz, dw, dw_tol) of gated_rms_norm_fwd with eager autograd's rounding points:
    dp = dL/dp: dy * a (rounded to promote(w, x) for "llama") with the gate after, dy with it first;
    g = dL/d(normed): "llama" `(dp * w).to(x.dtype)`, "fp32" `dp * w`; dh = rstd * (g - n * mean(g * n)) per
    group; dx = dh * a, dL/da = dh * x with the gate first, else dx = dh, dL/da = dy * p;
    dz = dL/da * act'(z). dw sums terms: "llama" `dp * normed.to(x.dtype)` rounded to promote(w, x), "fp32"
    `dp * normed` (fp32). dw_tol: as rms_norm_bwd's."""
    x64, z64, w64, dy64 = (np.asarray(t, np.float64) for t in (x, z, w, dy))
    group_size = x64.shape[-1] if group_size is None else group_size
    x_dtype, p_dtype = np_dtype(x.dtype), promote(x.dtype, w.dtype)
    a, s = _act64(z64, activation)
    h = x64 if norm_before_gate else x64 * a
    rstd = _rstd(_grouped(h, group_size), eps)
    n = (_grouped(h, group_size) * rstd).reshape(h.shape)
    if norm_before_gate:
        p = _round(w64 * _round(n, x_dtype), p_dtype) if rounding == "llama" else w64 * n
        da = dy64 * p
        dp = _round(dy64 * a, p_dtype) if rounding == "llama" else dy64 * a
    else:
        dp = dy64
    if rounding == "llama":
        g = _round(_round(dp * w64, p_dtype), x_dtype)
        terms = _round(dp * _round(n, x_dtype), p_dtype)
        bits = ml_dtypes.finfo(x_dtype).nmant
    else:
        g = dp * w64
        terms = _round(dp * n, np.float32)
        bits = ml_dtypes.finfo(np.float32).nmant
    gg, ng = _grouped(g, group_size), _grouped(n, group_size)
    dh = (rstd * (gg - ng * np.mean(gg * ng, axis=-1, keepdims=True))).reshape(h.shape)
    if norm_before_gate:
        dx = dh
    else:
        dx, da = dh * a, dh * x64
    dz = da * s * (1.0 - s) if activation == "sigmoid" else da * s * (1.0 + z64 * (1.0 - s))
    terms = terms.reshape(-1, x64.shape[-1])
    return dx, dz, terms.sum(axis=0), np.abs(terms).sum(axis=0) * 2.0 ** -(bits + 1)


# ---------------------------------------------------------------------------------------------------
# ULP metrics


def ordered_bits(a: np.ndarray) -> np.ndarray:
    """Map floats to integers whose order is the floats' order, so |ordered(a) - ordered(b)| counts ULPs."""
    a = np.asarray(a)
    bits = a.view({2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]).astype(np.int64)
    sign_min = -(1 << (8 * a.dtype.itemsize - 1))
    return np.where(bits < 0, sign_min - bits, bits)


def ulp_distance(out: np.ndarray, ref64: np.ndarray) -> np.ndarray:
    """ULPs between `out` and the float64 reference rounded to out's dtype."""
    out = np.asarray(out)
    return np.abs(ordered_bits(out) - ordered_bits(np.asarray(ref64).astype(out.dtype)))


def error_stats(out, ref64, abs_ok: float = 0.0) -> dict:
    """Numbers the thresholds judge, also reported next to every benchmark result."""
    out = np.asarray(out)
    got = out.astype(np.float64)
    ref64 = np.asarray(ref64, np.float64)
    err = np.abs(got - ref64)
    finite = bool(np.all(np.isfinite(got)))
    ulp = ulp_distance(out, ref64)
    ulp = np.where(err <= abs_ok, 0, ulp)
    # Beyond the allowance: what the 32-bit criteria judge (the allowance covers intermediates that
    # legitimately round to a neighbouring 16-bit value, e.g. normed.to(x.dtype) inside dw's terms).
    excess = np.maximum(err - abs_ok, 0.0)
    ref_norm = float(np.linalg.norm(ref64)) or 1.0
    return {
        "finite": finite,
        "max_ulp": int(ulp.max()) if ulp.size else 0,
        "within_1ulp": float(np.mean(ulp <= 1)) if ulp.size else 1.0,
        "rel_l2": float(np.linalg.norm(excess) / ref_norm) if ulp.size else 0.0,
        "max_err_rel_to_max_ref": float(excess.max() / (np.abs(ref64).max() or 1.0)) if ulp.size else 0.0,
    }


def check(out, ref64, kind: str, abs_ok=None) -> dict:
    """Assert the contract's thresholds; `kind` is 'fwd', 'dx' or 'dw'. Returns the stats.

    16-bit outputs: fwd <= 2 ULP max and >= 99 % within 1 ULP; dx, dw <= 8 ULP max and >= 95 % within
    1 ULP (a dx element may instead be within 1e-7 absolute; `abs_ok`, the oracle's rms_norm_fwd_tol
    or dw_tol, is an allowance for 16-bit intermediates that round to the neighbouring value).
    32-bit outputs, where ULPs measure summation order: relative L2 <= 1e-6 and max error <= 1e-5 *
    max|ref| (beyond the allowance). NaN/Inf never pass."""
    out = np.asarray(out)
    allowance = np.maximum(1e-7 if kind == "dx" else 0.0, 0.0 if abs_ok is None else abs_ok)
    stats = error_stats(out, ref64, abs_ok=allowance)
    assert stats["finite"], f"{kind}: non-finite output"
    if out.dtype.itemsize == 2:
        max_ulp, frac = (2, 0.99) if kind == "fwd" else (8, 0.95)
        assert stats["max_ulp"] <= max_ulp, f"{kind}: {stats}"
        assert stats["within_1ulp"] >= frac, f"{kind}: {stats}"
    else:
        assert stats["rel_l2"] <= 1e-6, f"{kind}: {stats}"
        assert stats["max_err_rel_to_max_ref"] <= 1e-5, f"{kind}: {stats}"
    return stats


# ---------------------------------------------------------------------------------------------------
# Padded expert row gather for MoE (xkern/permute/): plain loops over the contract, exact integers.


def generate_permute_indices(counts, experts_per_rank: int, num_ranks: int, max_len: int,
                             alignment: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(permuted_indices [max_len] int32, m_sizes [E] int32, m_offsets [E] int32), torchtitan's
    contract: counts rank-major, each expert's block rounded up to `alignment` (at least one block),
    rows by rank then arrival inside a block, -1 at padding; rows past max_len are dropped."""
    counts = np.asarray(counts, np.int64).reshape(num_ranks, experts_per_rank)
    row_start = (np.cumsum(counts.reshape(-1)) - counts.reshape(-1)).reshape(counts.shape)
    totals = counts.sum(axis=0)
    m_sizes = -(-np.maximum(totals, alignment) // alignment) * alignment
    m_offsets = np.cumsum(m_sizes)
    out = np.full(max_len, -1, np.int64)
    for e in range(experts_per_rank):
        slot = int(m_offsets[e] - m_sizes[e])
        for r in range(num_ranks):
            for k in range(int(counts[r, e])):
                if slot < max_len:
                    out[slot] = row_start[r, e] + k
                slot += 1
    return out.astype(np.int32), m_sizes.astype(np.int32), m_offsets.astype(np.int32)


def topk_permute_indices(expert_ids, num_experts: int, max_len: int,
                         alignment: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """generate_permute_indices' layout for the copies' expert counts (one rank), each slot naming its copy
    (the flattened index of expert_ids); copies of one expert in copy order; ids outside [0, num_experts) get
    no slot."""
    ids = np.asarray(expert_ids, np.int64).reshape(-1)
    valid = np.flatnonzero((ids >= 0) & (ids < num_experts))
    order = valid[np.argsort(ids[valid], kind="stable")]  # the copies, expert by expert, in copy order
    rows, m_sizes, m_offsets = generate_permute_indices(np.bincount(ids[valid], minlength=num_experts), num_experts,
                                                        1, max_len, alignment)
    return np.where(rows >= 0, order[np.maximum(rows, 0)] if order.size else -1, -1).astype(np.int32), m_sizes, \
        m_offsets


def permute_rows(x: np.ndarray, idx) -> np.ndarray:
    """out[i] = x[idx[i]], a +0.0 row where idx[i] == -1 (bits of x copied as they are)."""
    out = np.zeros((len(idx), x.shape[1]), x.dtype)
    for i, r in enumerate(np.asarray(idx)):
        if r >= 0:
            out[i] = x[r]
    return out


def inverse_permutation(idx, num_rows: int) -> np.ndarray:
    """inv[idx[i]] = i for the valid slots, -1 for rows no slot names; idx's dtype."""
    idx = np.asarray(idx)
    inv = np.full(num_rows, -1, idx.dtype)
    for i, r in enumerate(idx):
        if r >= 0:
            inv[r] = i
    return inv


def unpermute_rows(y: np.ndarray, idx, num_rows: int) -> np.ndarray:
    """out[r] = y[inv[r]], a +0.0 row for rows no slot names; padding rows of y are never read."""
    return permute_rows(y, inverse_permutation(idx, num_rows))


def permute_token_rows(x: np.ndarray, idx, top_k: int) -> np.ndarray:
    """permute_rows(top_k): out[i] = x[idx[i] // top_k] (routed copy r = t * top_k + j reads token t), a +0.0
    row where idx[i] == -1."""
    out = np.zeros((len(idx), x.shape[1]), x.dtype)
    for i, r in enumerate(np.asarray(idx)):
        if r >= 0:
            out[i] = x[r // top_k]
    return out


def combine_rows(y: np.ndarray, idx, num_rows: int, top_k: int = 1, probs=None) -> np.ndarray:
    """unpermute_rows(top_k, probs) in float64: out[t] = sum_j p[t, j] * y[slot of copy t * top_k + j]
    (p = 1 without probs; a dropped copy adds 0): [num_rows // top_k, H]. The kernel sums in FP32 and rounds
    once: compare with `combine_tolerance`."""
    y64 = np.asarray(y, np.float64)
    p = np.ones(num_rows) if probs is None else np.asarray(probs, np.float64).reshape(-1)
    out = np.zeros((num_rows // top_k, y.shape[1]))
    for s, r in enumerate(np.asarray(idx)):
        if r >= 0:
            out[r // top_k] += p[r] * y64[s]
    return out


def combine_rows_bwd(dout: np.ndarray, y: np.ndarray, idx, num_rows: int, top_k: int, probs=None,
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The weighted combine's gradients in float64: dy[s] = p[r] * dout[r // top_k] for the copy r = idx[s]
    (zero rows at padding), and dprobs[t, j] = sum_h y[slot of r, h] * dout[t, h] (0 for dropped copies)."""
    d64, y64 = np.asarray(dout, np.float64), np.asarray(y, np.float64)
    p = np.ones(num_rows) if probs is None else np.asarray(probs, np.float64).reshape(-1)
    dy = np.zeros(y.shape)
    dprobs = np.zeros(num_rows)
    for s, r in enumerate(np.asarray(idx)):
        if r >= 0:
            dy[s] = p[r] * d64[r // top_k]
            dprobs[r] = y64[s] @ d64[r // top_k]
    return dy, dprobs.reshape(num_rows // top_k, top_k)


def combine_tolerance(terms_abs: np.ndarray, n_terms: int, dtype) -> np.ndarray:
    """Allowed |kernel - float64| for a sum of `n_terms` products accumulated in FP32 and rounded once to
    `dtype`: n_terms * 2**-24 * sum|terms| (FP32 rounding of each product and partial sum) plus one ULP of
    `dtype` at that magnitude (the final rounding, and double rounding of the FP32 sum)."""
    mant = {"bfloat16": 8, "float16": 11, "float32": 24}[np_dtype(dtype).name if np_dtype(dtype) != BF16
                                                        else "bfloat16"]
    tiny = float(np.finfo(np.float32).tiny) if mant == 24 else 2.0**-24
    return (n_terms + 1) * 2.0**-24 * terms_abs + 2.0 ** (1 - mant) * terms_abs + tiny


def check_sum(got: np.ndarray, ref64: np.ndarray, mag64: np.ndarray, n_terms: int, dtype, what: str) -> None:
    """Assert `got` (numpy, of `dtype`) is finite and within `combine_tolerance(mag64, n_terms, dtype)` of the
    float64 truth `ref64`: sums of up to `n_terms` products in FP32, rounded once (`mag64`: the sum of the terms'
    magnitudes). A NaN (an element left unwritten in a poisoned output) fails."""
    got = np.asarray(got)
    assert got.shape == ref64.shape and got.dtype == np_dtype(dtype), f"{what}: {got.shape} {got.dtype}"
    got = got.astype(np.float64)
    assert np.isfinite(got).all(), f"{what}: not finite (an element left unwritten?)"
    err, tol = np.abs(got - ref64), combine_tolerance(mag64, n_terms, dtype)
    assert (err <= tol).all(), f"{what}: max err {err.max()}, {int((err > tol).sum())} elements past tolerance"


# ---------------------------------------------------------------------------------------------------
# Grouped GEMM over the padded expert-major layout (xkern/grouped_mm/), in float64.


def _expert_blocks(m_offsets, n_slots: int):
    """(expert, start, end) of each expert's rows: slots [m_offsets[e-1], m_offsets[e])."""
    ends = [int(v) for v in np.asarray(m_offsets).reshape(-1)]
    return [(e, ends[e - 1] if e else 0, end) for e, end in enumerate(ends)]


def grouped_mm(x, w, m_offsets) -> np.ndarray:
    """y[r] = x[r] @ w[e] for the rows of expert e, zero rows past m_offsets[-1]: [S, N] in float64. The kernel
    sums in FP32 and rounds once: compare with `combine_tolerance`, this oracle on |x| and |w| giving the
    terms' magnitudes."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y = np.zeros((x64.shape[0], w64.shape[2]))
    for e, start, end in _expert_blocks(m_offsets, x64.shape[0]):
        y[start:end] = x64[start:end] @ w64[e]
    return y


def grouped_mm_bwd(x, w, dy, m_offsets) -> tuple[np.ndarray, np.ndarray]:
    """(dx, dw) in float64: dx[r] = dy[r] @ w[e].T (zero rows past the last offset), dw[e] = x_e.T @ dy_e (zeros
    for an expert without rows)."""
    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    dx, dw = np.zeros(x64.shape), np.zeros(w64.shape)
    for e, start, end in _expert_blocks(m_offsets, x64.shape[0]):
        dx[start:end] = dy64[start:end] @ w64[e].T
        dw[e] = x64[start:end].T @ dy64[start:end]
    return dx, dw
