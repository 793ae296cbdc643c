"""The benchmark's smoke run: every case, implementation and timed path of `python -m benchmarks.main` at
tiny sizes (on CPU through Triton's interpreter), so that a change that breaks the GPU benchmark fails
here first. Timings of a smoke run are not measurements; only that everything ran and checked is tested."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import DEVICE

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU: the benchmark itself runs there (`bash scripts/main.sh`, "
                    "or `python -m benchmarks.main --smoke` as a quick pre-flight), not inside the suite's time limit")
def test_benchmark_smoke_runs_every_path(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.main", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    (path,) = tmp_path.glob("*.json")
    results = json.loads(path.read_text())
    assert len(results["xkern_sha"]) == 12
    rows = results["rows"]
    for op in ("rms_norm", "permute_rows", "unpermute_rows"):
        for impl in ("xkern (torch)", "xkern (jax)"):
            mine = [r for r in rows if r["op"] == op and r["impl"] == impl]
            assert mine and all(r["check"] == "pass" and r["us"] for r in mine), (op, impl)
            assert all(r["check_s"] >= 0 and r["time_s"] > 0 for r in mine), (op, impl)  # what each row cost
    assert all(r["bitwise_equal_torch"] for r in rows if r["impl"] == "xkern (jax)")
    assert any(r.get("sweep") for r in rows)
    assert {r["op"] for r in results["host"] if "wall_us" in r} >= {
        "floor", "rms_norm", "permute_rows", "unpermute_rows", "inverse_permutation", "generate_permute_indices"}
    floors = {(r["op"], r["pass"]) for r in results["host"] if r["impl"].startswith("floor: its") and "wall_us" in r}
    assert floors == {("rms_norm", "fwd"), ("rms_norm", "fwd+bwd"), ("permute_rows", "fwd"), ("unpermute_rows", "fwd"),
                      ("inverse_permutation", "fwd"), ("generate_permute_indices", "fwd")}
    assert "its floor" in path.with_suffix(".md").read_text()
    assert sum("wall_us" in b for b in results["block"]) == 6  # eager and compile, three norms (graphs need CUDA)
    assert results["add_rms_norm"] == []  # its own run (`--only add_rms_norm`, test_add_rms_norm_table_runs_every_path)
    forms = {(r["framework"], r["form"]) for r in results["sharded"] if "device_us" in r}
    assert len(forms) == 7 and all(r["bitwise_equal_plain"] for r in results["sharded"] if "width" not in r["form"])
    md = path.with_suffix(".md").read_text()
    assert "Host cost per call" in md and "width sweep" in md and "1-device mesh" in md

    from benchmarks import report  # the sweep's parts merged, and README's summary quoting the sweep

    merged = tmp_path / "merged-sweep.json"
    report.merge(str(merged), [str(path), str(path)])
    summary = report.summary(results, json.loads(merged.read_text()), "results/x", None)
    assert "worst xkern / best peer" in summary and "worst JAX / torch" in summary


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU: run `python -m tools.block_profile` itself there")
def test_block_profile_runs(tmp_path):
    """The compiled block's host profile (`tools.block_profile`) on CPU: both norms' compiled steps run,
    and the report names them (a diagnostic for the GPU; its numbers here mean nothing)."""
    proc = subprocess.run([sys.executable, "-m", "tools.block_profile", "--out", str(tmp_path), "--steps", "2",
                           "--code", "--together"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (tmp_path / "block_profile.txt").read_text()
    assert "## compile, xkern norm" in text and "## compile, HF eager norm" in text and "inductor counters" in text
    assert "## compile, in turn: xkern" in text and "## compile, xkern norm, after both compiled" in text


@pytest.mark.parametrize("impl", ["xkern (jax)", "jax.jit (XLA)"])
def test_dependent_cotangent_step_computes_the_same(impl):
    """`runner.jax_loop(dependent=True)` (the benchmark's JAX fwd+bwd step) only orders the backward after y: one
    fwd+bwd step gives bitwise the same grads and next cotangent as the benchmark's step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import rms_norm as RN
    from benchmarks.runner import jax_loop

    keys = jax.random.split(jax.random.key(3), 3)
    x, cot = (jax.random.normal(k, (6, 64), jnp.bfloat16) for k in keys[:2])
    w = jax.random.normal(keys[2], (64,), jnp.bfloat16)
    fn = RN.jax_impls(None)[impl]
    outs = []
    for dependent in (False, True):
        step, consts, state = jax_loop(fn, "fwd+bwd", [([x, w], cot)], (), dependent=dependent)
        outs.append(jax.tree_util.tree_leaves(jax.jit(step)(consts, state)))
    assert len(outs[0]) == len(outs[1]) == 3  # dx, dw, the next cotangent (y)
    for a, b in zip(*outs):
        assert np.asarray(a).view(np.uint16).tolist() == np.asarray(b).view(np.uint16).tolist()
    assert not np.array_equal(np.asarray(outs[0][2], np.float32), np.asarray(cot, np.float32))


def test_kernels_empty_swaps_every_launch_and_restores():
    """The host table's fwd+bwd floor (`host._kernels_empty`): inside the call every xkern launch is the empty
    kernel (no kernel writes dx), after it the real launcher is back (the next call computes dx)."""
    from benchmarks import host
    from benchmarks import rms_norm as RN
    from torch_api._launch import _Launcher

    real = _Launcher.__call__
    x = torch.randn(3, 64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    w = torch.randn(64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    dy = torch.randn(3, 64, dtype=torch.bfloat16, device=DEVICE)
    launched = []

    def count(self, arrays, device):
        launched.append(self.plan.kernel.fn.__name__)
        return real(self, arrays, device)

    _Launcher.__call__ = count
    try:
        host._kernels_empty(lambda: torch.autograd.grad(RN.xkern_torch(x, w), (x, w), dy))()
        assert _Launcher.__call__ is count  # restored to what it was
    finally:
        _Launcher.__call__ = real
    assert launched and set(launched) == {"_empty_kernel"}, launched
    dx, _ = torch.autograd.grad(RN.xkern_torch(x, w), (x, w), dy)
    ref = torch.func.vjp(lambda a, b: RN.hf_rms_norm(a, b), x.float(), w.float())[1](dy.float())[0]
    assert torch.allclose(dx.float(), ref, rtol=0.05, atol=0.05)


@pytest.mark.slow  # the smoke run above covers the host tables; this, `--host` alone
@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU: run `python -m benchmarks.main --host` itself there")
def test_host_tables_alone(tmp_path):
    """`--host`: the host-cost and block tables only (a short device call after a call-path change)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.main", "--host", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    (path,) = tmp_path.glob("*-host-smoke.json")
    results = json.loads(path.read_text())
    assert results["mode"] == "host-smoke" and not results["rows"] and not results["sharded"]
    timed = {(r["op"], r["pass"], r["impl"]) for r in results["host"] if "wall_us" in r}
    assert ("rms_norm", "fwd+bwd", "floor: its launches empty (the whole call otherwise)") in timed
    assert ("rms_norm", "fwd+bwd", "xkern (torch)") in timed
    assert sum("wall_us" in b for b in results["block"]) == 6


def test_index_threshold_times_both_regimes():
    """`tools.index_threshold`: each index op in both regimes (one launch and two) at each slot count, the
    regimes' results equal bit for bit, the forced threshold restored afterwards."""
    from benchmarks import timing
    from tools import index_threshold
    from xkern import permute as XP

    saved = XP.ONE_LAUNCH_SLOTS
    timing.set_smoke(True)
    try:
        rows = index_threshold.measure([4], 16, DEVICE, log=lambda *_: None)
        assert index_threshold.launch_floor_us(DEVICE) > 0
    finally:
        timing.set_smoke(False)
    assert XP.ONE_LAUNCH_SLOTS == saved
    assert {(r["op"], r["regime"]) for r in rows} == {(op, regime) for op in (
        "unpermute_rows", "inverse_permutation", "generate_permute_indices") for regime in index_threshold.REGIMES}
    assert all(r["device_us"] > 0 and r["wall_us"] > 0 for r in rows)
    assert {(r["regime"], r["launches"]) for r in rows} == {("one launch", 1), ("one launch, 16-row searches", 1),
                                                           ("two launches", 2)}
    assert XP.SEARCH_ROWS == 64
    assert "| unpermute_rows |" in index_threshold.table(rows)


def test_host_grad_rows_time_the_device_on_their_own_calls(monkeypatch):
    """The host table's grad rows: device time on calls whose leaves and forward are made on the capture
    stream (`runner.torch_make_calls`; the timed loop's leaves made every capture fail on the GPU), computing
    what the timed call computes; and no device time where the capture fails."""
    from benchmarks import host, timing

    timing.set_smoke(True)
    try:
        entries = {(pass_, impl): call for _, pass_, impl, _, call in host._rms_entries(DEVICE)}
        call = entries[("bwd", "xkern (torch)")]
        dx, dw = call()
        (own,) = call.device_calls()
        own_dx, own_dw = own()
        assert own_dx is not dx and torch.equal(own_dx, dx) and torch.equal(own_dw, dw)
        made = []
        real = timing.torch_device_us
        monkeypatch.setattr(timing, "torch_device_us",
                            lambda make, **kw: real(lambda: made.append(1) or make(), **kw))
        assert host._device_time(call)["device_us"] > 0 and made  # the row's own calls were the ones timed
        floor = entries[("fwd+bwd", "floor: its launches empty (the whole call otherwise)")]
        assert len(floor.device_calls()) == 1  # its own calls too, kernels emptied as in the timed one
        fwd_bwd = entries[("fwd+bwd", "F.rms_norm")]
        def capture_fails(make, eager_fallback=True):  # as timing.torch_device_us where the capture fails
            make()
            if eager_fallback:
                return 123.0, "do_bench of eager calls (x)"
            raise RuntimeError("capture failed")

        monkeypatch.setattr(timing, "torch_device_us", capture_fails)
        got = host._device_time(fwd_bwd)
        assert "device_us" not in got and "capture failed" in got["timing"]
    finally:
        timing.set_smoke(False)


def test_sweep_widths_select_cases_and_name_the_output():
    """`--sweep --widths`: only the cases of those widths, written to a file named by them."""
    from benchmarks import main

    def args(widths):
        return main.argparse.Namespace(host=False, sweep=True, smoke=True, quick=False, only="rms_norm", part=None,
                                       widths=widths)

    _, everything = main.plan(args(None))
    _, picked = main.plan(args("96,4096"))
    _, none = main.plan(args("64"))
    assert everything and picked == everything and not none
    assert all(case.shape[-1] == 96 for _, case, _ in picked)
    assert main.output_stem("NVIDIA H200", args("4096,96")).startswith("nvidia-h200-sweep-w96-4096-")
    # results/<gpu kind>/: the device name without its memory size
    assert [main.gpu_kind(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe")] == [
        "nvidia-h100", "nvidia-h200", "nvidia-h100-pcie"]


def test_merge_replaces_rows_of_a_later_part(tmp_path):
    """`report.merge`: a later part's row of the same case and implementation replaces the earlier one (a
    `--widths` re-run after a plan change), is listed in `replaced`; other rows are kept or appended."""
    from benchmarks import report

    def row(impl, width, us):
        return {"op": "rms_norm", "pass": "bwd", "impl": impl, "shape": [8, width], "dtype": "bfloat16", "us": us}

    first = {"commit": "a", "rows": [row("xkern (torch)", 64, 2.0), row("quack", 64, 1.5)], "skipped": [],
             "parts": ["p1.json", "p2.json"]}
    later = {"commit": "b", "rows": [row("xkern (torch)", 64, 1.0), row("xkern (torch)", 32, 3.0)], "skipped": []}
    paths = [tmp_path / "sweep.json", tmp_path / "subset.json"]
    for path, res in zip(paths, (first, later), strict=True):
        path.write_text(json.dumps(res))
    report.merge(str(paths[0]), [str(p) for p in paths])
    merged = json.loads(paths[0].read_text())
    assert [(r["impl"], r["shape"][1], r["us"]) for r in merged["rows"]] == [
        ("xkern (torch)", 64, 1.0), ("quack", 64, 1.5), ("xkern (torch)", 32, 3.0)]
    assert merged["replaced"] == [{"case": "rms_norm/bwd/xkern (torch)/(8, 64)/bfloat16", "by": "subset.json",
                                   "commit": "b"}]
    assert merged["parts"] == ["p1.json", "p2.json", "subset.json"]


def test_plan_probe_times_candidates_and_restores_the_plan():
    """`tools.plan_probe`: the plan and each candidate run through the torch front end (the candidate's
    results close to the plan's), and the plan is back in place afterwards."""
    from benchmarks import timing
    from tools import plan_probe
    from xkern.rms_norm import recipes as XR

    timing.set_smoke(True)
    try:
        rows = plan_probe.time_case("bwd", 40, 64, "bfloat16", [("tile", None, plan_probe.bwd_tile(16, 1, 16)),
                                                                ("row", None, plan_probe.bwd_row(16, 4, 1, 2, False))],
                                    DEVICE, log=lambda *_: None)
        rows += plan_probe.time_case("fwd", 3, 256, "bfloat16", [("chunked", plan_probe.fwd_chunked(2, 64, 1), None),
                                                                 ("split", plan_probe.fwd_split(64, 4, 1), None)],
                                     DEVICE, log=lambda *_: None)
        rows += plan_probe.time_case("fwd", 9, 64, "bfloat16", [("tile", plan_probe.fwd_tile(4, 1), None)],
                                     DEVICE, log=lambda *_: None)
        rows += plan_probe.time_case("bwd", 5, 16500, "bfloat16", [("cols", None, plan_probe.bwd_cols(2, 4096, 4, 8))],
                                     DEVICE, log=lambda *_: None)
    finally:
        timing.set_smoke(False)
    assert [r["candidate"] for r in rows] == ["plan", "tile", "row", "plan (again)", "plan", "chunked", "split",
                                              "plan (again)", "plan", "tile", "plan (again)", "plan", "cols",
                                              "plan (again)"]
    assert all("error" not in r and r["us"] > 0 and r["max_abs_diff"] < 0.05 for r in rows), rows
    table = plan_probe.summary(rows).splitlines()
    assert len(table) == 6 and table[2].startswith("| bwd | 40×64 | bfloat16 |"), table
    assert XR.plan_rms_norm_bwd is plan_probe.PLAN_BWD and XR.plan_rms_norm_fwd is plan_probe.PLAN_FWD


def test_plan_probe_sets_build_their_launches():
    """Every candidate of every `plan_probe` set builds a launch at its case's shape (a set that fails only on
    the GPU machine costs a device call); the row-backward rules cover every width up to 6 x 4096 in blocks
    that leave at most 1/8 masked (a power of two otherwise) and at most 32 warps."""
    from tools import plan_probe

    for name, cases in plan_probe.candidate_sets().items():
        for _, m, n, _, candidates in cases:
            for label, fwd, bwd in candidates:
                launch = fwd(m, n, 1e-6) if fwd else bwd(m, n, 1e-6).bwd
                assert launch.grid[0] >= 1 and 1 <= launch.num_warps <= 32, (name, n, label)
    for n in range(512, 24577, 7):
        for rule in (plan_probe.bwd_row_rule(16, 16), plan_probe.bwd_row_rule(8, 32)):
            c = rule(1000, n, 1e-6).bwd.constexprs
            padded = c["BLOCK_N"] * c["SPLIT"]
            assert padded >= n and ((padded - n) * 8 <= padded or c["SPLIT"] == 1), (n, c)


def test_add_rms_norm_table_runs_every_path():
    """The fused add's table (`benchmarks.add_rms_norm`) at its smoke sizes: xkern checked against the oracle
    and JAX bit for bit torch, every implementation and pass run through once."""
    from benchmarks import timing
    from benchmarks.add_rms_norm import add_rms_norm_table, markdown

    timing.set_smoke(True)
    try:
        rows = add_rms_norm_table(DEVICE, 1000.0, lambda line: None)
    finally:
        timing.set_smoke(False)
    mine = [r for r in rows if r["impl"].startswith("xkern")]
    assert {r["impl"] for r in mine} == {"xkern (torch)", "xkern (jax)"} and len(mine) == 4
    assert all(r["check"] == "pass" and r["us"] for r in mine)
    assert all(r["bitwise_equal_torch"] for r in mine if r["impl"] == "xkern (jax)")
    ran = {r["impl"] for r in rows if r.get("us")}
    assert {"HF eager", "torch.compile", "torch.compile (xkern norm, fusion pass)", "jax.jit (XLA)"} <= ran
    assert "add_rms_norm" in markdown(rows)


def test_jax_block_checks_and_times_both_norms():
    """`benchmarks.jax_block` at its CPU size: xkern's block checked against the jnp block, both steps timed."""
    from benchmarks import jax_block, timing

    timing.set_smoke(True)
    try:
        rows = jax_block.jax_block_table(DEVICE, lambda line: None)
    finally:
        timing.set_smoke(False)
    assert [r["norm"] for r in rows] == list(jax_block.NORMS) * len(jax_block.SIZES[DEVICE])
    assert all(r["check"].startswith("outputs agree") and r["device_us"] > 0 for r in rows), rows
