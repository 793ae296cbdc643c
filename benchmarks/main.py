"""The main job: xkern checked against the FP64 oracle and timed against its peers on this machine.

    python -m benchmarks.main [--sweep [--part K/N] [--widths W,...] | --host | --smoke] [--only OP]
                              [--out DIR] [--budget-s S]

`--only add_rms_norm`: the fused residual add's table (benchmarks/add_rms_norm.py), into
`<gpu>-add_rms_norm.json` and `.md` (a run of its own: the main run does not make it).

With a CUDA GPU: the copy ceiling, the host cost per call of every torch op (`benchmarks/host.py`), then
every case of every op (`benchmarks/runner.py`: each xkern result checked before it is timed). Writes
`DIR/<gpu>.json` (all the data, stamped with the commit and date), `<gpu>.md` (every table) and the plots,
and prints the tables last. DIR defaults to `benchmarks/results/<gpu>/` (`<gpu>` the GPU kind, e.g.
`nvidia-h200`), and a run there also refreshes README's benchmarks section. `--sweep`: the RMSNorm width
sweep instead, into `<gpu>-sweep.json` (about 11 minutes on an H200; `--widths`: only those widths, into
`<gpu>-sweep-w<widths>.json`, to re-measure a plan change with every peer). `--host`: the host-cost
table alone, into `<gpu>-host.json` (about a minute: before and after a change to a front end's call path).
`--part K/N`: every N-th case from the K-th (`python -m benchmarks.report --merge` joins the parts).

Without a GPU (Triton's interpreter): the same code at CPU sizes. The cases are the validation shapes, one
per kernel plan regime, checked against the FP64 oracle with torch == JAX bit for bit, and every timed
path runs through once (`timing.set_smoke`). It prints what it validated, per op and check, and the verdict
(`validation: pass`), not tables of CPU times; nothing is written unless `--out` is given (the files keep
the tables). `--smoke`: the same at the smallest sizes (CI runs it: tests/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import tempfile
import time
import traceback

# First: on a CPU machine it selects the interpreter and JAX's CPU platform before torch, triton or jax loads.
from benchmarks.machine import GPU, RESULTS, ROOT, commit, gpu_kind, kernels_sha, versions

# Seconds on the H200 (measured): an RMSNorm case (every implementation, three passes), a gather case, and
# the host table (estimate).
CASE_S = {"rms_norm": 15.0, "permute_rows": 4.0, "unpermute_rows": 4.0}
HOST_S = 90.0


def log(msg: str) -> None:
    print(msg, flush=True)


def configure_dynamo() -> None:
    """torch.compile recompiles per shape (dynamic=False): room for every case, and a fallback to eager
    raises instead of being timed as the compiled peer."""
    import torch._dynamo.config as cfg

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 4096)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True
    # A compiled backward that donates its saved buffers runs once per graph, and the backward alone is timed
    # with retain_graph=True (with donation on, every torch.compile backward-alone row failed on the H200).
    import torch._functorch.config as functorch_cfg

    functorch_cfg.donated_buffer = False


def release() -> None:
    """Give back what a table's compiled functions and CUDA graphs hold (Dynamo keeps graphs' memory pools
    until it forgets them)."""
    if not GPU:
        return
    import gc

    import torch

    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def reserved_gib() -> str:
    """torch's reserved memory after a case, and the part of it in CUDA graph pools (what empty_cache cannot
    return while a graph holds the pool): both should read 0 (see PYTORCH_CUDA_ALLOC_CONF above)."""
    import torch

    segments = torch.cuda.memory_snapshot()
    pools = sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))
    return f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB reserved, {pools / 2**30:.1f} in graph pools"


def ops(only):
    from benchmarks import permute, rms_norm

    # The gathers first (before expandable segments, memory reserved by the RMSNorm cases left three gather rows
    # out of memory on the H200, 2026-12-04).
    all_ops = [permute.PERMUTE, permute.UNPERMUTE, rms_norm.OP]
    return [op for op in all_ops if only is None or op.name == only or (only == "permute" and "permute" in op.name)]


def plan(args) -> tuple[str, list]:
    """(mode, [(op, case, timed)]) for the arguments on this machine. Without a GPU the validation cases are
    checked only, then the smoke cases run every timed path."""
    if args.host:
        return ("host" if GPU and not args.smoke else "host-smoke"), []
    if args.sweep:
        mode = "sweep" if GPU and not args.smoke else "sweep-smoke"
    else:
        mode = "smoke" if args.smoke else "main" if GPU else "validate"
    work = [(op, case, mode != "validate") for op in ops(args.only) for case in op.cases(mode)]
    if mode == "validate":
        work += [(op, case, True) for op in ops(args.only) for case in op.cases("smoke")]
    if mode in ("smoke", "validate"):  # the sweep's code too, at its smoke sizes
        work += [(op, case, True) for op in ops(args.only) for case in op.cases("sweep-smoke")]
    if args.widths:
        widths = {int(w) for w in args.widths.split(",")}
        work = [w for w in work if w[1].shape[-1] in widths]
    if args.part:
        k, n = map(int, args.part.split("/"))
        work = work[k - 1::n]
    return mode, work


def output_stem(gpu: str, args) -> str:
    stem = gpu_kind(gpu)
    if args.sweep:
        stem += "-sweep" + (f"-part{args.part.replace('/', 'of')}" if args.part else "")
        if args.widths:  # named by its widths: a later re-run of other widths does not overwrite it
            stem += "-w" + "-".join(map(str, sorted({int(w) for w in args.widths.split(",")})))
    elif args.host:
        stem += "-host"
    elif args.part:  # a main job split over processes or calls; merge with benchmarks.report --merge
        stem += f"-part{args.part.replace('/', 'of')}"
    return stem + (f"-{args.only}" if args.only else "") + ("-smoke" if args.smoke or not GPU else "")


def run(args) -> int:
    import torch

    from benchmarks import host, report, runner, timing

    start = time.time()
    device = "cuda" if GPU else "cpu"
    # jax_api's ptxas router logs which assembler took each PTX (`jax_api/_ptxas.py`): the JSON says whether
    # JAX's kernels were assembled as torch's (Triton's ptxas) in this process
    ptxas_log = os.environ.setdefault("XKERN_PTXAS_LOG", os.path.join(tempfile.mkdtemp(), "ptxas.log"))
    timing.set_smoke(args.smoke or not GPU)
    configure_dynamo()
    mode, work = plan(args)
    if args.only == "add_rms_norm" and mode == "main":  # the fused add's table alone: README is not refreshed
        mode = "add_rms_norm"
    gpu = torch.cuda.get_device_name(0) if GPU else "cpu"
    stamp = datetime.datetime.now(datetime.timezone.utc)
    default_dir = os.path.join(RESULTS, gpu_kind(gpu))
    out_dir = args.out or (default_dir if GPU and not args.smoke else None)
    json_path = os.path.join(out_dir, output_stem(gpu, args) + ".json") if out_dir else None
    results = {
        "gpu": gpu, "date": stamp.strftime("%Y-%m-%d"), "started_utc": stamp.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(), "xkern_sha": kernels_sha(), "versions": versions(), "mode": mode,
        "smoke": timing.smoke(),
        "method": {
            "bytes": "minimum bytes: each input read once, each output written once (see docs/benchmarks.md)",
            "torch": "CUDA graph of the pass (one call per rotated input set) replayed under triton do_bench, "
                     f"warmup {timing.WARMUP_MS} ms, rep {timing.REP_MS} ms, median, L2 flushed per replay",
            "jax": "n iterations inside one jitted lax.fori_loop (static trip count), each output fed into the "
                   "next input; host wall time of the call / n, median of several; fwd+bwd: the cotangent "
                   "(the previous y) waits for this step's y (optimization_barrier), as in a model",
            "rotation": f"input sets rotated until they add up to >= {timing.ROTATE_BYTES / 1e6:.0f} MB",
            "host": "tight eager loop, one synchronize at the end: wall µs per call (issue: before the sync)",
        },
        "rms_norm": {"eps": 1e-6}, "permute": {},
        "ceiling": None, "rows": [], "host": [], "add_rms_norm": [], "skipped": [],
    }
    if "permute" in str(args.only) or args.only is None:
        from benchmarks.permute import ROUTING

        results["permute"]["routing"] = ROUTING

    def save():
        if json_path:
            os.makedirs(out_dir, exist_ok=True)
            with open(json_path, "w") as f:
                json.dump(results, f, indent=1)

    log(f"# {gpu}, {results['started_utc']}, commit {results['commit']}, xkern_sha {results['xkern_sha']}")
    results["ceiling"] = timing.copy_ceiling()
    ceiling = results["ceiling"]["gbps"]
    if not timing.smoke():
        log(f"{gpu}: copy ceiling {ceiling:.0f} GB/s")
    host_first = mode.startswith("host") or not (mode.startswith("sweep") or args.no_host) and args.only in (
        None, "rms_norm")
    est = sum(CASE_S[case.op] for _, case, _ in work) + HOST_S * host_first
    log(f"{mode}: {len(work)} cases{' after the host table' if host_first else ''}"
        + (f", about {est / 60:.0f} min on an H200" if GPU else
           ": checked against the FP64 oracle, every timed path run through once (no timings without a GPU)"))
    # The tables' progress lines are their timings: not printed where nothing is measured (their rows are
    # judged by `failures` and counted in the validation summary).
    table_log = (lambda line: None) if timing.smoke() else log
    if mode.startswith("sweep"):
        if mode == "sweep-smoke":
            results["host"] = host.host_table(device, table_log)
    elif host_first:
        results["host"] = host.host_table(device, table_log)
        release()
    if args.only == "add_rms_norm":  # its own run: with the main cases the run takes over 10 minutes
        from benchmarks.add_rms_norm import add_rms_norm_table

        results["add_rms_norm"] = add_rms_norm_table(device, ceiling, log)
    save()

    for i, (op, case, timed) in enumerate(work):
        if time.time() - start > args.budget_s:
            results["skipped"].append(f"{case.label}: over the time budget of {args.budget_s:.0f} s")
            log(f"{case.label}: skipped, over the time budget")
            continue
        t0 = time.time()
        try:
            results["rows"] += runner.run_case(op, case, device, ceiling, log, timed=timed)
        except Exception as err:  # noqa: BLE001 - one broken case must not lose the rest
            results["skipped"].append(f"{case.label}: {type(err).__name__}: {err}")
            log(f"{case.label}: FAILED\n{traceback.format_exc(limit=-6)}")
        if GPU:
            torch.cuda.empty_cache()
        spent = time.time() - start
        held = f", {reserved_gib()}" if GPU else ""
        log(f"{case.label}: {time.time() - t0:.1f} s (total {spent:.0f} s, "
            f"about {spent / (i + 1) * (len(work) - i - 1):.0f} s to go{held})")
        save()
    results["wall_s"] = time.time() - start
    results["jax_ptxas"] = ptxas_calls(ptxas_log)
    if results["jax_ptxas"]:
        log(f"ptxas calls by assembler and PTX ISA version: {results['jax_ptxas']}")
    save()

    if json_path:
        md = report.write_all(json_path, readme=os.path.join(ROOT, "README.md") if out_dir == default_dir else None,
                              log=log)
    else:
        md = report.markdown(results, "(not written)", [])
    if results["add_rms_norm"]:  # its table after the report's (benchmarks/add_rms_norm.py)
        from benchmarks.add_rms_norm import markdown as add_rms_norm_markdown

        table = "\n\n" + add_rms_norm_markdown(results["add_rms_norm"]) + "\n"
        md += table
        if json_path:
            with open(os.path.splitext(json_path)[0] + ".md", "a") as f:
                f.write(table)
    # Tables only of measured timings; a smoke or CPU run prints what it checked (its files, with --out, keep
    # the tables: they show every path ran).
    log("\n" + (validation_summary(results) if timing.smoke() else md))
    if json_path:
        log(f"wrote {json_path} ({results['wall_s']:.0f} s)")
    return failures(results, strict=timing.smoke())


def ptxas_calls(path: str) -> dict:
    """The calls jax_api's ptxas router logged, counted by "<assembler> <PTX ISA version>" ("triton 88": Triton's
    ptxas, as torch's kernels; "jaxlib 90": XLA's own PTX; "jaxlib " with no version: `--version` queries)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return dict(collections.Counter(f.read().splitlines()))


def validation_summary(results: dict) -> str:
    """What a run without measured timings validated, per op and check (the lines `failures` then judges)."""
    lines = [f"## Validation on {results['gpu']} (timings not measured: {results['mode']} run)", ""]
    by_op: dict = {}
    for r in results["rows"]:
        by_op.setdefault(r["op"], []).append(r)
    for op, rows in by_op.items():
        xkern = [r for r in rows if r["impl"].startswith("xkern") and "check" in r]
        passed = sum(r["check"] == "pass" for r in xkern)
        shapes = len({(str(r["shape"]), r["dtype"]) for r in xkern})
        jax = [r for r in rows if r["impl"] == "xkern (jax)" and "bitwise_equal_torch" in r]
        ran = [r for r in rows if r.get("us")]
        errors = sum(r["status"].startswith("error") for r in rows)
        lines.append(f"- {op}: xkern against the FP64 oracle {passed}/{len(xkern)} pass ({shapes} shapes), "
                     f"JAX bitwise torch {sum(bool(r['bitwise_equal_torch']) for r in jax)}/{len(jax)}, timed paths "
                     f"run through {len(ran)} (of {len(rows)} rows), errors {errors}")
    for name in ("host", "add_rms_norm"):
        rows = results[name]
        if rows:
            errors = sum(r.get("status", "").startswith("error") for r in rows)
            lines.append(f"- {name} table: {len(rows)} rows run through, errors {errors}")
    if results["skipped"]:
        lines.append(f"- cases that did not run: {len(results['skipped'])}")
    return "\n".join(lines)


def failures(results: dict, strict: bool) -> int:
    """1 when an xkern result is wrong or differs between front ends; with `strict` (CPU and smoke runs,
    whose job is to catch breakage), also when anything raised."""
    bad = []
    for r in results["rows"]:
        xkern = r["impl"].startswith("xkern")
        if xkern and (r.get("check", "pass").startswith("fail") or r.get("bitwise_equal_torch") is False):
            bad.append(f"{r['impl']} {r['op']} {r['pass']} {r['shape']}: {r.get('check')}")
        elif r["status"].startswith("error") and (xkern or strict):
            bad.append(f"{r['impl']} {r['op']} {r['pass']} {r['shape']}: {r['status']}")
    for r in results["add_rms_norm"]:
        if r["impl"].startswith("xkern") and (r.get("check", "pass").startswith("fail")
                                              or r.get("bitwise_equal_torch") is False
                                              or r["status"].startswith("error")):
            bad.append(f"{r['impl']} add_rms_norm {r['pass']} {r['shape']}: {r.get('check')} {r['status']}")
        elif strict and r["status"].startswith("error"):
            bad.append(f"{r['impl']} add_rms_norm {r['pass']} {r['shape']}: {r['status']}")
    for r in results["host"]:
        if strict and r.get("status", "").startswith("error"):
            bad.append(f"{r['op']} {r['impl']}: {r['status']}")
    if strict:
        bad += results["skipped"]
    for line in bad:
        log(f"FAIL {line}")
    log(f"validation: {'FAIL' if bad else 'pass'}")
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--sweep", action="store_true", help="the RMSNorm width sweep (~12 min on an H200)")
    group.add_argument("--host", action="store_true", help="the host-cost table only (~1 min on an H200; to "
                       "<gpu>-host.json)")
    parser.add_argument("--smoke", action="store_true", help="every benchmark path at tiny sizes, timings not "
                        "measured (with --sweep: the sweep's)")
    parser.add_argument("--no-host", action="store_true",
                        help="the cases only: no host table (measured in another part or run)")
    parser.add_argument("--part", help="K/N: every N-th case from the K-th (split a sweep or the main job over "
                        "processes or runs; with --no-host after the first)")
    parser.add_argument("--widths", help="with --sweep: these widths only (comma-separated)")
    parser.add_argument("--only", choices=("rms_norm", "permute", "add_rms_norm"), help="one op only")
    parser.add_argument("--out", help="where results go (default: benchmarks/results/<gpu kind>/ on a GPU, nothing on "
                        "CPU)")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new case after this many seconds (default: no limit)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
