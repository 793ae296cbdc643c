"""Gated RMSNorm's persistent schedules (`plan_gated_rms_norm_bwd(tile=)`: rows per tile, programs per SM, the
next tile loaded ahead or not, Triton's loop pipelining, dw summed over rows a tile or at the end; the forward's
persistent schedule): the FP64 oracle on NaN-filled outputs with several tiles per program and a partial last
tile, the same bits from every schedule of one tile shape (dw: of one summation order), and the plan's
head-width tile within sm_90's registers with every program resident."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import rand, same_bits, to_numpy, to_torch

from xkern import device
from xkern import reference as R
from xkern.gated_rms_norm import FAMILIES, plan_gated_rms_norm_bwd, plan_gated_rms_norm_fwd
from xkern.gated_rms_norm.plans import BwdTile
from xkern.testing import launch

EPS = 1e-6
# A GPU of 2 SMs: few programs, so that each takes several tiles (and the interpreter runs few instances)
TWO_SMS = dataclasses.replace(device.H100, num_sms=2)


def _backward(x, z, w, dy, group_size, family, tile):
    """dx, dz and dw of the plan's backward under `tile`, launched directly on NaN-filled outputs."""
    norm_before_gate, activation, rounding = FAMILIES[family]
    n_rows, n_cols = x.shape
    with device.target(TWO_SMS):
        plan = plan_gated_rms_norm_bwd(n_rows, n_cols, group_size, EPS, (), norm_before_gate, activation, rounding,
                                       tile=tile)
    xt, zt, wt, dyt = (to_torch(a) for a in (x, z, w, dy))
    dx, dz = torch.full_like(xt, float("nan")), torch.full_like(xt, float("nan"))
    partial = torch.full((plan.n_partials, n_cols), float("nan"), dtype=torch.float32, device=xt.device)
    dw = torch.full_like(wt, float("nan"))
    launch(plan.bwd, xt, zt, wt, dyt, dx, dz, partial, n_rows=n_rows, group_size=group_size, x_row_stride=n_cols,
           z_row_stride=n_cols, dy_row_stride=n_cols, dx_row_stride=n_cols)
    launch(plan.reduce, partial, dw, n_partials=plan.n_partials, n_cols=n_cols)
    return plan, to_numpy(dx), to_numpy(dz), to_numpy(dw)


# 4 programs over 10 tiles of 4 rows (the last of 1)
SCHEDULES = [BwdTile(4, 2, 2), BwdTile(4, 2, 2, prefetch=True), BwdTile(4, 2, 2, stages=3),
             BwdTile(4, 2, 2, dw_tile=True), BwdTile(4, 2, 2, prefetch=True, dw_tile=True),
             BwdTile(4, 2, 2, stages=2, dw_tile=True)]


@pytest.mark.parametrize("family,width,group_size", [("norm-llama-then-gate", 128, 128),
                                                     ("gate-then-group-norm", 256, 128)])
def test_schedules_against_oracle_and_each_other(family, width, group_size):
    rng = np.random.default_rng(zlib.crc32(repr((family, width)).encode()))
    x, z = rand(rng, (37, width), "bfloat16"), rand(rng, (37, width), "bfloat16", scale=2.0)
    w, dy = rand(rng, (width,), "bfloat16", scale=0.3, offset=1.0), rand(rng, (37, width), "bfloat16")
    norm_before_gate, activation, rounding = FAMILIES[family]
    ref_dx, ref_dz, ref_dw, dw_tol = R.gated_rms_norm_bwd(x, z, w, dy, EPS, group_size, norm_before_gate, activation,
                                                          rounding)
    first = {}
    for tile in SCHEDULES:
        plan, dx, dz, dw = _backward(x, z, w, dy, group_size, family, tile)
        assert plan.bwd.grid == (4 // (width // group_size), width // group_size)
        consts = plan.bwd.constexprs
        assert (consts["PREFETCH"], consts["STAGES"], consts["DW_TILE"]) == (tile.prefetch, tile.stages, tile.dw_tile)
        R.check(dx, ref_dx, "dx")
        R.check(dz, ref_dz, "dx")
        R.check(dw, ref_dw, "dw", dw_tol)
        # the schedule moves loads, not arithmetic: one tile shape and grid, one result (dw: one per order)
        seen = first.setdefault(tile.dw_tile, (dx, dz, dw))
        assert all(same_bits(a, b) for a, b in zip(seen, (dx, dz, dw))), tile
        assert same_bits(first[False][0], dx) and same_bits(first[False][1], dz), tile


@pytest.mark.parametrize("family", ["norm-llama-then-gate", "gate-then-fp32-group-norm"])
def test_persistent_forward(family):
    """The forward's persistent schedule (4 programs over 10 tiles, the next loaded ahead): the oracle, and the
    bits of a program a tile."""
    norm_before_gate, activation, rounding = FAMILIES[family]
    rng = np.random.default_rng(zlib.crc32(repr(("fwd", family)).encode()))
    x, z = rand(rng, (37, 128), "bfloat16"), rand(rng, (37, 128), "bfloat16", scale=2.0)
    w = rand(rng, (128,), "bfloat16", scale=0.3, offset=1.0)
    opts = dict(norm_before_gate=norm_before_gate, activation=activation, rounding=rounding)
    ys = []
    for tile in ((4, 2, 0), (4, 2, 2)):
        with device.target(TWO_SMS):
            plan = plan_gated_rms_norm_fwd(37, 128, 128, EPS, **opts, tile=tile)
        assert plan.grid == ((10, 1) if tile[2] == 0 else (4, 1)) and plan.constexprs["PERSISTENT"] == (tile[2] > 0)
        xt, zt, wt = (to_torch(a) for a in (x, z, w))
        y = torch.full_like(xt, float("nan"))
        launch(plan, xt, zt, wt, y, n_rows=37, group_size=128, x_row_stride=128, z_row_stride=128, y_row_stride=128)
        ys.append(to_numpy(y))
        R.check(ys[-1], R.gated_rms_norm_fwd(x, z, w, EPS, 128, **opts), "fwd",
                R.gated_rms_norm_fwd_tol(x, z, w, EPS, 128, **opts))
    assert same_bits(ys[0], ys[1])


def test_plan_takes_prefetching_tile_at_head_width():
    plan = plan_gated_rms_norm_bwd(262144, 128, 128, EPS)
    consts = plan.bwd.constexprs
    assert (consts["BLOCK_M"], plan.bwd.num_warps, consts["PREFETCH"], consts["DW_TILE"]) == (8, 4, True, True)
    assert plan.bwd.grid == (4 * device.properties().num_sms, 1)
    # other widths keep the tile without loads ahead; the forward, a program a tile
    assert not any(plan_gated_rms_norm_bwd(4096, 256, 256, EPS).bwd.constexprs[k] for k in ("PREFETCH", "DW_TILE"))
    assert not plan_gated_rms_norm_fwd(262144, 128, 128, EPS).constexprs["PERSISTENT"]


@pytest.mark.sm90_static
@pytest.mark.slow  # ~10 compiles
def test_head_width_tile_keeps_every_program_resident():
    """The plan's 128-wide backward for each family and x dtype, compiled for sm_90: within its registers and
    shared memory, all programs per SM of the persistent grid fit an SM at once (a second wave would take
    about twice as long)."""
    code = """
import re
import triton
from xkern import compile_check, device
from xkern.gated_rms_norm import FAMILIES, plan_gated_rms_norm_bwd, plan_gated_rms_norm_fwd
from xkern.gated_rms_norm.plans import bwd_tile
from xkern.launch import POINTER_TYPES
per_sm = bwd_tile(128)[2]
for dtype in ("bfloat16", "float32"):
    for family, (before, act, rounding) in FAMILIES.items():
        for activation in sorted({act, "sigmoid"}):
            plan = plan_gated_rms_norm_bwd(100000, 128, 128, 1e-6, (), before, activation, rounding).bwd
            ptr = POINTER_TYPES[dtype]
            ptrs = {"X": ptr, "Z": ptr, "W": ptr, "DY": ptr, "DX": ptr, "DZ": ptr, "DW_PARTIAL": "*fp32"}
            compiled = triton.compile(compile_check.source(plan, ptrs), target=compile_check.TARGET,
                                      options={"num_warps": plan.num_warps, "num_stages": plan.num_stages})
            listing = compile_check.cuobjdump(compiled, "-res-usage")
            assert not compile_check.limits_exceeded(compiled, listing, plan.num_warps, device.H100)
            regs = int(re.search(r"REG:(\\d+)", listing).group(1))
            per_warp = -(-regs * 32 // 256) * 256
            assert per_warp * plan.num_warps * per_sm <= 64 * 1024, (dtype, family, activation, regs)
            assert compiled.metadata.shared * per_sm <= 228 * 1024, (dtype, family, compiled.metadata.shared)
            print(dtype, family, activation, regs)
print("resident")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env={**env, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "resident" in run.stdout, run.stdout + run.stderr[-3000:]


@pytest.mark.slow
def test_benchmark_sweep_smoke(tmp_path):
    """`benchmarks.gated_rms_norm --sweep` at its smoke size: the candidates it runs pass the oracle, the rules'
    schedules among them; the JSON is written."""
    import json

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, "-m", "benchmarks.gated_rms_norm", "--sweep", "--smoke", "--out",
                          str(tmp_path)], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (path,) = tmp_path.glob("*-gated_rms_norm-sweep-smoke.json")
    rows = json.loads(path.read_text())["results"]
    assert rows and all(r["check"] == "pass" and r["status"] == "ok" for r in rows)
    assert {r["pass"] for r in rows if r["default"]} == {"fwd", "bwd"}
