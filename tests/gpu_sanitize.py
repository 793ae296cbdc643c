"""A subset of the GPU suite for `compute-sanitizer --tool memcheck` (run with
PYTORCH_NO_CUDA_MEMORY_CACHING=1, or torch's caching allocator hides reads past a tensor's end):

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 tests/gpu_sanitize.py

Every kernel variant family runs at shapes whose edges are masked (odd widths, partial tiles, chunk
tails), each output checked against the oracle so the run also proves the results.
"""

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import torch_api  # noqa: E402
from xkern import reference as R  # noqa: E402


def _np(t):
    t = t.detach().cpu()
    return t.view(torch.int16).numpy().view(R.BF16) if t.dtype == torch.bfloat16 else t.numpy()


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    count = 0
    for rows, n in [(37, 1), (33, 3), (129, 64), (77, 80), (77, 127), (65, 128), (19, 129), (9, 300), (5, 2049),
                    (5, 2500), (5, 2880), (3, 5000), (3, 9000), (3, 13000), (3, 16385), (2, 18000), (2, 40000)]:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(rows, n, device="cuda", dtype=dtype, generator=g).requires_grad_()
            w = (1 + 0.5 * torch.randn(n, device="cuda", generator=g)).to(dtype).requires_grad_()
            dy = torch.randn(rows, n, device="cuda", dtype=dtype, generator=g)
            eps = 1e-2 if n == 1 else 1e-5  # width 1: dx is a cancellation fp32 resolves only for larger eps
            y = torch_api.rms_norm(x, w, eps)
            y.backward(dy)
            xn, wn, dyn = _np(x), _np(w), _np(dy)
            R.check(_np(y), R.rms_norm_fwd(xn, wn, eps), "fwd")
            dx_ref, dw_ref, tol = R.rms_norm_bwd(xn, wn, dyn, eps)
            R.check(_np(x.grad), dx_ref, "dx")
            R.check(_np(w.grad), dw_ref, "dw", tol)
            count += 1
    # Weights that are not contiguous: a strided view, and one element expanded to n (a kernel
    # indexing it as contiguous reads n elements of a 1-element allocation).
    for rows, n in [(33, 3), (65, 128), (9, 300), (3, 5000), (3, 16385), (2, 40000)]:
        big = (1 + 0.5 * torch.randn(2 * n, device="cuda", generator=g)).requires_grad_()
        one = torch.tensor([1.5], device="cuda", requires_grad=True)
        for leaf, w in ((big, big[::2]), (one, one.expand(n))):
            x = torch.randn(rows, n, device="cuda", generator=g).requires_grad_()
            dy = torch.randn(rows, n, device="cuda", generator=g)
            y = torch_api.rms_norm(x, w, 1e-5)
            y.backward(dy)
            xn, wn, dyn = _np(x), _np(w.detach().contiguous()), _np(dy)
            R.check(_np(y), R.rms_norm_fwd(xn, wn, 1e-5), "fwd")
            dx_ref, dw_ref, _ = R.rms_norm_bwd(xn, wn, dyn, 1e-5)
            R.check(_np(x.grad), dx_ref, "dx")
            got = _np(leaf.grad)
            want = dw_ref.sum(keepdims=True) if leaf is one else dw_ref
            assert np.allclose(got if leaf is one else got[::2], want, rtol=1e-4, atol=1e-4)
            count += 1
    # The fused residual add: each kernel family (tile, split, row, chunked / stats + columns), with an FP32
    # residual stream where x is bf16, residual_out's gradient given
    for rows, n in [(65, 128), (19, 129), (5, 2500), (3, 5000), (3, 9000), (3, 16385), (2, 40000), (2, 70000)]:
        for r_dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            r = torch.randn(rows, n, device="cuda", dtype=r_dtype, generator=g).requires_grad_()
            w = (1 + 0.5 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16).requires_grad_()
            y, s = torch_api.add_rms_norm(x, r, w, 1e-5)
            dy, ds = torch.randn_like(y), torch.randn_like(s)
            torch.autograd.backward((y, s), (dy, ds))
            y64, s_ref = R.add_rms_norm_fwd(_np(x), _np(r), _np(w), 1e-5)
            assert np.array_equal(_np(s).astype(np.float64), s_ref.astype(np.float64))
            R.check(_np(y), y64, "fwd")
            dsum, dw_ref, tol = R.add_rms_norm_bwd(s_ref, _np(w), _np(dy), _np(ds), 1e-5, x_dtype=R.BF16)
            R.check(_np(r.grad), dsum.astype(s_ref.dtype).astype(np.float64), "dx",
                    R.add_rms_norm_dsum_tol(s_ref, _np(w), _np(dy), 1e-5, x_dtype=R.BF16))
            R.check(_np(w.grad), dw_ref, "dw", tol)
            count += 1
    # up to 4096 slots the one-launch search forms, above them (6000 tokens) the scatter and verified gather
    for tokens, hidden, ranks, align in [(100, 1025, 2, 16), (64, 1, 1, 8), (0, 64, 2, 16), (333, 2048, 4, 128),
                                         (6000, 64, 4, 16)]:
        experts = 8
        counts = torch.randint(0, 2 * max(tokens, 1) // (experts * ranks) + 1, (ranks * experts,), device="cuda",
                               dtype=torch.int32, generator=g)
        counts[3] = 0
        n_rows = int(counts.sum())
        max_len = n_rows + experts * align
        idx, _, _ = torch_api.generate_permute_indices(counts, experts, ranks, max_len, align)
        x = torch.randn(n_rows, hidden, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        y = torch_api.permute_rows(x, idx, validate=True)
        out = torch_api.unpermute_rows(y, idx, n_rows, validate=True)
        out.backward(torch.randn_like(out))
        assert torch.equal(out, x) and torch.equal(x.grad.isfinite(), torch.ones_like(x.grad, dtype=torch.bool))
        count += 1
    # the top_k forms: dispatch from token rows, the weighted combine and its backward (dropped copies, an
    # expert no token picks, odd widths, no tokens; 700 x 6 copies: 4209 slots, above ONE_LAUNCH_SLOTS, the
    # token-major dispatch and backward); the oracle in float64, the kernels sum in FP32
    for tokens, hidden, top_k, dtype, p_dtype in [(37, 7168, 8, torch.bfloat16, torch.float32),
                                                  (5, 33, 2, torch.float32, torch.bfloat16),
                                                  (0, 64, 2, torch.bfloat16, torch.float32),
                                                  (700, 1025, 6, torch.bfloat16, torch.bfloat16)]:
        n = tokens * top_k
        ids = torch.randint(0, 7, (n,), device="cuda", generator=g)  # expert 7 of 8 never picked
        order = torch.argsort(ids, stable=True).int()
        idx = torch.cat([torch.where(order % 5 == 1, -1, order), torch.full((9,), -1, device="cuda").int()])
        x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=g).requires_grad_()
        probs = torch.rand(tokens, top_k, device="cuda", generator=g).to(p_dtype).requires_grad_()
        y = torch.randn(len(idx), hidden, device="cuda", dtype=dtype, generator=g).requires_grad_()
        d = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=g)
        xp = torch_api.permute_rows(x, idx, validate=True, top_k=top_k)
        out = torch_api.unpermute_rows(y, idx, n, validate=True, top_k=top_k, probs=probs)
        out.backward(d)
        xp.backward(y.detach())
        xn, yn, dn, pn, ix = _np(x), _np(y), _np(d), _np(probs), idx.cpu().numpy()
        assert np.array_equal(_np(xp).view(np.uint8), R.permute_token_rows(xn, ix, top_k).view(np.uint8))
        ref_dy, ref_dp = R.combine_rows_bwd(dn, yn, ix, n, top_k, pn)
        for got, want, name in ((out, R.combine_rows(yn, ix, n, top_k, pn), "combine"), (y.grad, ref_dy, "dy"),
                                (probs.grad, ref_dp, "dprobs"), (x.grad, R.combine_rows(yn, ix, n, top_k), "dx")):
            assert np.allclose(_np(got).astype(np.float64), want, rtol=2e-2, atol=2e-2), name
        count += 1
    # topk_permute_indices: partial chunks, an expert no copy picks, ids past num_experts, copies dropped past a
    # short max_len, slots past the last block, no copies, more experts than copies
    for tokens, top_k, experts, align, short in [(300, 8, 9, 16, False), (700, 3, 5, 4, True), (0, 2, 3, 2, False),
                                                 (130, 4, 1000, 2, False), (5000, 8, 256, 16, False)]:
        ids = torch.randint(0, experts + 1, (tokens, top_k), device="cuda", generator=g)  # `experts`: no expert
        ids[ids == 1] = 2
        max_len = tokens * top_k // 2 if short else tokens * top_k + experts * align + 7
        got = torch_api.topk_permute_indices(ids, experts, max_len, align)
        want = R.topk_permute_indices(ids.cpu().numpy(), experts, max_len, align)
        assert all(np.array_equal(g_.cpu().numpy(), w) for g_, w in zip(got, want)), (tokens, top_k, experts)
        count += 1
    # grouped_mm forward, dx and dw: partial row, column and K tiles, an empty expert, a zero tail past the
    # last offset, both weight layouts (dx reads w transposed), bf16 and fp32; every kernel variant (the split dw
    # in 64-row chunks, so that it splits)
    from xkern.grouped_mm import VARIANTS, plans, recipes, set_variant

    plans.DW_SPLIT_ROWS = 64
    recipes._dw_recipe.cache_clear()
    for variant, (slots, k, n, sizes, dtype) in itertools.product(VARIANTS, [
            (300, 72, 130, (90, 0, 17, 150), torch.bfloat16), (257, 64, 128, (128, 128), torch.bfloat16),
            (70, 33, 40, (5, 60), torch.float32)]):
        set_variant(variant)
        offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")
        x = torch.randn(slots, k, device="cuda", generator=g).to(dtype).requires_grad_()
        w = (torch.randn(len(sizes), k, n, device="cuda", generator=g) / k ** 0.5).to(dtype).requires_grad_()
        dy = torch.randn(slots, n, device="cuda", generator=g).to(dtype)
        y = torch_api.grouped_mm(x, w, offs)
        y.backward(dy)
        on = offs.cpu().numpy()
        ref_dx, ref_dw = R.grouped_mm_bwd(_np(x), _np(w), _np(dy), on)
        for got, want, name in ((y, R.grouped_mm(_np(x), _np(w), on), "y"), (x.grad, ref_dx, "dx"),
                                (w.grad, ref_dw, "dw")):
            assert np.allclose(_np(got).astype(np.float64), want, rtol=2e-2, atol=2e-2), (name, slots, k, n, variant)
        count += 1
    set_variant("default")
    count += _gated(g)
    torch.cuda.synchronize()
    print(f"sanitize subset: {count} cases ran and matched the oracle")


def _gated(g) -> int:
    """The gated norm: every kernel (tiles of narrow and odd groups, a head-major strided view, the chunked
    forward and the statistics + column-split backward past the register blocks), every family."""
    from xkern.gated_rms_norm import FAMILIES

    count = 0
    for rows, n, group in [(37, 1, 1), (65, 128, None), (19, 300, 100), (9, 1024, 128), (3, 5000, None),
                           (2, 8200, None), (2, 16400, 8200), (1, 16392, None)]:
        for nbg, act, rounding in FAMILIES.values():
            opts = dict(group_size=group, norm_before_gate=nbg, activation=act, rounding=rounding)
            both = torch.randn(rows, 2 * n, device="cuda", dtype=torch.bfloat16, generator=g)
            if n % 8 == 0:  # rows of a fused projection, read in place
                both.requires_grad_()
                x, z = both[:, :n], both[:, n:]
            else:
                x, z = both[:, :n].contiguous().requires_grad_(), both[:, n:].contiguous().requires_grad_()
            w = (1 + 0.3 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16).requires_grad_()
            eps = 1e-2 if n == 1 else 1e-5
            y = torch_api.gated_rms_norm(x, z, w, eps, **opts)
            dy = torch.randn(y.shape, device="cuda", dtype=y.dtype, generator=g)
            dx, dz, dw = torch.autograd.grad(y, (x, z, w), dy)
            xn, zn, wn = _np(x), _np(z), _np(w)
            R.check(_np(y), R.gated_rms_norm_fwd(xn, zn, wn, eps, **opts), "fwd",
                    R.gated_rms_norm_fwd_tol(xn, zn, wn, eps, **opts))
            dx_ref, dz_ref, dw_ref, tol = R.gated_rms_norm_bwd(xn, zn, wn, _np(dy), eps, **opts)
            R.check(_np(dx), dx_ref, "dx")
            R.check(_np(dz), dz_ref, "dx")
            R.check(_np(dw), dw_ref, "dw", tol)
            count += 1
    return count


if __name__ == "__main__":
    main()
