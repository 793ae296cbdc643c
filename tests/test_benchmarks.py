"""The benchmark's smoke run: every case, implementation and timed path of `python -m benchmarks.main` at
tiny sizes (on CPU through Triton's interpreter), so that a change that breaks the GPU benchmark fails
here first. Timings of a smoke run are not measurements; only that everything ran and checked is tested."""

from __future__ import annotations

import argparse
import dataclasses
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
    # Printed: what was validated and the verdict, no tables of CPU "timings" (the files keep the tables)
    summary = proc.stdout[proc.stdout.index("## Validation on cpu"):]
    assert "rms_norm: xkern against the FP64 oracle" in summary and summary.rstrip().endswith("validation: pass")
    assert "copy ceiling" not in proc.stdout.lower() and "| xkern" not in proc.stdout and "µs" not in proc.stdout
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

    from benchmarks import readme, report  # the sweep's parts merged; README's section from the result sets

    merged = tmp_path / f"{path.stem}-sweep.json"
    report.merge(str(merged), [str(path), str(path)])
    section = readme.section(str(path), str(tmp_path))
    assert "slowest against the best peer" in section and "slowest JAX against torch" in section
    assert f"[data]({path.stem}.json)" in section and results["gpu"] in section


def test_main_counts_the_ptxas_routers_calls(tmp_path):
    """The main job's JSON counts what jax_api's ptxas router logged (XKERN_PTXAS_LOG) by assembler and PTX ISA
    version: whether JAX's kernels were assembled as torch's in that process; no log, no counts."""
    from benchmarks.main import ptxas_calls

    log = tmp_path / "ptxas.log"
    assert ptxas_calls(str(log)) == {}
    log.write_text("triton 88\njaxlib 90\ntriton 88\njaxlib \n")
    assert ptxas_calls(str(log)) == {"triton 88": 2, "jaxlib 90": 1, "jaxlib ": 1}


def test_readme_jax_column_times_both_front_ends_one_way(tmp_path):
    """README's "slowest JAX against torch" is torch's profiler time over JAX's where both rows have one (the
    torch row's own time is a CUDA graph's, another method), else the two rows' fractions of the ceiling."""
    from benchmarks import readme

    row = {"op": "rms_norm", "pass": "bwd", "dtype": "bfloat16", "shape": [32768, 128], "status": "ok"}
    rows = [{**row, "impl": "xkern (torch)", "frac": 0.5, "us": 14.6, "profile_us": 15.3},
            {**row, "impl": "xkern (jax)", "frac": 0.5 * 14.6 / 15.9, "us": 15.9, "profile_us": 15.9},
            {**row, "impl": "quack", "frac": 0.4, "us": 18.0}]
    results = {"gpu": "G", "date": "d", "commit": "c", "ceiling": {"gbps": 3000.0}, "rows": rows}
    (tmp_path / "g.json").write_text(json.dumps(results))
    text = readme.section(str(tmp_path / "g.json"), str(tmp_path))
    assert "| 0.96 at 32768×128 |" in text and "not the one profiler method" not in text  # 15.3 / 15.9
    for r in rows:
        r.pop("profile_us", None)
    (tmp_path / "g.json").write_text(json.dumps(results))
    text = readme.section(str(tmp_path / "g.json"), str(tmp_path))
    assert "| 0.92 at 32768×128 |" in text and "not the one profiler method" in text  # 14.6 / 15.9


def test_best_peer_is_timed_as_xkern_is():
    """The best peer's ratio compares like with like: a JAX peer's profiler time with xkern's profiler time, a
    torch peer's CUDA-graph time with xkern's (through their fractions of the ceiling); the fastest wins."""
    from benchmarks.ratios import ratios

    row = {"op": "rms_norm", "pass": "fwd", "dtype": "bfloat16", "shape": [262144, 64], "status": "ok"}
    xk = {**row, "impl": "xkern (torch)", "frac": 0.60, "us": 25.3, "profile_us": 24.1}
    xla = {**row, "impl": "jax.jit (XLA)", "frac": 0.60 * 25.3 / 23.9, "us": 23.9, "profile_us": 23.9}
    tc = {**row, "impl": "torch.compile", "frac": 0.60 * 25.3 / 25.2, "us": 25.2}
    (r,) = ratios([xk, xla, tc])
    assert r["best_peer"] == "jax.jit (XLA)" and abs(r["ratio"] - 23.9 / 24.1) < 1e-12  # not 23.9 / 25.3
    (r,) = ratios([xk, {**xla, "profile_us": 24.5, "us": 24.5}, tc])
    assert r["best_peer"] == "torch.compile" and abs(r["ratio"] - 25.2 / 25.3) < 1e-12
    (r,) = ratios([xk, {**tc, "impl": "previous (vstack + index)"}])  # an older set's label, renamed
    assert r["best_peer"] == "torchtitan (vstack + index)"


def test_readme_section_summarises_the_side_results(tmp_path):
    """A GPU kind's README section sums up the JAX/torch profile and the MoE steps beside the main set, from the
    JSON each wrote: ratios computed from the rows, a row failing its FP32 check left out."""
    from benchmarks import readme

    results = {"gpu": "G", "date": "d", "commit": "c", "ceiling": {"gbps": 3000.0}, "rows": []}
    (tmp_path / "g.json").write_text(json.dumps(results))
    from tools import jax_torch_profile

    prof = [{"op": "rms_norm", "shape": [8, 128], "pass": p, "impl": i, "device_us": us}
            for p, i, us in (("fwd", "xkern (torch)", 10.0), ("fwd", "xkern (jax)", 12.5),
                             ("bwd", "xkern (torch)", 9.0), ("bwd", "xkern (jax)", 9.0))]
    (tmp_path / "g-jax-torch-profile.json").write_text(json.dumps({"commit": "abcdef123", "rows": prof,
                                                                   "pairs": jax_torch_profile.pairs(prof)}))
    base = {"framework": "torch", "status": "ok", "ref_check": "pass", "size": "s", "tokens": 64, "part": "layer"}
    moe = [{**base, "impl": "xkern", "us": 3000.0, "peak_mib": 10.0}, {**base, "impl": "liger", "us": 4000.0,
           "peak_mib": 12.0}, {**base, "impl": "bad", "us": 1.0, "peak_mib": 1.0, "ref_check": "fail: out"}]
    (tmp_path / "g-moe-layer-s.json").write_text(json.dumps({"commit": "torch12345", "rows": moe}))
    jbase = {**base, "framework": "jax"}
    jmoe = [{**jbase, "impl": "xkern", "us": 6000.0, "peak_mib": 20.0, "vs_torch_xkern": 2.0},
            {**jbase, "impl": "maxtext", "us": 5000.0, "peak_mib": 15.0},
            {**jbase, "part": "dispatch+combine", "impl": "xkern", "us": 1.0, "peak_mib": 1.0}]  # no peer: left out
    (tmp_path / "g-jax-moe-layer-s.json").write_text(json.dumps({"rows": jmoe, "commit": "jax1234567",
                                                                  "experts_gemm": "tiled",
                                                                  "experts_gemm_name": "tiles of dense GEMMs"}))
    text = readme.section(str(tmp_path / "g.json"), str(tmp_path))
    assert "torch / JAX 0.80–1.00 (slowest: rms_norm 8×128 fwd" in text and "at abcdef1" in text
    assert "| torch | s (T=64) | layer | 3.00 | Liger fused MoE 4.00 | 0.75 | 10 / 12 | torch12 |  |" in text
    assert "| jax | s (T=64) | layer | 6.00 | MaxText-style 5.00 | 1.20 | 20 / 15 | jax1234 | 2.00 |" in text
    assert "bad" not in text and "dispatch+combine" not in text and "tiles of dense GEMMs" in text
    assert "[JAX MoE layer, s](g-jax-moe-layer-s.md)" not in text  # links only the tables that exist
    hf = [{"path": p, "status": "ok", "layers": 2, "tokens": 64, "step_ms": ms, "peak_mib": 9.0}
          for p, ms in (("xkern", 30.0), ("grouped_mm", 40.0))]
    (tmp_path / "g-hf-moe-step.json").write_text(json.dumps({"commit": "hf12345678", "rows": hf}))
    assert ("| torch | Hugging Face Qwen3-MoE (2 layers, T=64) | training step (AdamW) | 30.00 | transformers' "
            "grouped_mm 40.00 | 0.75 | 9 / 9 | hf12345 |  |") in readme.section(str(tmp_path / "g.json"), str(tmp_path))
    (tmp_path / "g-hf-moe-step.json").unlink()
    (tmp_path / "g-jax-moe-layer-s.md").write_text("table")
    assert "[JAX MoE layer, s](g-jax-moe-layer-s.md)" in readme.section(str(tmp_path / "g.json"), str(tmp_path))
    # a later run of the host table alone (`--host`) takes the place of the set's own host rows, its commit named
    host = [{"op": "rms_norm", "pass": "fwd", "impl": i, "wall_us": us, "shape": "x 16×4096 bf16"}
            for i, us in (("xkern (torch)", 10.4), ("F.rms_norm", 10.0))]
    (tmp_path / "g.json").write_text(json.dumps({**results, "host": [{**h, "wall_us": 99.0} for h in host]}))
    assert "| rms_norm forward | 16×4096 bf16 | 99.0 | 99.0 | 1.00 |" in readme.section(str(tmp_path / "g.json"),
                                                                                       str(tmp_path))
    (tmp_path / "g-host.json").write_text(json.dumps({"commit": "later12", "host": host}))
    text = readme.section(str(tmp_path / "g.json"), str(tmp_path))
    assert "| rms_norm forward | 16×4096 bf16 | 10.4 | 10.0 | 1.04 |" in text and "its own run, commit later12" in text


def test_readme_section_states_the_fused_add_and_the_extra_widths(tmp_path):
    """The fused add's table and the sweep's extra widths (`--sweep --widths`) are summed up from their JSON: the
    best peer's time over xkern's per pass, the lowest named, xkern's own kernel under torch.compile's fusion pass
    not counted as a peer; a set without them says nothing of them."""
    from benchmarks import readme

    results = {"gpu": "G", "date": "d", "commit": "c", "ceiling": {"gbps": 3000.0}, "rows": []}
    (tmp_path / "g.json").write_text(json.dumps(results))
    assert "Fused residual add" not in readme.section(str(tmp_path / "g.json"), str(tmp_path))

    def rows(op, shape, pass_, times):
        base = {"op": op, "pass": pass_, "dtype": "bfloat16", "shape": shape, "status": "ok"}
        return [{**base, "impl": i, "us": us, "frac": 1.0 / us} for i, us in times.items()]

    add = rows("add_rms_norm", [8192, 4096], "fwd", {"xkern (torch)": 100.0, "quack": 98.0,
                                                     "torch.compile (xkern norm, fusion pass)": 90.0})
    add += rows("add_rms_norm", [8192, 4096], "fwd+bwd", {"xkern (torch)": 200.0, "quack": 206.0})
    add += rows("add_rms_norm", [16384, 2048], "fwd+bwd", {"xkern (torch)": 200.0, "Liger": 210.0})
    (tmp_path / "g-add_rms_norm.json").write_text(json.dumps({"commit": "abcdef123", "add_rms_norm": add}))
    sweep = rows("rms_norm", [116508, 576], "bwd", {"xkern (torch)": 150.0, "quack": 162.0, "Liger": 300.0})
    (tmp_path / "g-sweep-w576-rms_norm.json").write_text(json.dumps({"commit": "fedcba987", "rows": sweep}))
    text = readme.section(str(tmp_path / "g.json"), str(tmp_path))
    assert ("Fused residual add + RMSNorm ([its table](g-add_rms_norm.md), commit abcdef1; bfloat16, 2 widths from "
            "2048 to 4096): forward + backward") in text
    assert "the best peer's time over xkern's 1.03–1.05 (lowest at 8192×4096, quack)" in text
    assert ("forward 0.01–0.01 of the ceiling, the best peer's time over xkern's 0.98–0.98 (lowest at 8192×4096, "
            "quack)") in text
    assert ("116508×576 bfloat16: backward alone 1.08 (quack) ([rows](g-sweep-w576-rms_norm.md), commit fedcba9)"
            in text)


def test_readme_body_one_legend_and_torch_only_moe(tmp_path):
    """README's section over two GPU kinds: one peers legend after both (each kind's best peers named once);
    a kind whose MoE steps ran in torch alone has no JAX words or column in its MoE table."""
    from benchmarks import readme

    row = {"op": "rms_norm", "pass": "fwd", "dtype": "bfloat16", "shape": [64, 128], "status": "ok"}
    for kind, peer in (("gpu-a", "quack"), ("gpu-b", "Liger")):
        (tmp_path / kind).mkdir()
        rows = [{**row, "impl": "xkern (torch)", "frac": 0.8, "us": 10.0},
                {**row, "impl": peer, "frac": 0.7, "us": 11.4}]
        (tmp_path / kind / f"{kind}.json").write_text(json.dumps(
            {"gpu": kind.upper(), "date": "d", "commit": "c", "ceiling": {"gbps": 3000.0}, "rows": rows}))
    base = {"framework": "torch", "status": "ok", "ref_check": "pass", "size": "s", "tokens": 64, "part": "layer"}
    moe = [{**base, "impl": "xkern", "us": 3000.0, "peak_mib": 10.0}, {**base, "impl": "liger", "us": 4000.0,
           "peak_mib": 12.0}]
    (tmp_path / "gpu-b" / "gpu-b-moe-layer-s.json").write_text(json.dumps({"commit": "0123456789", "rows": moe}))
    text = readme.body(str(tmp_path), str(tmp_path))
    legends = [line for line in text.splitlines() if line.startswith("Peers: ")]
    assert len(legends) == 1 and "Liger: " in legends[0] and "quack: " in legends[0]
    assert text.index(legends[0]) > text.index("### GPU-B")
    assert "| torch | s (T=64) | layer | 3.00 | Liger fused MoE 4.00 | 0.75 | 10 / 12 | 0123456 |\n" in text
    assert "JAX" not in text.split("MoE layer step", 1)[1].split("|", 1)[0]  # the table's caption
    assert "| front end | size | part | xkern | peers | xkern / fastest | peak MiB | commit |\n" in text


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
    """`--host`: the host-cost and block tables only (a short GPU run after a call-path change)."""
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
    for op, pass_, peer in (("add_rms_norm", "fwd+bwd", "F.rms_norm"), ("add_rms_norm", "fwd", "HF eager"),
                            ("permute_rows(top_k)", "fwd", "torchtitan"),
                            ("unpermute_rows(top_k, probs)", "fwd", "torchtitan")):
        assert {(op, pass_, "xkern (torch)"), (op, pass_, peer)} <= timed, (op, pass_, peer)
    assert sum("wall_us" in b for b in results["block"]) == 6


def test_index_threshold_times_both_regimes():
    """`tools.index_threshold`: each index op in both regimes (one launch and two) at each slot count, the
    regimes' results equal bit for bit, the forced threshold restored afterwards."""
    from benchmarks import timing
    from tools import index_threshold
    from xkern.permute import plans as permute_plans

    saved = permute_plans.ONE_LAUNCH_SLOTS
    timing.set_smoke(True)
    try:
        rows = index_threshold.measure([4], 16, DEVICE, log=lambda *_: None)
        assert index_threshold.launch_floor_us(DEVICE) > 0
    finally:
        timing.set_smoke(False)
    assert permute_plans.ONE_LAUNCH_SLOTS == saved
    assert {(r["op"], r["regime"]) for r in rows} == {(op, regime) for op in (
        "unpermute_rows", "inverse_permutation", "generate_permute_indices") for regime in index_threshold.REGIMES}
    assert all(r["device_us"] > 0 and r["wall_us"] > 0 for r in rows)
    assert {(r["regime"], r["launches"]) for r in rows} == {("one launch", 1), ("one launch, 16-row searches", 1),
                                                           ("two launches", 2)}
    assert permute_plans.SEARCH_ROWS == 64
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
    from benchmarks.machine import gpu_kind

    assert [gpu_kind(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe")] == [
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
    from xkern import add_rms_norm as XA
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
        # the column split as a candidate where the plan takes a tile (narrow: the interpreter's time grows
        # with the width, 41 s at 16500)
        rows += plan_probe.time_case("bwd", 3, 1100, "bfloat16", [("cols", None, plan_probe.bwd_cols(2, 512, 4, 8))],
                                     DEVICE, log=lambda *_: None)
        add = plan_probe.time_case("fwd+bwd", 6, 64, "bfloat16", [("tile", None, plan_probe.bwd_tile(4, 1, 2)),
                                                                  ("row", None, plan_probe.bwd_row(32, 2, 1, 2))],
                                   DEVICE, log=lambda *_: None, op="add_rms_norm")
    finally:
        timing.set_smoke(False)
    assert [r["candidate"] for r in rows] == ["plan", "tile", "row", "plan (again)", "plan", "chunked", "split",
                                              "plan (again)", "plan", "tile", "plan (again)", "plan", "cols",
                                              "plan (again)"]
    assert all("error" not in r and r["us"] > 0 and r["max_abs_diff"] < 0.05 for r in rows), rows
    table = plan_probe.summary(rows).splitlines()
    assert len(table) == 6 and table[2].startswith("| bwd | 40×64 | bfloat16 |"), table
    assert XR.plan_rms_norm_bwd is plan_probe.PLAN_BWD and XR.plan_rms_norm_fwd is plan_probe.PLAN_FWD
    # the fused add through the candidates: its y, residual_out's and x's gradients, w's: the plan's within bf16
    assert [r["candidate"] for r in add] == ["plan", "tile", "row", "plan (again)"]
    assert all("error" not in r and r["us"] > 0 and r["max_abs_diff"] < 0.05 for r in add), add
    assert plan_probe.summary(add).splitlines()[2].startswith("| add_rms_norm fwd+bwd | 6×64 | bfloat16 |")
    assert XA.plan_rms_norm_bwd is plan_probe.PLAN_BWD and XA.plan_rms_norm_fwd is plan_probe.PLAN_FWD
    from xkern.rms_norm.kernels import FUSED, _rms_norm_bwd_row_kernel

    def kernels():
        recipe = XA.add_rms_norm_bwd_recipe(6, 64, 1e-6, "bfloat16", "bfloat16", "bfloat16", True)
        return [step.launch.kernel for step in recipe.steps if step.launch]

    plan_probe._use(bwd=plan_probe.bwd_row(32, 2, 1, 2))  # the fused add's recipe takes the candidate
    try:
        assert FUSED[_rms_norm_bwd_row_kernel] in kernels()
    finally:
        plan_probe._use()
    assert FUSED[_rms_norm_bwd_row_kernel] not in kernels()


def test_plan_probe_sets_build_their_launches():
    """Every candidate of every `plan_probe` set builds a launch at its case's shape (a set that fails only on
    the GPU machine costs a GPU run); the row-backward rules cover every width up to 6 x 4096 in blocks
    that leave at most 1/8 masked (a power of two otherwise) and at most 32 warps."""
    from tools import plan_probe

    for name, cases in plan_probe.candidate_sets().items():
        for _, m, n, _, candidates, *_ in cases:
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


def test_profile_rounds_sum_the_activities_after_each_flush():
    """`timing.profile_device_us`'s arithmetic: a chrome trace's device activities split at the flush kernel,
    the median round over the calls, each kernel's count and µs per call; a round without activity raises."""
    from benchmarks import timing

    def ev(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [ev("before", 0, 9), ev(timing.FLUSH_KERNEL, 1, 50), ev("a", 60, 4), ev("b", 70, 2),
                             ev("fill", 75, 1, "gpu_memset"), ev("cpu op", 80, 5, "cpu_op"),
                             ev(timing.FLUSH_KERNEL, 100, 50), ev("a", 160, 6), ev("b", 170, 2),
                             ev(timing.FLUSH_KERNEL, 200, 50), ev("a", 260, 8), ev("b", 270, 4)]}
    rounds = timing.rounds_after_flush(timing.device_activities(trace))
    assert [[e["name"] for e in r] for r in rounds] == [["a", "b", "fill"], ["a", "b"], ["a", "b"]]
    us, kernels = timing.per_call(rounds, 2)
    assert us == 8 / 2  # round sums 7, 8, 12: the median over two calls
    assert [(k["name"], k["count"], k["us"]) for k in kernels] == [("a", 0.5, 3.0), ("b", 0.5, 4 / 3),
                                                                    ("fill", 1 / 6, 1 / 6)]
    with pytest.raises(RuntimeError, match="no device activity"):
        timing.per_call([[], rounds[0]], 1)


def test_jax_calls_are_one_program_per_input_set():
    """`runner.jax_calls` (every JAX row's timed calls): each call computes its own input set's outputs, all of
    them returned, as the plain vjp does (the XLA peer: XLA alone, no interpreter)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import rms_norm as RN
    from benchmarks.runner import jax_calls

    keys = jax.random.split(jax.random.key(5), 5)
    w = jax.random.normal(keys[0], (64,), jnp.bfloat16)
    sets = [([jax.random.normal(k, (6, 64), jnp.bfloat16), w], jax.random.normal(c, (6, 64), jnp.bfloat16))
            for k, c in ((keys[1], keys[2]), (keys[3], keys[4]))]
    fn = RN.jax_impls(None)["jax.jit (XLA)"]
    for pass_ in ("fwd", "bwd", "fwd+bwd"):
        calls = jax_calls(fn, pass_, sets, ())
        assert len(calls) == 2
        for call, (args, cot) in zip(calls, sets):
            y, vjp = jax.vjp(fn, *args)
            want = {"fwd": y, "bwd": vjp(cot), "fwd+bwd": (y, vjp(cot))}[pass_]
            got, want = jax.tree_util.tree_leaves(call()), jax.tree_util.tree_leaves(want)
            assert len(got) == len(want)
            for a, b in zip(got, want):
                # Compiled as one program, XLA fuses and reorders the reductions the eager vjp runs op by op: dw's
                # sums of bf16 products differ by a few ulps where terms cancel (7 ulps at one of 64 on an H100).
                # Another input set's outputs differ at the scale of the outputs themselves.
                b = np.asarray(b, np.float32)
                np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0, atol=0.03 * np.abs(b).max())


def test_jax_torch_table_compares_profile_times():
    """The report's JAX / torch table: xkern's two front ends by `profile_us`, torch µs / JAX µs, and whether
    they launched the same kernels; `ratios` takes the same ratio."""
    from benchmarks import report
    from benchmarks.ratios import ratios

    def row(impl, us, names):
        return {"op": "rms_norm", "pass": "fwd", "dtype": "bfloat16", "shape": [8, 128], "impl": impl, "frac": 0.5,
                "profile_us": us, "kernels": [{"name": n} for n in names]}

    rows = [row("xkern (torch)", 9.0, ["k"]), row("xkern (jax)", 10.0, ["k"]), row("HF eager", 20.0, ["x", "y"])]
    (jt,) = report.jax_torch(rows)
    assert (jt["torch_us"], jt["jax_us"], jt["ratio"], jt["same_kernels"]) == (9.0, 10.0, 0.9, True)
    assert ratios(rows)[0]["jax_ratio"] == 0.9
    assert "torch / JAX" in "\n".join(report.jax_torch_table(rows))


def test_jax_torch_profile_runs_a_case():
    """`tools.jax_torch_profile` on one smoke pass: both front ends and XLA run by every method it prints."""
    from benchmarks import timing
    from tools import jax_torch_profile as JT

    timing.set_smoke(True)
    try:
        rows = JT.profile_case("rms_norm", (9, 128), ("fwd",), DEVICE)
    finally:
        timing.set_smoke(False)
    assert [r["impl"] for r in rows] == ["xkern (torch)", "xkern (jax)", "jax.jit (XLA)"]
    assert all("status" not in r and r["device_us"] > 0 and r["host_launch_us"] > 0 for r in rows), rows
    assert "rms_norm 9x128 fwd: torch" in JT.text(rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU: `python -m benchmarks.moe_layer` itself runs there")
def test_moe_layer_rows_check_every_path(tmp_path):
    """`benchmarks.moe_layer` at its smoke size: every torch path that runs here is checked against the FP32
    reference and passes, xkern's is the same bits run to run, Liger's row says why it is skipped on CPU (and
    that it has no dispatch + combine alone), and the JSON carries the rows the JAX benchmark reads."""
    from benchmarks import moe_layer, timing

    timing.set_smoke(True)
    try:
        assert moe_layer.main(["--smoke", "--out", str(tmp_path)]) == 0
    finally:
        timing.set_smoke(False)
    results = json.loads((tmp_path / "cpu-moe-layer.json").read_text())
    rows = results["rows"]
    assert results["complete"]  # saved after each row too, marked incomplete until the end
    ran = {(r["impl"], r["part"]) for r in rows if r["status"] == "ok"}
    assert ran == {(p, part) for p in ("xkern", "torchtitan", "plain") for part in ("layer", "dispatch+combine")}
    assert all(r["ref_check"] == "pass" and set(r["ref_rel_l2"]) == set(moe_layer.RESULT_NAMES[r["part"] == "layer"])
               for r in rows if r["status"] == "ok"), rows
    assert all(r["bitwise_run_to_run"] for r in rows if r["impl"] == "xkern")
    liger = {r["part"]: r["status"] for r in rows if r["impl"] == "liger"}
    assert liger["layer"].startswith("skipped: Liger") and liger["dispatch+combine"].startswith("n/a")
    assert "| liger |" in (tmp_path / "cpu-moe-layer.md").read_text()
    # a run of one path and part updates that row in place and keeps the others
    timing.set_smoke(True)
    try:
        assert moe_layer.main(["--smoke", "--out", str(tmp_path), "--parts", "dispatch+combine",
                               "--paths", "xkern"]) == 0
    finally:
        timing.set_smoke(False)
    again = json.loads((tmp_path / "cpu-moe-layer.json").read_text())
    assert [(r["impl"], r["part"]) for r in again["rows"]] == [(r["impl"], r["part"]) for r in rows]
    new = [(old, r) for old, r in zip(rows, again["rows"], strict=True) if old != r]
    assert all((r["impl"], r["part"]) == ("xkern", "dispatch+combine") for _, r in new), new  # the others kept
    assert [run["paths"] for run in again["runs"]] == [list(moe_layer.PATHS), ["xkern"]]


def test_mgpu_blocks_argument():
    """`--mgpu-blocks` takes MGPU_BLOCK's keys with positive ints, for every form or one, and names what it
    expected otherwise."""
    from benchmarks import jax_moe_layer as J

    assert J.mgpu_blocks("block_n=256,dw.grid_block_n=2,dx.block_k=128") == {
        "forward": {"block_n": 256}, "dx": {"block_n": 256, "block_k": 128}, "dw": {"block_n": 256, "grid_block_n": 2}}
    assert J.mgpu_blocks("") == {"forward": {}, "dx": {}, "dw": {}}
    for bad in ("block_x=1", "block_n=0", "block_n=big", "block_n", "up.block_n=64", "dw.=4"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected \[FORM.\]KEY=N"):
            J.mgpu_blocks(bad)


def test_moe_reference_check_fails_a_wrong_result():
    """The FP32 reference of both MoE benchmarks tells a wrong gradient or output from a right one: one expert's
    weight gradient zeroed, or one output row swapped, fails the check."""
    import jax.numpy as jnp

    from benchmarks import jax_moe_layer, moe_layer

    size = moe_layer.SMOKE_SIZE
    inp = moe_layer.torch_inputs(size, DEVICE)
    got = list(moe_layer.torch_step(moe_layer.plain_path, inp, size["top_k"], size["experts"], whole=True))
    assert moe_layer.ref_check(moe_layer.reference_errors(inp, size["top_k"], got, True)) == "pass"
    got[3] = got[3].clone()
    got[3][1] = 0
    assert moe_layer.ref_check(moe_layer.reference_errors(inp, size["top_k"], got, True)).startswith("fail: dw13")

    jinp = jax_moe_layer.inputs(size)
    step = jax_moe_layer.dc_step("maxtext", size["top_k"], size["experts"])
    jgot = list(step(jinp["w_router"], jinp["x"], jinp["dout"]))
    assert moe_layer.ref_check(jax_moe_layer.reference_errors(jinp, size["top_k"], jgot, False)) == "pass"
    jgot[0] = jgot[0][jnp.array([1, 0, *range(2, size["tokens"])])]
    assert moe_layer.ref_check(jax_moe_layer.reference_errors(jinp, size["top_k"], jgot, False)).startswith("fail: out")


def test_moe_experts_gemm_gradients_and_release(monkeypatch):
    """The experts' grouped GEMM node of the MoE benchmark: its gradients are autograd's through the same
    blocks (both weights in their transposed layout, so no copy at accumulation; padding rows past the last
    offset get no weight gradient), and it lets its input go before making d(input): the step's peak."""
    import weakref

    from benchmarks import moe_layer

    g = torch.Generator().manual_seed(3)
    offs = torch.tensor([3, 3, 9, 14], dtype=torch.int32)  # an empty expert; rows 14-15 are padding
    a = torch.randn(16, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)  # [E, N, K]: used as w.T
    dy = torch.randn(16, 6, generator=g, dtype=torch.float64)

    def blocks(a, w):
        outs, start = [], 0
        for e, end in enumerate(offs.tolist()):
            outs.append(a[start:end] @ w[e].t())
            start = end
        return torch.cat(outs + [a.new_zeros(16 - start, 6)])

    want = torch.autograd.grad(blocks(a, w), (a, w), dy)
    got = torch.autograd.grad(moe_layer._grouped_linear()(a, w.transpose(-2, -1), offs), (a, w), dy)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    assert got[1].is_contiguous()  # d(w) in w's own layout: AccumulateGrad keeps it without a copy

    seen = {}

    class Probe(torch.autograd.Function):  # holds a weak reference to the GEMM's input
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    x = Probe.apply(a)
    seen["x"] = weakref.ref(x)
    out = moe_layer._grouped_linear()(x, w.transpose(-2, -1), offs)
    del x
    real = moe_layer.grouped_mm

    def watch(p, q, o):  # the d(input) product: by now the input is gone
        seen["alive_at_da"] = seen["x"]() is not None
        return real(p, q, o)

    monkeypatch.setattr(moe_layer, "grouped_mm", watch)
    torch.autograd.grad(out, (a, w), dy)
    assert seen["alive_at_da"] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU: `python -m benchmarks.jax_moe_layer` itself runs there")
def test_jax_moe_layer_runs_both_paths(tmp_path):
    """`benchmarks.jax_moe_layer --smoke`: xkern's and MaxText's paths, the whole step and dispatch + combine,
    each checked against the FP32 reference, bitwise run to run, its compiled memory and its time over the torch
    xkern row's read from the torch benchmark's JSON."""
    from benchmarks import jax_moe_layer, moe_layer, timing

    size = moe_layer.SMOKE_SIZE
    torch_rows = [{"framework": "torch", "impl": "xkern", "part": part, "us": 1.0, "size": "smoke", **size}
                  for part in ("layer", "dispatch+combine")]
    (tmp_path / "cpu-moe-layer.json").write_text(json.dumps({"rows": torch_rows}))
    try:
        assert jax_moe_layer.main(["--smoke", "--out", str(tmp_path)]) == 0
    finally:
        timing.set_smoke(False)
    results = json.loads((tmp_path / "cpu-jax-moe-layer.json").read_text())
    rows = results["rows"]
    assert results["complete"]
    assert {(r["impl"], r["part"]) for r in rows} == {(p, part) for p in jax_moe_layer.PATHS
                                                     for part in ("layer", "dispatch+combine")}
    for r in rows:
        assert r["status"] == "ok" and r["ref_check"] == "pass" and r["bitwise_run_to_run"], r
        assert r["peak_mib"] > 0 and r["vs_torch_xkern"] == r["us"] / 1.0
    assert "| xkern / maxtext |" in (tmp_path / "cpu-jax-moe-layer.md").read_text()


def test_a_liger_row_without_its_autotune_says_so(monkeypatch):
    """A Liger row measured with LIGER_FUSED_MOE_AUTOTUNE=0 (one config per kernel) is named so in the MoE
    table and in README's MoE line; a row with its autotune is not."""
    from benchmarks import moe_layer, readme

    monkeypatch.setenv("LIGER_FUSED_MOE_AUTOTUNE", "0")
    assert not moe_layer.liger_autotune()
    row = {"framework": "torch", "impl": "liger", "part": "layer", "status": "ok", "size": "s", "tokens": 64,
           "us": 2.0, "peak_mib": 1.0, "liger_autotune": False}
    tuned = {**row, "liger_autotune": True}
    table = moe_layer.markdown([row, tuned], "G").splitlines()
    assert table[-2].endswith("| ok (Liger's autotune off: one config per kernel) |") and table[-1].endswith("| ok |")
    assert readme._moe_path(row) == "Liger fused MoE (autotune off)" and readme._moe_path(tuned) == "Liger fused MoE"


def test_parallel_autotune_compile_warms_each_tuning_key_once():
    """The MoE benchmark's parallel compile of an autotuned peer (Liger): at a tuning key's first call every
    config is compiled (warmed) before the autotuner's own benchmark and launch, once per key and only inside
    the block; the autotuner still runs every config and launches its choice."""
    import triton
    from triton.runtime.autotuner import Autotuner

    from benchmarks.moe_layer import parallel_autotune_compile

    calls = []

    class Kernel:  # a JITFunction's two entry points: compile only (warmup), compile and launch (run)
        def __init__(self):
            self.fn = lambda x, n: None

        def warmup(self, x, n, *, grid, **meta):
            calls.append(("compile", n, meta["B"]))

        def run(self, x, n, *, grid, warmup, **meta):
            calls.append(("launch", n, meta["B"]))

    configs = [triton.Config({"B": b}) for b in (1, 2, 4)]
    tuner = Autotuner(Kernel(), ["x", "n"], configs, ["n"], None, None,
                      do_bench=lambda call, quantiles: (call(), [float(len(calls))] * 3)[1])
    with parallel_autotune_compile(2):
        tuner[(1,)](torch.ones(2), 5)
        tuner[(1,)](torch.ones(2), 5)
        tuner[(1,)](torch.ones(2), 6)
    tuner[(1,)](torch.ones(2), 7)

    def step(n, compiled):  # the autotuner benchmarks every config (the first is the fastest), then launches it
        return [("compile", n, b) for b in (1, 2, 4) if compiled] + [("launch", n, b) for b in (1, 2, 4, 1)]

    assert calls == step(5, True) + [("launch", 5, 1)] + step(6, True) + step(7, False)
    assert Autotuner.run.__name__ == "run"  # the autotuner's own again after the block


@pytest.mark.parametrize("rows_by_ragged_dot", [False, True, "xkern"])
def test_jax_moe_tiled_gemm_is_ragged_dot(rows_by_ragged_dot):
    """The JAX MoE benchmark's tiled grouped GEMM (its experts where XLA's ragged_dot would expand to a dense
    GEMM per expert) gives ragged_dot's result and gradients: groups empty, smaller than a tile, several tiles
    long, and rows past the last group."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import jax_moe_layer

    rng = np.random.default_rng(5)
    # "xkern": the benchmark's `--experts-gemm xkern` (jax_api.grouped_mm on the groups' cumulative ends)
    gemm = jax_moe_layer.xkern_gemm if rows_by_ragged_dot == "xkern" else jax_moe_layer.tiled_gemm(rows_by_ragged_dot)
    # xkern multiplies fp32 in IEEE FP32; ragged_dot and the tiled forms at the GPU's default (TF32)
    precision = jax.lax.Precision.HIGHEST if rows_by_ragged_dot == "xkern" else None
    for sizes in ([5, 0, 17, 3, 0, 40], [0, 0, 64], [64, 0, 0]):
        gs = jnp.asarray(sizes, jnp.int32)
        rows = sum(sizes) + 7
        x, dy = (jnp.asarray(rng.standard_normal((rows, n)), jnp.float32) for n in (24, 40))
        w = jnp.asarray(rng.standard_normal((len(sizes), 24, 40)), jnp.float32)
        want, want_vjp = jax.vjp(lambda x, w, gs=gs: jax.lax.ragged_dot(x, w, gs, precision=precision), x, w)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(jax_moe_layer, "TILE_ROWS", 16)
            got, got_vjp = jax.vjp(lambda x, w, gs=gs: gemm(x, w, gs), x, w)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
        for g, r in zip(got_vjp(dy), want_vjp(dy), strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="read on CPU's HLO: on a GPU XLA rewrites the GEMMs into "
                    "fusions and custom calls")
@pytest.mark.parametrize("path", [pytest.param("xkern", marks=pytest.mark.slow), "maxtext"])
def test_jax_moe_timed_loop_keeps_every_gemm(path):
    """The JAX MoE benchmark's timing loop (two steps per iteration) computes every GEMM of both steps: the
    compiled loop holds each dot of one step twice (XLA dropped the first step's weight-gradient GEMMs when
    nothing read them)."""
    import re

    import jax

    from benchmarks import jax_moe_layer, moe_layer

    size = moe_layer.SMOKE_SIZE
    inp = jax_moe_layer.inputs(size)
    step = jax_moe_layer.layer_step(path, size["top_k"], size["experts"])
    consts = ((inp["w_router"], inp["w13"], inp["w2"]), inp["dout"])
    loop_step = jax_moe_layer.timed_step(step)
    state = (inp["x"], jax.numpy.zeros((), "float32"))

    def dots(fn, *args):
        return sorted(re.findall(r"= (\S+) (?:dot|ragged-dot)\(", jax.jit(fn).lower(*args).compile().as_text()))

    one = dots(step, consts[0], inp["x"], consts[1])
    loop = dots(lambda c, s: jax.lax.fori_loop(0, 3, lambda i, s: loop_step(c, loop_step(c, s)), s), consts, state)
    assert len(one) >= 8 and loop == sorted(one * 2), (one, loop)


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU: `python -m benchmarks.hf_moe_step` itself runs there")
def test_hf_moe_step_runs_both_experts_paths(tmp_path):
    """`benchmarks.hf_moe_step --smoke`: a tiny Qwen3-MoE trains one step with transformers' experts and with
    xkern's, each path's logits and gradients checked against the FP32 model."""
    from benchmarks import hf_moe_step

    assert hf_moe_step.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "cpu-hf-moe-step.json").read_text())["rows"]
    assert [r["path"] for r in rows] == list(hf_moe_step.PATHS)
    assert all(r["status"] == "ok" and r["ref_check"] == "pass" and r["step_ms"] > 0 for r in rows), rows
    assert all(0 < r["ref_rel_l2"]["experts_grads"] < hf_moe_step.REF_TOL for r in rows)


def test_host_gather_peers_compute_what_xkern_computes():
    """The host table's gather and MoE rows: each peer returns what the xkern row beside it returns (on a CPU
    through the interpreter), so the table times like for like; the inverse's peer writes no padding slot."""
    import torch

    from benchmarks import host

    rows = {}
    for op, _, impl, _, call in [*host._gather_entries(DEVICE), *host._moe_entries(DEVICE)]:
        if not impl.startswith("floor"):  # the floors launch empty kernels
            rows.setdefault(op, {})[impl] = call()
    for op, impls in rows.items():
        (ours,) = [v for k, v in impls.items() if k.startswith("xkern")]
        for impl, got in impls.items():
            if op in ("inverse_permutation", "unpermute_rows", "permute_rows(top_k)") or \
                    impl == "torchtitan (vstack + index)":
                assert torch.equal(got.to(ours.dtype), ours), (op, impl)
            if op == "unpermute_rows(top_k, probs)":  # FP32 sums of k terms, each path in its own order
                torch.testing.assert_close(got.float(), ours.float(), rtol=1e-2, atol=1e-2)


def test_jax_moe_mgpu_gemm_is_ragged_dot(monkeypatch):
    """The JAX MoE benchmark's grouped GEMM by jax's Mosaic GPU kernels (Hopper only): with the two kernels
    replaced by CPU references of their signatures (operands as they lie, transpose flag, block arguments, rows
    past the groups left unwritten: NaN), its result and gradients are ragged_dot's for groups that cover every
    row, as both paths' do."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import jax_moe_layer

    seen = []

    def rows_kernel(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps, grid_block_n,
                    transpose_rhs=False):
        seen.append(("rows", transpose_rhs, lhs.shape, rhs.shape))
        out = jax.lax.ragged_dot(lhs, rhs.swapaxes(1, 2) if transpose_rhs else rhs, group_sizes)
        return jnp.where(jnp.arange(lhs.shape[0])[:, None] < jnp.sum(group_sizes), out, jnp.nan)

    def weight_kernel(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps, grid_block_n):
        seen.append(("weights", lhs.shape, rhs.shape))  # lhs (K, M): the rows contracted, as ragged
        dims = jax.lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), [0], [])
        return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims)

    import inspect

    real = jax_moe_layer.mgpu_kernels()
    if real is not None:  # this jax's kernels take the arguments as the stand-ins do
        for kernel in real:
            z = jnp.zeros((2, 2))
            inspect.signature(kernel).bind(z, z, group_sizes=z, **jax_moe_layer.MGPU_BLOCK)
    monkeypatch.setattr(jax_moe_layer, "mgpu_kernels", lambda: (rows_kernel, weight_kernel))
    gemm = jax_moe_layer.mgpu_gemm()
    rng = np.random.default_rng(6)
    sizes = [5, 0, 17, 3, 40]
    gs = jnp.asarray(sizes, jnp.int32)
    rows = sum(sizes)
    x, dy = (jnp.asarray(rng.standard_normal((rows, n)), jnp.float32) for n in (24, 40))
    w = jnp.asarray(rng.standard_normal((len(sizes), 24, 40)), jnp.float32)
    want, want_vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, gs), x, w)
    got, got_vjp = jax.vjp(lambda x, w: gemm(x, w, gs), x, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    for g, r in zip(got_vjp(dy), want_vjp(dy), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-3)
    assert ("rows", True, (rows, 40), (5, 24, 40)) in seen  # dx: the weights read transposed, never copied
    assert ("weights", (rows, 24), (rows, 40)) in seen


def test_jax_moe_xkern_groups_cover_every_row():
    """The xkern path hands its experts groups that cover its whole rows buffer (the grouped GEMM leaves no row
    unwritten): each expert's block padded to ALIGN rows, the buffer's tail in the last group, and every row
    that no copy fills, padding and tail, zero."""
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import jax_moe_layer

    t, k, e, h = 24, 2, 5, 16
    rng = np.random.default_rng(8)
    ids = jnp.asarray(np.stack([rng.choice(e - 1, k, replace=False) for _ in range(t)]), jnp.int32)
    x = jnp.asarray(rng.standard_normal((t, h)) + 3.0, jnp.float32)
    probs = jnp.full((t, k), 0.5, jnp.float32)
    seen = {}

    class Identity:
        num_experts = e

        def __call__(self, rows, group_sizes):
            seen.update(rows=np.asarray(rows), sizes=np.asarray(group_sizes))
            return rows

    out = jax_moe_layer.xkern_moe(x, probs, ids, Identity())
    np.testing.assert_allclose(out, x, rtol=1e-6)  # the copies' weights sum to 1
    rows, sizes = seen["rows"], seen["sizes"]
    counts = np.bincount(np.asarray(ids).ravel(), minlength=e)
    padded = -(-counts // jax_moe_layer.ALIGN) * jax_moe_layer.ALIGN
    assert rows.shape[0] == t * k + e * jax_moe_layer.ALIGN == sizes.sum()
    np.testing.assert_array_equal(sizes[:-1], padded[:-1])
    assert counts[-1] == 0 and sizes[-1] == rows.shape[0] - padded.sum() > 0
    filled = np.abs(rows).sum(axis=1) > 0
    assert filled.sum() == t * k
    for ex in range(e):  # each expert's filled rows come first in its block
        start = padded[:ex].sum()
        assert filled[start:start + counts[ex]].all() and not filled[start + counts[ex]:start + padded[ex]].any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU: run `python -m tools.moe_probe` itself there")
def test_moe_probe_checks_each_candidate_against_the_plan(monkeypatch, capsys):
    """`tools.moe_probe` on CPU: each MoE row kernel runs with the plan's tile and another, both write every
    element (poisoned first) and agree bit for bit; a candidate that leaves rows unwritten is reported and
    fails the run."""
    from tools import moe_probe

    assert moe_probe.main(["--smoke"]) == 0
    text = capsys.readouterr().out
    for kernel in ("permute_rows(top_k)", "permute_rows(top_k) token-major", "copy-sum", "weighted combine",
                   "combine backward"):
        assert f"smoke {kernel} BLOCK_M" in text and "(plan)" in text
    assert "combine BLOCK_M 4 BLOCK_H 256 warps 4 TOP_K 0: ran" in text  # the loop, the plan unrolled: same bits
    assert "DIFFERS" not in text

    real = moe_probe.candidates

    def one_program(step, n_items):  # the plan, then the plan on a grid of one program: rows left unwritten
        plan, scalars = next(real(step, n_items))
        yield plan, scalars
        yield dataclasses.replace(plan, grid=(1,), constexprs={**plan.constexprs, "BLOCK_M": 1}), scalars

    monkeypatch.setattr(moe_probe, "candidates", one_program)
    assert moe_probe.main(["--smoke"]) == 1
    assert "DIFFERS" in capsys.readouterr().out
