"""GPU-only: `grouped_mm` at the Qwen3-MoE step's up projection (benchmarks/moe_layer.py's qwen3-moe size: 16384
tokens routed top-8 over 128 experts by its router, the padded layout of 131072 + 128 * 16 slots, K 2048, N
1536, bf16) against torch._grouped_mm (CUTLASS: the same cumulative-end offsets) for the forward, dx and dw, and
xkern's results the same bits run to run. Skipped without CUDA (the interpreter would take hours).
"""

from __future__ import annotations

import pytest
import torch

import torch_api
from benchmarks import moe_layer
from xkern import reference as R

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"),
                                reason="needs a CUDA GPU and torch._grouped_mm")


def _close(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, n_terms: int, what: str) -> None:
    """Both sum in FP32 (in other orders) and round once to bf16: each within `combine_tolerance` of the truth,
    so within twice it of each other (`mag`: the sum of the terms' magnitudes, from |operands|)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    got, want, mag = got.double(), want.double(), mag.double()
    assert torch.isfinite(got).all(), f"{what}: not finite"
    err, tol = (got - want).abs(), 2 * R.combine_tolerance(mag, n_terms, "bfloat16")
    bad = int((err > tol).sum())
    assert bad == 0, f"{what}: {bad} elements past tolerance, max err {float(err.max())}"


def test_qwen3_moe_up_projection_against_torch_grouped_mm():
    size = moe_layer.SIZES["qwen3-moe"]
    inp = moe_layer.torch_inputs(size, "cuda")
    with torch.no_grad():
        _, ids = moe_layer.route(inp["x"], inp["w_router"], size["top_k"])
        slot_copy, _, _, offs = moe_layer.xkern_layout(ids, size["experts"])
        xp = torch_api.permute_rows(inp["x"], slot_copy, top_k=size["top_k"])
    w = inp["w13"].transpose(-2, -1)  # [E, H, 2I], as the benchmark's experts read it
    n_slots, k, n = xp.shape[0], w.shape[1], w.shape[2]
    assert n_slots == size["tokens"] * size["top_k"] + size["experts"] * moe_layer.ALIGN
    last = int(offs[-1])
    dy = torch.randn(n_slots, n, generator=torch.Generator("cuda").manual_seed(1), device="cuda",
                     dtype=torch.bfloat16)

    x_leaf, w_leaf = xp.clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = torch_api.grouped_mm(x_leaf, w_leaf, offs)
    dx, dw = torch.autograd.grad(y, (x_leaf, w_leaf), dy)
    assert not torch.any(y[last:]) and not torch.any(dx[last:])

    want_y = torch._grouped_mm(xp, w, offs=offs)
    want_dx = torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs)
    want_dw = torch._grouped_mm(xp.t(), dy, offs=offs)
    ax, aw, ady = xp.abs(), w.abs(), dy.abs()
    _close(y[:last], want_y[:last], torch._grouped_mm(ax, aw, offs=offs)[:last], k, "y")
    _close(dx[:last], want_dx[:last], torch._grouped_mm(ady, aw.transpose(-2, -1), offs=offs)[:last], n, "dx")
    rows = int(torch.diff(offs, prepend=offs.new_zeros(1)).max())  # the terms of dw: the largest expert's rows
    _close(dw, want_dw, torch._grouped_mm(ax.t(), ady, offs=offs), rows, "dw")

    again = torch_api.grouped_mm(x_leaf, w_leaf, offs)
    dx2, dw2 = torch.autograd.grad(again, (x_leaf, w_leaf), dy)
    for a, b in ((again, y), (dx2, dx), (dw2, dw)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "not the same bits run to run"


def test_deep_inner_dim_against_torch_grouped_mm():
    """An inner dim past `DEEP_INNER` (the rows kernel's 3-stage plan, DeepSeek-V3's 7168-deep GEMMs) for the
    forward and dx, and dw over it, against torch._grouped_mm; experts of uneven sizes (multiples of 16, as
    torch._grouped_mm's bf16 offsets must be; not of the 128-row tile), one empty."""
    from xkern.grouped_mm import DEEP_INNER

    g = torch.Generator("cuda").manual_seed(3)
    k, n, sizes = DEEP_INNER + 3072, 384, [704, 0, 144, 1200, 64]
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    n_slots = int(offs[-1]) + 112  # a zero tail

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    x, w, dy = rnd(n_slots, k), rnd(len(sizes), k, n) * k ** -0.5, rnd(n_slots, n)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = torch_api.grouped_mm(xl, wl, offs)
    dx, dw = torch.autograd.grad(y, (xl, wl), dy)
    last = int(offs[-1])
    assert not torch.any(y[last:]) and not torch.any(dx[last:])
    ax, aw, ady = x.abs(), w.abs(), dy.abs()
    _close(y[:last], torch._grouped_mm(x, w, offs=offs)[:last], torch._grouped_mm(ax, aw, offs=offs)[:last], k, "y")
    _close(dx[:last], torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs)[:last],
           torch._grouped_mm(ady, aw.transpose(-2, -1), offs=offs)[:last], n, "dx")
    _close(dw, torch._grouped_mm(x.t(), dy, offs=offs), torch._grouped_mm(ax.t(), ady, offs=offs), max(sizes), "dw")


def test_variants_at_skewed_qwen3_moe_down_projection():
    """The kernel variants (`xkern.grouped_mm.VARIANTS`) at the Qwen3-MoE size's down projection (K 768, N 2048)
    under the GEMM table's skewed routing (its largest experts past DW_SPLIT_ROWS: the split dw splits them):
    "persistent" and "dw_persistent" give the default's bits; "dw_narrow" is within tolerance of CUTLASS's dw;
    "dw_split" too, with the default's bits for every expert it does not split, the same bits run to run, and
    both front ends' bits alike."""
    import importlib

    import jax

    from benchmarks import grouped_mm as bench
    from benchmarks.runner import to_jax
    from xkern.grouped_mm import dw_tile, set_variant
    from xkern.grouped_mm.plans import dw_split_rows

    # the modules (the packages' attributes of that name are the functions)
    jgm, tgm = map(importlib.import_module, ("jax_api.grouped_mm", "torch_api.grouped_mm"))
    size = moe_layer.SIZES["qwen3-moe"]
    offs = torch.from_numpy(bench.offsets(bench.skewed_counts(size))).cuda()
    n_slots, (k, n) = bench.n_slots(size), bench.projection_shape(size, "down")
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    split = sizes > dw_split_rows(n_slots, k, n, dw_tile("bfloat16").block_k)
    assert 1 < int(split.sum()) < len(sizes)
    g = torch.Generator("cuda").manual_seed(5)
    x, dy = (torch.randn(n_slots, d, generator=g, device="cuda", dtype=torch.bfloat16) for d in (k, n))
    w = torch.randn(size["experts"], k, n, generator=g, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    last = int(offs[-1])
    x[last:], dy[last:] = 0, 0
    default = (torch_api.grouped_mm(x, w, offs), tgm.grouped_mm_dx(dy, w, offs), tgm.grouped_mm_dw(x, dy, offs))
    try:
        set_variant("persistent")
        assert torch.equal(torch_api.grouped_mm(x, w, offs).view(torch.int16), default[0].view(torch.int16))
        assert torch.equal(tgm.grouped_mm_dx(dy, w, offs).view(torch.int16), default[1].view(torch.int16))
        set_variant("dw_persistent")
        assert torch.equal(tgm.grouped_mm_dw(x, dy, offs).view(torch.int16), default[2].view(torch.int16))
        set_variant("dw_narrow")
        narrow = tgm.grouped_mm_dw(x, dy, offs)
        set_variant("dw_split")
        dw = tgm.grouped_mm_dw(x, dy, offs)
        assert torch.equal(tgm.grouped_mm_dw(x, dy, offs).view(torch.int16), dw.view(torch.int16))
        jdw = torch.from_dlpack(jax.jit(jgm.grouped_mm_dw)(*(to_jax(t) for t in (x, dy, offs))))
        assert torch.equal(jdw.view(torch.int16), dw.view(torch.int16)), "torch and JAX differ"
    finally:
        set_variant("default")
    assert torch.equal(dw[~split].view(torch.int16), default[2][~split].view(torch.int16))
    want, mag = torch._grouped_mm(x.t(), dy, offs=offs), torch._grouped_mm(x.abs().t(), dy.abs(), offs=offs)
    _close(dw, want, mag, int(sizes.max()), "dw (split)")
    _close(narrow, want, mag, int(sizes.max()), "dw (narrow tiles)")
