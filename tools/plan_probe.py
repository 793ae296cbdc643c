"""Candidate launch plans put in place of xkern's plan and timed exactly as the sweep times xkern (the torch
front end's eager executors, a CUDA graph of the pass, `runner.torch_make_calls`), at the sweep's size
(x of 2**26 elements). Unlike `tune_rms_norm` (kernels launched alone), this times the whole call, dw
reduction included, through the path users take. Each candidate's results are compared with the plan's
(max abs difference; the suite checks the plan finally chosen against the oracle).

    python -m tools.plan_probe [--set narrow-bwd | narrow-bwd-widths | wide-fwd | split-reload | wide-split | h100
                                      | add-bwd | add-bwd-widths | ...] [--out DIR]

Sets (docs/benchmarks.md entry 18): the narrow backward's tiles (BLOCK_M, warps, programs per SM)
at 64 and 128 wide; the 64 tile at other widths and fp16; the widest forward's row kernel against the
persistent chunked kernel at 32768 and 65536; the forward's row kernel reading x twice at the widths it
now takes in SPLIT blocks holding the row; `add-bwd`: the fused add's forward + backward through the same
backward plans; `add-bwd-widths`: its two-row backward tiles against RMSNorm's plan from 512 to 3072 wide.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import unittest.mock

from benchmarks.rms_norm import SWEEP_WIDTHS as _SWEEP_WIDTHS
from xkern import add_rms_norm as XA  # the fused add's recipes take RMSNorm's plans by name
from xkern.device import properties
from xkern.launch import Launch, cdiv
from xkern.rms_norm import BwdPlan, plan_dw_reduce, split_row
from xkern.rms_norm import plans as rms_norm_plans
from xkern.rms_norm import recipes as XR  # the recipes' module: where `_use` puts candidate plans
from xkern.rms_norm.kernels import _rms_norm_bwd_row_kernel, _rms_norm_fwd_chunked_kernel, _rms_norm_fwd_row_kernel

NUM_SMS = properties().num_sms  # this GPU's (the plans' own grids read it there too)

PLAN_FWD, PLAN_BWD = XR.plan_rms_norm_fwd, XR.plan_rms_norm_bwd


def bwd_tile(block_m: int, num_warps: int, per_sm: int, prefetch: bool = True):
    """The backward tile kernel with these tiles (the plan's kernel and BLOCK_N), its dw reduction resized."""
    def plan(n_rows, n_cols, eps, row_strides=(), n_batch=1, variant="llama", **_):
        p = PLAN_BWD(n_rows, n_cols, eps, row_strides, n_batch, variant)
        groups = max(2, min(cdiv(n_rows, block_m), NUM_SMS * per_sm))
        bwd = dataclasses.replace(p.bwd, grid=(groups, n_batch), num_warps=num_warps,
                                  constexprs={**p.bwd.constexprs, "BLOCK_M": block_m, "PREFETCH": prefetch})
        return BwdPlan(None, bwd, plan_dw_reduce(groups, n_cols, n_batch), groups)
    return plan


def bwd_scaled(rows: int, programs: float):
    """RMSNorm's own backward plan (two streams read, whatever the call reads: the tile or split kernel) with
    `rows` times its rows a tile and `programs` times its programs in flight, its dw reduction resized: the
    same candidate at every width."""
    def plan(n_rows, n_cols, eps, row_strides=(), n_batch=1, variant="llama", **_):
        p = PLAN_BWD(n_rows, n_cols, eps, row_strides, n_batch, variant)
        block_m = p.bwd.constexprs["BLOCK_M"] * rows
        groups = max(2, min(cdiv(n_rows, block_m), int(p.bwd.grid[0] * programs)))
        bwd = dataclasses.replace(p.bwd, grid=(groups, n_batch), constexprs={**p.bwd.constexprs, "BLOCK_M": block_m})
        return BwdPlan(None, bwd, plan_dw_reduce(groups, n_cols, n_batch), groups)
    return plan


def bwd_row(block_n: int, split: int, num_warps: int, per_sm: int, hold_w: bool = True):
    """The backward's row kernel (rows read twice) over SPLIT blocks of BLOCK_N, per_sm programs per SM."""
    def plan(n_rows, n_cols, eps, row_strides=(), n_batch=1, variant="llama", **_):
        c = PLAN_BWD(n_rows, n_cols, eps, row_strides, n_batch, variant).bwd.constexprs
        fixed = {"EPS": float(eps), **{k: c[k] for k in ("ROW_ALIGN", "ONE_COL", "VARIANT")}}
        groups = max(2, min(n_rows, NUM_SMS * per_sm))
        bwd = Launch(_rms_norm_bwd_row_kernel, (groups, n_batch), num_warps,
                     {**fixed, "BLOCK_N": block_n, "SPLIT": split, "HOLD_W": hold_w})
        return BwdPlan(None, bwd, plan_dw_reduce(groups, n_cols, n_batch), groups)
    return plan


def bwd_row_rule(per_thread: int, sm_warps: int):
    """A rule for the row kernel at every width up to 6 x 4096, to time against the plan across the sweep:
    the row in power-of-two blocks with at most 1/8 masked (`split_row`, blocks of 64-4096, up to 16), the
    most warps (up to 32) giving each thread at least `per_thread` elements of the row, programs per SM
    filling `sm_warps` warps, w held in registers below 32 warps (at 32 ptxas caps a thread at 64)."""
    def plan(n_rows, n_cols, eps, row_strides=(), n_batch=1, variant="llama", **_):
        block, split = split_row(n_cols, 4096, min_block=64, max_split=16)
        num_warps = min(32, 1 << max(0, (block * split // (32 * per_thread)).bit_length() - 1))
        return bwd_row(block, split, num_warps, max(1, sm_warps // num_warps), num_warps < 32)(
            n_rows, n_cols, eps, row_strides, n_batch, variant)
    return plan


def bwd_before(n_rows, n_cols, eps, row_strides=(), n_batch=1, variant="llama", *, streams=2, itemsize=2, **_):
    """The backward's plan before its wide-row and five-block rules: what it plans for 4-byte rows and three
    streams (the tiles at 4480-5120; statistics and the column split above 16384), which launch the same
    binaries for 2-byte rows."""
    return PLAN_BWD(n_rows, n_cols, eps, row_strides, n_batch, variant, streams=max(3, streams), itemsize=4)


def bwd_tile_before(n_rows, n_cols, eps, row_strides=(), n_batch=1, variant="llama", *, streams=2, itemsize=2, **_):
    """The backward's plan before its rules for masked widths (BWD_ROW_9X64, BWD_ROW_5X1024): the prefetching tiles."""
    with unittest.mock.patch.object(rms_norm_plans, "bwd_masked_row", lambda n_cols, itemsize: None):
        return PLAN_BWD(n_rows, n_cols, eps, row_strides, n_batch, variant, streams=streams, itemsize=itemsize)


def fwd_row(num_warps: int, reload: bool):
    def plan(n_rows, n_cols, eps, row_strides=(), itemsize=2, variant="llama"):
        p = PLAN_FWD(n_rows, n_cols, eps, row_strides, itemsize, variant)
        return dataclasses.replace(p, num_warps=num_warps, constexprs={**p.constexprs, "RELOAD": reload})
    return plan


def fwd_split(block_n: int, split: int, num_warps: int, reload: bool = True):
    """The forward's row kernel over SPLIT blocks of BLOCK_N, reading x twice or holding the row."""
    def plan(n_rows, n_cols, eps, row_strides=(), itemsize=2, variant="llama"):
        c = PLAN_FWD(n_rows, n_cols, eps, row_strides, itemsize, variant).constexprs
        fixed = {k: c[k] for k in ("EPS", "ROW_ALIGN", "ONE_COL", "VARIANT")}
        return Launch(_rms_norm_fwd_row_kernel, (n_rows,), num_warps,
                      {**fixed, "BLOCK_N": block_n, "SPLIT": split, "RELOAD": reload})
    return plan


def fwd_chunked(programs: int, chunk: int, num_warps: int):
    def plan(n_rows, n_cols, eps, row_strides=(), itemsize=2, variant="llama"):
        c = PLAN_FWD(n_rows, n_cols, eps, row_strides, itemsize, variant).constexprs
        fixed = {k: c[k] for k in ("EPS", "ROW_ALIGN", "ONE_COL", "VARIANT")}
        return Launch(_rms_norm_fwd_chunked_kernel, (min(n_rows, programs),), num_warps,
                      {**fixed, "BLOCK_N": chunk})
    return plan


def fwd_tile(block_m: int, num_warps: int):
    """The forward's tile kernel (rows narrower than FWD_TILE_BELOW) with BLOCK_M rows a tile."""
    def plan(n_rows, n_cols, eps, row_strides=(), itemsize=2, variant="llama"):
        p = PLAN_FWD(n_rows, n_cols, eps, row_strides, itemsize, variant)
        return dataclasses.replace(p, grid=(cdiv(n_rows, block_m),), num_warps=num_warps,
                                   constexprs={**p.constexprs, "BLOCK_M": block_m})
    return plan


def bwd_cols(block_m: int, block_n: int, num_warps: int, programs: int):
    """The column-split backward (rows wider than MAX_BWD_BLOCK, as `bwd_before` plans them) with this tile in
    place of the rule's (`plan_rms_norm_bwd(cols_tile=)`)."""
    def plan(n_rows, n_cols, eps, row_strides=(), n_batch=1, variant="llama", **_):
        return PLAN_BWD(n_rows, n_cols, eps, row_strides, n_batch, variant, streams=3, itemsize=4,
                        cols_tile=(block_m, block_n, num_warps, programs))
    return plan


def _use(fwd=None, bwd=None) -> None:
    """These plans in place of xkern's (None: the plan's) where the RMSNorm and fused-add recipes take them, the
    recipes and torch executors built on them dropped."""
    from torch_api._launch import clear_executors

    for module in (XR, XA):
        module.plan_rms_norm_fwd, module.plan_rms_norm_bwd = fwd or PLAN_FWD, bwd or PLAN_BWD
    for recipe in (XR.rms_norm_fwd_recipe, XR.rms_norm_bwd_recipe, XA.add_rms_norm_fwd_recipe,
                   XA.add_rms_norm_bwd_recipe):
        recipe.cache_clear()
    clear_executors()


def time_case(pass_: str, m: int, n: int, dtype: str, candidates: list, device: str, log=print,
              op: str = "rms_norm") -> list[dict]:
    """Rows of device µs per call: the plan first (a None candidate), then each (name, fwd plan, bwd plan).
    `op` "add_rms_norm": the fused add through the same plans, timed as its table times it ("fwd", "fwd+bwd")."""
    import torch

    import torch_api  # noqa: F401 - registers torch_api.rms_norm
    from benchmarks import add_rms_norm as BA
    from benchmarks import rms_norm as RN
    from benchmarks import timing
    from benchmarks.runner import Case, Inputs, torch_make_calls

    g = torch.Generator(device=device).manual_seed(n)
    t = getattr(torch, dtype)
    w = torch.randn(n, generator=g, device=device, dtype=t)
    # Input sets rotated as the benchmark rotates them (its forward's bytes, timing.n_sets): one set of a small
    # shape sits in L2, where the same binary's timings differed by up to 12 % with the call's place in the probe.
    fwd_bytes = (BA.min_bytes(m, n, t.itemsize, "fwd") if op == "add_rms_norm"
                 else RN.min_bytes(Case("rms_norm", (m, n), dtype, ()), "fwd"))
    sets = []
    for _ in range(timing.n_sets(fwd_bytes)):
        x, cot = (torch.randn(m, n, generator=g, device=device, dtype=t) for _ in range(2))
        if op == "add_rms_norm":  # the residual and residual_out's cotangent: two more [m, n] inputs
            r, cot_r = (torch.randn(m, n, generator=g, device=device, dtype=t) for _ in range(2))
            sets.append(([x, r, w], (cot, cot_r)))
        else:
            sets.append(([x, w], cot))
    fn = BA.xkern_torch if op == "add_rms_norm" else RN.xkern_torch
    args, cots = sets[0]
    make = BA.torch_calls(fn, pass_, sets) if op == "add_rms_norm" else torch_make_calls(fn, pass_, Inputs(sets))
    rows, base = [], None
    try:
        # the plan again last: the first timing of a case has read 1-3 % slow (docs/benchmarks.md, entry 13)
        for name, fwd, bwd in [("plan", None, None), *candidates, ("plan (again)", None, None)]:
            _use(fwd, bwd)
            row = {"op": op, "pass": pass_, "shape": [m, n], "dtype": dtype, "candidate": name}
            try:
                if pass_ == "fwd":
                    got = fn(*args)
                    got = list(got) if isinstance(got, tuple) else [got]
                else:
                    leaves = [a.detach().requires_grad_() for a in args]
                    got = list(torch.autograd.grad(fn(*leaves), leaves, cots))
                base = base or got
                row["max_abs_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, base))
                row["us"] = timing.torch_device_us(make, eager_fallback=False)[0]
            except Exception as err:  # noqa: BLE001 - a candidate that fails to compile or run is a result
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            log(json.dumps(row))
            rows.append(row)
    finally:
        _use()
    return rows


_BWD_ROW_CANDIDATES = (  # each fits its programs per SM in registers (ptxas for sm_90 here), none spills
    # controls: powers of two where the tile kernel's plan reaches 0.86-0.88
    (512, [(512, 1, 1, 16, True), (512, 1, 2, 8, True)]),
    (1024, [(1024, 1, 1, 16, True), (1024, 1, 2, 8, True), (1024, 1, 4, 4, True), (1024, 1, 4, 8, True)]),
    (2048, [(2048, 1, 2, 8, True), (2048, 1, 4, 4, True), (2048, 1, 8, 2, True), (2048, 1, 8, 4, True)]),
    (4096, [(4096, 1, 4, 4, True), (4096, 1, 8, 2, True), (4096, 1, 16, 1, True), (4096, 1, 8, 4, True)]),
    (576, [(64, 9, 1, 16, True), (64, 9, 2, 8, True), (128, 5, 2, 8, True), (128, 5, 4, 4, True)]),
    (640, [(128, 5, 1, 16, True), (128, 5, 2, 8, True), (128, 5, 4, 4, True)]),
    (768, [(256, 3, 1, 16, True), (256, 3, 2, 8, True), (256, 3, 4, 4, True)]),
    (832, [(64, 13, 2, 8, True), (128, 7, 2, 8, True), (128, 7, 4, 4, True)]),
    (1536, [(512, 3, 2, 8, True), (512, 3, 4, 4, True), (512, 3, 8, 2, True), (512, 3, 4, 8, True)]),
    (3584, [(512, 7, 4, 4, True), (512, 7, 8, 2, True), (512, 7, 4, 3, True)]),
    (5120, [(1024, 5, 4, 3, True), (1024, 5, 8, 2, True), (1024, 5, 8, 3, True), (1024, 5, 16, 2, True)]),
    (6144, [(2048, 3, 8, 2, True), (1024, 6, 4, 3, True), (1024, 6, 8, 3, True), (2048, 3, 16, 2, True)]),
    (7168, [(1024, 7, 8, 2, True), (1024, 7, 16, 2, True), (1024, 7, 32, 1, True)]),
    (8192, [(2048, 4, 8, 2, True), (8192, 1, 16, 2, True), (4096, 2, 16, 2, False), (8192, 1, 32, 1, True)]),
    (12288, [(4096, 3, 16, 1, True), (2048, 6, 16, 1, True), (4096, 3, 32, 1, True), (4096, 3, 32, 1, False)]),
    (14336, [(2048, 7, 16, 1, True), (2048, 7, 32, 1, True), (2048, 7, 32, 1, False)]),
    (16384, [(4096, 4, 16, 1, True), (16384, 1, 32, 1, True), (4096, 4, 32, 1, True), (16384, 1, 32, 1, False)]),
    # wider than 16384 the plan reads x and dy twice from DRAM (statistics, then a column split, 0.52 of the
    # copy at 18432); the row kernel fits up to 6 x 4096 at 32 warps without spilling (64 registers; 32768
    # spills 244-280 bytes)
    (18432, [(2048, 9, 32, 1, False), (4096, 5, 32, 1, False), (2048, 9, 32, 1, True)]),
    (24576, [(4096, 6, 32, 1, False)]),
)


def _bwd_case(width: int, op: str) -> tuple[str, int, int]:
    """(pass, rows, width) of a backward case: RMSNorm's backward over 2**26 elements, the fused add's forward +
    backward (as its table times it) over 2**25."""
    return ("bwd", (1 << 26) // width, width) if op == "rms_norm" else ("fwd+bwd", (1 << 25) // width, width)


def _row_cases(entries) -> list:
    """Cases of the backward's row kernel: (width, dtype, op, [(BLOCK_N, SPLIT, warps, per SM, hold w), ...])."""
    return [(*_bwd_case(w, op), dt, [(f"row {b}x{k} {nw}w {ps}/SM{'' if h else ' w re-read'}", None,
                                      bwd_row(b, k, nw, ps, h)) for b, k, nw, ps, h in c], op)
            for w, dt, op, c in entries]


def candidate_sets() -> dict:
    tiles64 = [(64, 2, 4, False), (64, 2, 6), (64, 2, 8), (128, 4, 2), (128, 4, 3), (128, 2, 4), (32, 1, 8),
               (32, 1, 12), (32, 2, 8), (256, 8, 1), (256, 4, 2), (64, 4, 4), (16, 1, 16), (16, 1, 12), (16, 1, 20),
               (16, 1, 24), (16, 1, 32), (8, 1, 32), (32, 1, 16)]
    tiles128 = [(32, 2, 4, False), (32, 2, 6), (32, 2, 8), (64, 4, 2), (64, 4, 3), (16, 1, 8), (16, 1, 12),
                (32, 4, 4), (64, 2, 4), (16, 2, 8), (8, 1, 16)]
    rules = [("rule 16/thread 16 warps/SM", None, bwd_row_rule(16, 16)),
             ("rule 8/thread 32 warps/SM", None, bwd_row_rule(8, 32))]
    near = [(f"tile{t}", None, bwd_tile(*t)) for t in [(64, 2, 4), (16, 1, 16), (16, 1, 20), (16, 1, 24)]]
    wide = [("row 32 warps, no reload", fwd_row(32, False), None), ("row 16 warps, reload", fwd_row(16, True), None)]
    wide += [(f"chunked{c}", fwd_chunked(*c), None) for c in [(132, 16384, 32), (264, 16384, 32), (132, 8192, 16),
                                                                (264, 8192, 16), (264, 8192, 8), (528, 8192, 8)]]
    return {
        "narrow-bwd": [("bwd", 1 << 20, 64, "bfloat16", [(f"tile{t}", None, bwd_tile(*t)) for t in tiles64]),
                       ("bwd", 1 << 19, 128, "bfloat16", [(f"tile{t}", None, bwd_tile(*t)) for t in tiles128])],
        "narrow-bwd-widths": [("bwd", (1 << 26) // w, w, dt, near) for w, dt in
                              [(64, "float16"), (48, "bfloat16"), (40, "bfloat16"), (32, "bfloat16")]],
        "wide-fwd": [("fwd", (1 << 26) // w, w, "bfloat16", wide) for w in (65536, 32768)],
        # The row kernel reading x twice at the SPLIT widths, where holding the row costs occupancy (ptxas for
        # sm_90 on the CPU machine: 39-64 registers, 32-50 warps per SM; reading twice: 22-32 registers, 64
        # warps per SM but at 14336 with 16 warps), and 65536 in blocks (58 registers and one program per SM
        # as one block; 32 and two programs as 4 x 16384).
        "split-reload": [("fwd", (1 << 26) // w, w, "bfloat16", [(f"{b}x{k} {nw}w reload", fwd_split(b, k, nw), None)
                                                                 for b, k, nw in c]) for w, c in (
            (1536, [(512, 3, 2), (512, 3, 4)]), (2560, [(512, 5, 2), (512, 5, 4)]), (3072, [(1024, 3, 4)]),
            (5120, [(1024, 5, 4), (1024, 5, 8)]), (6144, [(2048, 3, 8), (2048, 3, 16), (1024, 6, 8)]),
            (12288, [(4096, 3, 16), (4096, 3, 32)]), (14336, [(4096, 4, 16), (2048, 7, 8), (4096, 4, 32)]),
            (18432, [(4096, 5, 16), (4096, 5, 32)]), (65536, [(16384, 4, 32), (8192, 8, 32)]))],
        # The forwards still under 0.90 after split-reload (5120, 14336, 16384, 18432): blocks of
        # 2048 at 16 warps (no masked lanes at 14336 and 18432, 28-36 elements per thread), held or read twice.
        "wide-split": [("fwd", (1 << 26) // w, w, "bfloat16", [(f"{b}x{k} {nw}w {'reload' if r else 'held'}",
                                                                fwd_split(b, k, nw, r), None) for b, k, nw, r in c])
                       for w, c in ((5120, [(1024, 5, 8, True), (1024, 5, 4, True)]),
                                    (14336, [(2048, 7, 16, False), (2048, 7, 16, True), (4096, 4, 16, True)]),
                                    (16384, [(4096, 4, 16, False), (4096, 4, 16, True), (2048, 8, 16, False)]),
                                    (18432, [(2048, 9, 16, False), (2048, 9, 16, True), (4096, 5, 32, True)]))]
        + [("fwd", 4096, 16384, "bfloat16", [("row 32 warps, reload", fwd_row(32, True), None),
                                             ("row 16 warps, reload", fwd_row(16, True), None)])],
        # The backward's row kernel (rows read twice, only w and dw held) in SPLIT blocks with
        # several programs per SM, at the widths where the tile kernels' held rows cap the bytes in flight
        # (backward under 0.85: docs/benchmarks.md, entry 15). (BLOCK_N, SPLIT, warps, per SM, hold w).
        "bwd-row": _row_cases((w, "bfloat16", "rms_norm", c) for w, c in _BWD_ROW_CANDIDATES),
        # Two rules for the row kernel against the plan at every swept width from 512 to 24576,
        # so that one that wins at the candidates' widths is seen not to sag between them.
        "bwd-row-rule": [("bwd", (1 << 26) // w, w, dt, rules) for w, dt in
                         [(w, "bfloat16") for w in _SWEEP_WIDTHS if 512 <= w <= 24576]
                         + [(7168, "float16"), (16384, "float16")]],  # fp16's two backward widths under 0.85
        # The row kernel where `bwd-row` found it ahead of the plan (5120; 18432 and 24576, where the plan
        # reads x and dy twice from DRAM) and past 24576, where its dw partials spill (176-250 bytes a thread
        # at 32768): (BLOCK_N, SPLIT, warps, per SM, hold w).
        "bwd-row-wide": _row_cases((w, "bfloat16", "rms_norm", c) for w, c in (
            (5120, [(1024, 5, 4, 3, True), (1024, 5, 4, 4, False), (1024, 5, 8, 2, False)]),
            (18432, [(2048, 9, 32, 1, True), (2048, 9, 32, 1, False)]),
            (20480, [(4096, 5, 32, 1, True), (4096, 5, 32, 1, False)]),
            (24576, [(4096, 6, 32, 1, False), (4096, 6, 32, 1, True)]),
            (32768, [(4096, 8, 32, 1, False), (4096, 8, 16, 1, False), (2048, 16, 32, 1, False),
                     (4096, 8, 32, 1, True)]),
            (65536, [(8192, 8, 32, 1, False), (4096, 16, 32, 1, False)]))),
        # The row kernel's warps at 16385-32768 (16 warps: 128 registers a thread, the dw partials of 32768
        # spill 248 bytes; 32 warps: 64), fp32 rows, and the fused add's backward (three streams) through it.
        "bwd-row-wide-2": _row_cases((
            (18432, "bfloat16", "rms_norm", [(2048, 9, 32, 1, True), (2048, 9, 16, 1, True), (2048, 9, 16, 1, False)]),
            (24576, "bfloat16", "rms_norm", [(4096, 6, 32, 1, True), (4096, 6, 16, 1, True), (4096, 6, 16, 1, False)]),
            (28672, "bfloat16", "rms_norm", [(4096, 7, 16, 1, False), (4096, 7, 32, 1, False)]),
            (32768, "bfloat16", "rms_norm", [(4096, 8, 16, 1, False), (8192, 4, 16, 1, False), (4096, 8, 16, 1, True)]),
            (18432, "float32", "rms_norm", [(2048, 9, 32, 1, True), (2048, 9, 16, 1, False)]),
            (32768, "float32", "rms_norm", [(4096, 8, 16, 1, False)]),
            (5120, "float32", "rms_norm", [(1024, 5, 4, 3, True)]),
            (5120, "bfloat16", "add_rms_norm", [(1024, 5, 4, 3, True)]),
            (18432, "bfloat16", "add_rms_norm", [(2048, 9, 32, 1, True), (2048, 9, 16, 1, False)]),
            (32768, "bfloat16", "add_rms_norm", [(4096, 8, 16, 1, False)]))),
        # What a rule for the row kernel at 16385-32768 (and 5120) still needs: the widths and dtypes between
        # those above, and the fused add's backward with residual_out's gradient (three streams).
        "bwd-row-wide-3": _row_cases((
            (16896, "bfloat16", "rms_norm", [(2048, 9, 16, 1, True)]),
            (20480, "bfloat16", "rms_norm", [(4096, 5, 16, 1, True), (4096, 5, 16, 1, False)]),
            (24576, "float16", "rms_norm", [(4096, 6, 16, 1, False)]),
            (4608, "bfloat16", "rms_norm", [(1024, 5, 4, 3, True)]),
            (18432, "float32", "rms_norm", [(2048, 9, 16, 1, True)]),
            (20480, "float32", "rms_norm", [(4096, 5, 32, 1, True), (4096, 5, 16, 1, False)]),
            (24576, "float32", "rms_norm", [(4096, 6, 32, 1, True), (4096, 6, 16, 1, False)]),
            (28672, "float32", "rms_norm", [(4096, 7, 16, 1, False), (4096, 7, 32, 1, False)]),
            (18432, "bfloat16", "add_rms_norm", [(2048, 9, 16, 1, True)]),
            (20480, "bfloat16", "add_rms_norm", [(4096, 5, 32, 1, True), (4096, 5, 16, 1, True)]),
            (24576, "bfloat16", "add_rms_norm", [(4096, 6, 32, 1, True), (4096, 6, 16, 1, False),
                                                 (4096, 6, 32, 1, False)]),
            (28672, "bfloat16", "add_rms_norm", [(4096, 7, 16, 1, False), (4096, 7, 32, 1, False)]))),
        # The plan's wide-row and five-block backward rules (docs/benchmarks.md, entry 23) against the plan
        # before them, which `bwd_before` rebuilds.
        "bwd-wide-rule": [(*_bwd_case(w, op), dt, [("before the rule", None, bwd_before)], op)
                          for w, dt, op in [(w, "bfloat16", "rms_norm") for w in (4608, 5120, 16896, 18432, 20480,
                                                                                 24576, 28672, 32768)]
                          + [(18432, "float32", "rms_norm"), (18432, "float16", "rms_norm")]
                          + [(w, "bfloat16", "add_rms_norm") for w in (20480, 24576, 28672)]],
        # 513-576 wide, where the backward's tile takes a 1024 block with up to 7/16 of its lanes masked: the
        # row kernel in 9 blocks of 64 (`bwd-row` found it ahead at 576), across the range, fp16 and fp32 rows,
        # the fused add (three streams with residual_out's gradient), and more one-warp programs per SM.
        "bwd-nine": [(*case[:4], [("tile (before the rule)", None, bwd_tile_before), *case[4]], *case[5:])
                     for case in _row_cases(
                         [(w, "bfloat16", "rms_norm", [(64, 9, 1, 16, True)]) for w in (520, 544)]
                         + [(576, "bfloat16", "rms_norm", [(64, 9, 1, p, True) for p in (12, 16, 24)]),
                            (576, "float16", "rms_norm", [(64, 9, 1, 16, True)]),
                            (576, "float32", "rms_norm", [(64, 9, 1, 16, True), (64, 9, 2, 8, True)]),
                            (576, "bfloat16", "add_rms_norm", [(64, 9, 1, 16, True), (64, 9, 1, 12, True)])])],
        # The H100's main set (2026-12-05; docs/benchmarks.md, the H100 set) fell more than 2 % behind the best
        # peer only at the narrowest forwards (64 and 128 wide; XLA, torch.compile) and the column-split
        # backward above 16384 (quack): the tiles there. Run on the H100 and the H200 alike.
        "h100": [("fwd", m, n, "bfloat16", [(f"tile {bm}x{n} {nw}w", fwd_tile(bm, nw), None) for bm, nw in c])
                 for m, n, c in ((262144, 64, [(8, 1), (32, 1), (32, 2), (64, 2)]),
                                 (32768, 128, [(8, 1), (16, 1), (32, 2), (32, 4), (64, 4)]),
                                 (262144, 128, [(8, 1), (32, 2), (32, 4)]))]
        + [("bwd", m, n, "bfloat16", [(f"cols {bm}x{bn} {nw}w {p // NUM_SMS}/SM", None, bwd_cols(bm, bn, nw, p))
                                      for bm, bn, nw, p in c])
           for m, n, c in ((2048, 32768, [(8, 1024, 4, 4 * NUM_SMS), (2, 1024, 4, 8 * NUM_SMS),
                                          (4, 2048, 8, 2 * NUM_SMS), (8, 2048, 8, 2 * NUM_SMS),
                                          (4, 512, 2, 8 * NUM_SMS)]),
                           (1024, 65536, [(8, 1024, 4, 4 * NUM_SMS), (4, 2048, 8, 2 * NUM_SMS)]))],
        # The fused add's forward + backward at 2048 wide, 0.97 of quack's fused add on the H200 (d8fcba3), where
        # rms_norm's alone leads quack by 1.24: its backward reads a third stream (d(residual_out)) through
        # RMSNorm's plan (one row a program, 8 warps, 4 programs per SM). More rows or programs in flight,
        # and the row kernel; 4096 wide as a control. (BLOCK_M, warps, per SM) and (BLOCK_N, SPLIT, warps, per SM).
        "add-bwd": [("fwd+bwd", (1 << 25) // w, w, "bfloat16",
                     [(f"tile {bm}x{w} {nw}w {ps}/SM", None, bwd_tile(bm, nw, ps)) for bm, nw, ps in
                      ((1, 8, 6), (1, 8, 8), (1, 4, 8), (2, 8, 4), (2, 16, 2))]
                     + [(f"row {b}x{k} {nw}w {ps}/SM", None, bwd_row(b, k, nw, ps))
                        for b, k, nw, ps in ((w, 1, 4, 4), (w, 1, 8, 2), (w, 1, 8, 4), (w // 2, 2, 4, 4))],
                     "add_rms_norm") for w in (2048, 4096)],
        # The fused add's backward (three row streams read) at the widths of one-row tiles and 3-block splits,
        # against RMSNorm's plan for two streams (1 x rows, 1 x programs): twice the rows a tile (the plan's
        # rule up to 3072 wide), 1.5 times the programs per SM, four times the rows; RMSNorm's backward alone
        # at 1024 and 2048 as a control (docs/benchmarks.md, entry 22).
        "add-bwd-widths": [("fwd+bwd", (1 << 25) // w, w, "bfloat16",
                            [(f"{r} x rows, {p} x programs", None, bwd_scaled(r, p))
                             for r, p in ((1, 1), (2, 1), (1, 1.5), (4, 1))],
                            "add_rms_norm") for w in (512, 1024, 1536, 2048, 2560, 3072)]
        + [("bwd", (1 << 26) // w, w, "bfloat16", [(f"{r} x rows, {p} x programs", None, bwd_scaled(r, p))
                                                   for r, p in ((2, 1), (1, 1.5))]) for w in (1024, 2048)],
        # The fused add's forward at 4096-7168 wide, 1-2 µs behind quack's and Liger's (H100 table, 4 row streams:
        # x, r, y, residual_out) through RMSNorm's forward plan: fewer elements per thread, and the row read
        # twice (x and r again from L2, added again) or held, in SPLIT blocks of 1024 or 2048.
        "add-fwd": [("fwd", (1 << 25) // w, w, "bfloat16",
                     [(f"row {nw}w {'reload' if r else 'held'}", fwd_row(nw, r), None) for nw, r in rows]
                     + [(f"{b}x{k} {nw}w {'reload' if r else 'held'}", fwd_split(b, k, nw, r), None)
                        for b, k, nw, r in splits], "add_rms_norm")
                    for w, rows, splits in (
                        (4096, ((4, False), (16, False), (8, True), (16, True)),
                         ((1024, 4, 4, False), (1024, 4, 8, False), (2048, 2, 8, False))),
                        (5120, (), ((1024, 5, 8, False), (1024, 5, 8, True), (1024, 5, 4, True), (1024, 5, 16, False))),
                        (7168, ((16, True), (32, False)),
                         ((1024, 7, 8, False), (1024, 7, 16, False), (1024, 7, 8, True), (1024, 7, 4, True))))],
        # The 4096 block's warps, RMSNorm's forward and the fused add's together (the fused add's y is
        # bitwise RMSNorm's of the sum, so both take one plan): 8 warps and the row read twice in the plan.
        "fwd-4096-warps": [("fwd", (1 << s) // 4096, 4096, "bfloat16",
                            [(f"row {nw}w {'reload' if r else 'held'}", fwd_row(nw, r), None)
                             for nw, r in ((16, True), (16, False), (32, True), (4, False))], op)
                           for s, op in ((26, "rms_norm"), (25, "add_rms_norm"), (24, "rms_norm"))],
        # The forward by rows at 2048-8192 wide: held rows at 4 and 8 warps, and the plan's warps reading the row
        # twice. Timed with one input set a case (before the sets rotated), below 2**25 elements the same
        # binary's two timings ("plan", "plan (again)") differed by up to 12 % (H100): no rule from those runs.
        "fwd-rows": [("fwd", m, w, "bfloat16", [(f"row {nw}w held", fwd_row(nw, False), None) for nw in (4, 8)]
                      + [(f"row {w // 512}w reload", fwd_row(w // 512, True), None)],
                      "rms_norm") for w, ms in ((4096, (1024, 2048, 4096, 8192, 32768)), (2048, (4096, 8192)),
                                                (8192, (2048, 4096))) for m in ms],
        # Does reading x twice at wider warps (8 elements per thread per block) gain at five
        # blocks generally, as at 5120 (1.3 % and 0.8 % in two probes)?
        "fwd-five": [("fwd", (1 << 26) // w, w, "bfloat16", [(f"{b}x5 {nw}w reload", fwd_split(b, 5, nw), None)
                                                             for nw in ws]) for w, b, ws in
                     ((2560, 512, (2, 4)), (5120, 1024, (4, 8)), (10240, 2048, (8, 16)), (20480, 4096, (16, 32)))],
    }


def summary(rows: list[dict]) -> str:
    """Markdown: per case the plan's µs (the faster of its two timings), the fastest candidate and its gain."""
    cases: dict = {}
    for r in rows:
        pass_ = r["pass"] if r.get("op", "rms_norm") == "rms_norm" else f"{r['op']} {r['pass']}"
        cases.setdefault((pass_, tuple(r["shape"]), r["dtype"]), []).append(r)
    out = ["| pass | shape | dtype | plan µs | fastest candidate | µs | plan / it |", "|---|---|---|---|---|---|---|"]
    for (pass_, shape, dtype), rs in cases.items():
        timed = [r for r in rs if "us" in r]
        plan = min((r["us"] for r in timed if r["candidate"].startswith("plan")), default=None)
        best = min((r for r in timed if not r["candidate"].startswith("plan")), key=lambda r: r["us"], default=None)
        if plan is None or best is None:
            continue
        out.append(f"| {pass_} | {shape[0]}×{shape[1]} | {dtype} | {plan:.1f} | {best['candidate']} | "
                   f"{best['us']:.1f} | {plan / best['us']:.3f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", default="narrow-bwd", choices=sorted(candidate_sets()))
    parser.add_argument("--out")
    args = parser.parse_args()
    import torch

    from benchmarks import timing

    device = "cuda" if torch.cuda.is_available() else "cpu"
    timing.set_smoke(device == "cpu")  # CPU: runs once, no timing is a measurement
    rows = [r for case in candidate_sets()[args.set] for r in time_case(*case[:5], device, op=case[5] if
                                                                          len(case) > 5 else "rms_norm")]
    print(summary(rows))
    if args.out:
        with open(os.path.join(args.out, f"plan-probe-{args.set}.json"), "w") as f:
            json.dump({"set": args.set, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
