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


def _section(folder) -> str:
    """README's section for the result set `folder/g.json` and the step results beside it."""
    from benchmarks import report

    return report.section(str(folder / "g.json"), str(folder), set())


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
    assert results["add_rms_norm"] == []  # its own run (`--only add_rms_norm`, test_add_rms_norm_table_runs_every_path)
    md = path.with_suffix(".md").read_text()
    assert "Host cost per call" in md and "width sweep" in md

    from benchmarks import report  # the sweep's parts merged; README's section from the result sets

    merged = tmp_path / f"{path.stem}-sweep.json"
    report.merge(str(merged), [str(path), str(path)])
    section = report.section(str(path), str(tmp_path), set())
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


def test_readme_section_is_what_the_report_writes_from_the_results(tmp_path):
    """README's benchmarks section is `python -m benchmarks.report`'s from the committed result sets: the CLI
    rewrites only what lies between the markers, and the committed section has nothing else."""
    from benchmarks import report

    readme = (ROOT / "README.md").read_text()
    copy = tmp_path / "README.md"
    copy.write_text(readme.replace(report.BEGIN, report.BEGIN + "\nstale").replace(report.END, "stale\n" + report.END))
    assert report.main(["--readme", str(copy), "--no-plots"]) == 0
    written = copy.read_text()
    assert "stale" not in written and written.split(report.END)[1] == readme.split(report.END)[1]
    # links are relative to the README's folder: the repository's own section, written for it
    assert readme.split(report.BEGIN)[1].split(report.END)[0] == f"\n## Benchmarks\n\n{report.body(str(ROOT))}"


def test_readme_jax_column_times_both_front_ends_one_way(tmp_path):
    """README's "slowest JAX against torch" is torch's profiler time over JAX's where both rows have one (the
    torch row's own time is a CUDA graph's, another method), else the two rows' fractions of the ceiling."""

    row = {"op": "rms_norm", "pass": "bwd", "dtype": "bfloat16", "shape": [32768, 128], "status": "ok"}
    rows = [{**row, "impl": "xkern (torch)", "frac": 0.5, "us": 14.6, "profile_us": 15.3},
            {**row, "impl": "xkern (jax)", "frac": 0.5 * 14.6 / 15.9, "us": 15.9, "profile_us": 15.9},
            {**row, "impl": "quack", "frac": 0.4, "us": 18.0}]
    results = {"gpu": "G", "date": "d", "commit": "c", "ceiling": {"gbps": 3000.0}, "rows": rows}
    (tmp_path / "g.json").write_text(json.dumps(results))
    text = _section(tmp_path)
    assert "| 0.96 at 32768×128 |" in text  # 15.3 / 15.9
    for r in rows:
        r.pop("profile_us", None)
    (tmp_path / "g.json").write_text(json.dumps(results))
    text = _section(tmp_path)
    assert "| 0.92 at 32768×128 |" in text  # 14.6 / 15.9


def test_best_peer_is_timed_as_xkern_is():
    """The best peer's ratio compares like with like: a JAX peer's profiler time with xkern's profiler time, a
    torch peer's CUDA-graph time with xkern's (through their fractions of the ceiling); the fastest wins."""
    from benchmarks.report import ratios

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

    results = {"gpu": "G", "date": "d", "commit": "c", "ceiling": {"gbps": 3000.0}, "rows": []}
    (tmp_path / "g.json").write_text(json.dumps(results))
    pairs = [{"op": "rms_norm", "shape": [8, 128], "pass": p, "torch_over_jax": r} for p, r in (("fwd", 0.8),
                                                                                                  ("bwd", 1.0))]
    (tmp_path / "g-jax-torch-profile.json").write_text(json.dumps({"commit": "abcdef123", "pairs": pairs}))
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
    text = _section(tmp_path)
    assert "torch / JAX 0.80–1.00 (slowest: rms_norm 8×128 fwd" in text and "at abcdef1" in text
    assert "| torch | s (T=64) | layer | 3.00 | Liger fused MoE 4.00 | 0.75 | 10 / 12 | torch12 |  |" in text
    assert "| jax | s (T=64) | layer | 6.00 | MaxText-style 5.00 | 1.20 | 20 / 15 | jax1234 | 2.00 |" in text
    assert "bad" not in text and "dispatch+combine" not in text and "tiles of dense GEMMs" in text
    assert "[JAX MoE layer, s](g-jax-moe-layer-s.md)" not in text  # links only the tables that exist
    hf = [{"path": p, "status": "ok", "layers": 2, "tokens": 64, "step_ms": ms, "peak_mib": 9.0}
          for p, ms in (("xkern", 30.0), ("grouped_mm", 40.0))]
    (tmp_path / "g-hf-moe-step.json").write_text(json.dumps({"commit": "hf12345678", "rows": hf}))
    assert ("| torch | Hugging Face Qwen3-MoE (2 layers, T=64) | training step (AdamW) | 30.00 | transformers' "
            "grouped_mm 40.00 | 0.75 | 9 / 9 | hf12345 |  |") in _section(tmp_path)
    (tmp_path / "g-hf-moe-step.json").unlink()
    (tmp_path / "g-jax-moe-layer-s.md").write_text("table")
    assert "[JAX MoE layer, s](g-jax-moe-layer-s.md)" in _section(tmp_path)
    # a later run of the host table alone (`--host`) takes the place of the set's own host rows, its commit named
    host = [{"op": "rms_norm", "pass": "fwd", "impl": i, "wall_us": us, "shape": "x 16×4096 bf16"}
            for i, us in (("xkern (torch)", 10.4), ("F.rms_norm", 10.0))]
    (tmp_path / "g.json").write_text(json.dumps({**results, "host": [{**h, "wall_us": 99.0} for h in host]}))
    assert "| rms_norm forward | 16×4096 bf16 | 99.0 | 99.0 | 1.00 |" in _section(tmp_path)
    (tmp_path / "g-host.json").write_text(json.dumps({"commit": "later12", "host": host}))
    text = _section(tmp_path)
    assert "| rms_norm forward | 16×4096 bf16 | 10.4 | 10.0 | 1.04 |" in text and "its own run, commit later12" in text


def test_readme_section_states_the_fused_add_and_the_extra_widths(tmp_path):
    """The fused add's table and the sweep's extra widths (`--sweep --widths`) are summed up from their JSON: the
    best peer's time over xkern's per pass, the lowest named, xkern's own kernel under torch.compile's fusion pass
    not counted as a peer; a set without them says nothing of them."""

    results = {"gpu": "G", "date": "d", "commit": "c", "ceiling": {"gbps": 3000.0}, "rows": []}
    (tmp_path / "g.json").write_text(json.dumps(results))
    assert "Fused residual add" not in _section(tmp_path)

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
    text = _section(tmp_path)
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
    from benchmarks import report

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
    text = report.body(str(tmp_path), str(tmp_path))
    legends = [line for line in text.splitlines() if line.startswith("Peers: ")]
    assert len(legends) == 1 and "Liger: " in legends[0] and "quack: " in legends[0]
    assert text.index(legends[0]) > text.index("### GPU-B")
    assert "| torch | s (T=64) | layer | 3.00 | Liger fused MoE 4.00 | 0.75 | 10 / 12 | 0123456 |\n" in text
    assert "JAX" not in text.split("MoE layer step", 1)[1].split("|", 1)[0]  # the table's caption
    assert "| front end | size | part | xkern | peers | xkern / fastest | peak MiB | commit |\n" in text


@pytest.mark.slow  # the smoke run above covers the host tables; this, `--host` alone
@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU: run `python -m benchmarks.main --host` itself there")
def test_host_tables_alone(tmp_path):
    """`--host`: the host-cost table only (a short GPU run after a call-path change)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.main", "--host", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    (path,) = tmp_path.glob("*-host-smoke.json")
    results = json.loads(path.read_text())
    assert results["mode"] == "host-smoke" and not results["rows"]
    timed = {(r["op"], r["pass"], r["impl"]) for r in results["host"] if "wall_us" in r}
    assert ("floor", "fwd+bwd", "autograd.Function of (x, w), allocations only") in timed
    assert ("rms_norm", "fwd+bwd", "xkern (torch)") in timed
    for op, pass_, peer in (("add_rms_norm", "fwd+bwd", "F.rms_norm"), ("add_rms_norm", "fwd", "HF eager"),
                            ("permute_rows(top_k)", "fwd", "torchtitan"),
                            ("unpermute_rows(top_k, probs)", "fwd", "torchtitan")):
        assert {(op, pass_, "xkern (torch)"), (op, pass_, peer)} <= timed, (op, pass_, peer)


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
    from benchmarks.report import ratios

    def row(impl, us, names):
        return {"op": "rms_norm", "pass": "fwd", "dtype": "bfloat16", "shape": [8, 128], "impl": impl, "frac": 0.5,
                "profile_us": us, "kernels": [{"name": n} for n in names]}

    rows = [row("xkern (torch)", 9.0, ["k"]), row("xkern (jax)", 10.0, ["k"]), row("HF eager", 20.0, ["x", "y"])]
    (jt,) = report.jax_torch(rows)
    assert (jt["torch_us"], jt["jax_us"], jt["ratio"], jt["same_kernels"]) == (9.0, 10.0, 0.9, True)
    assert ratios(rows)[0]["jax_ratio"] == 0.9
    assert "torch / JAX" in "\n".join(report.jax_torch_table(rows))


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
    from benchmarks import moe_layer, report

    monkeypatch.setenv("LIGER_FUSED_MOE_AUTOTUNE", "0")
    assert not moe_layer.liger_autotune()
    row = {"framework": "torch", "impl": "liger", "part": "layer", "status": "ok", "size": "s", "tokens": 64,
           "us": 2.0, "peak_mib": 1.0, "liger_autotune": False}
    tuned = {**row, "liger_autotune": True}
    table = moe_layer.markdown([row, tuned], "G").splitlines()
    assert table[-2].endswith("| ok (Liger's autotune off: one config per kernel) |") and table[-1].endswith("| ok |")
    assert report._moe_path(row) == "Liger fused MoE (autotune off)" and report._moe_path(tuned) == "Liger fused MoE"


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

