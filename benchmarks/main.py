"""The main job: xkern against its peers on this machine's GPU, as fractions of the measured copy ceiling.

    python -m benchmarks.main [--quick] [--only rms_norm|permute] [--out DIR] [--budget-s S]

With a CUDA GPU: measures the copy ceiling, runs the RMSNorm and row-gather benchmarks (every xkern result
checked against the FP64 oracle before it is timed), writes `DIR/<gpu>-<date>.json` (all the data), a
markdown table and one PNG per op generated from it, refreshes README's benchmarks section, and prints the
table last. Without a GPU: validates both front ends under Triton's interpreter against the oracle
(forward and backward, torch == JAX bit for bit) and says that timings need a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


# Before torch, triton or jax is imported: the interpreter on a CPU machine; JAX must not grab 75 % of the
# GPU's memory next to torch.
GPU = _has_gpu()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DISTS = ("torch", "triton", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "jax-triton", "liger-kernel",
         "quack-kernels", "nvidia-cutlass-dsl", "numpy", "ml_dtypes")


def log(msg: str) -> None:
    print(msg, flush=True)


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in DISTS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        import torch

        out["cuda (torch)"] = torch.version.cuda
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out["driver"] = subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - informational only
        pass
    return out


def _shape(row) -> str:
    return "x".join(map(str, row["shape"])) + " " + row["dtype"]


def cpu_main(args) -> int:
    from benchmarks import permute, rms_norm

    log("No CUDA GPU here: validating both front ends under Triton's interpreter against the FP64 oracle.")
    ok = True
    if args.only in (None, "rms_norm"):
        ok = rms_norm.validate_cpu(log) and ok
    if args.only in (None, "permute"):
        ok = permute.validate_cpu(log) is not False and ok
    log(f"validation: {'pass' if ok else 'FAIL'}")
    log("Timings need a CUDA GPU: none here, so no benchmark was run and nothing was written.")
    return 0 if ok else 1


def gpu_main(args) -> int:
    import torch

    from benchmarks import permute, report, rms_norm, timing

    start = time.time()
    rms_norm._configure_dynamo()
    gpu = torch.cuda.get_device_name(0)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    stem = "-".join([gpu.lower().replace(" ", "-"), date] + (["quick"] if args.quick else [])
                    + ([args.only] if args.only else []))
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, stem + ".json")
    results = {
        "gpu": gpu, "date": date, "versions": versions(), "quick": args.quick,
        "method": {
            "bytes": "minimum bytes: each input read once, each output written once (see benchmarks/NOTES.md)",
            "torch": "CUDA graph of the pass (one call per rotated input set) replayed under triton do_bench, "
                     f"warmup {timing.WARMUP_MS} ms, rep {timing.REP_MS} ms, median, L2 flushed per replay",
            "jax": "n iterations inside one jitted lax.fori_loop (static trip count), each output fed into the "
                   "next input; host wall time of the call / n, median of several",
            "rotation": f"input sets rotated until they add up to >= {timing.ROTATE_BYTES / 1e6:.0f} MB",
            "us_eager": "fwd+bwd rows: the same step launched eagerly from Python under do_bench (host "
                        "overhead of autograd and dispatch included where it exceeds the device time)",
        },
        "rms_norm": {"eps": rms_norm.EPS, "sample_elems": rms_norm.SAMPLE_ELEMS},
        "permute": {"routing": permute.ROUTING},
        "ceiling": None, "rows": [], "host_overhead": [], "skipped": [],
    }

    def save():
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)

    results["ceiling"] = timing.copy_ceiling()
    ceiling = results["ceiling"]["gbps"]
    log(f"{gpu}: copy ceiling {ceiling:.0f} GB/s")
    save()

    work = []
    if args.only in (None, "permute"):
        shapes = permute.QUICK_SHAPES if args.quick else permute.SHAPES
        work += [(f"permute {t}x{h}", permute.run_shape, (t, h, ceiling, log)) for t, h in shapes]
    if args.only in (None, "rms_norm"):
        shapes = [(s, "bfloat16") for s in (rms_norm.QUICK_SHAPES if args.quick else rms_norm.SHAPES)]
        shapes += [] if args.quick else [(s, "float16") for s in rms_norm.SHAPES_FP16]
        work += [(f"rms_norm {m}x{n} {dt}", rms_norm.run_shape, (m, n, dt, ceiling, log)) for (m, n), dt in shapes]
    for name, fn, fn_args in work:
        if time.time() - start > args.budget_s:
            results["skipped"].append(f"{name}: over the time budget of {args.budget_s} s")
            log(f"{name}: skipped, over the time budget")
            continue
        t0 = time.time()
        try:
            results["rows"] += fn(*fn_args)
        except Exception as err:  # noqa: BLE001 - one broken shape must not lose the rest
            results["skipped"].append(f"{name}: {type(err).__name__}: {err}")
            log(f"{name}: FAILED\n{traceback.format_exc(limit=-6)}")
        log(f"{name}: {time.time() - t0:.1f} s (total {time.time() - start:.0f} s)")
        save()
    if args.only in (None, "rms_norm"):
        results["host_overhead"] = rms_norm.host_overhead(ceiling)
    results["wall_s"] = time.time() - start
    save()

    md = report.write_all(json_path, readme=os.path.join(ROOT, "README.md"), log=log)
    problems = {}
    for r in results["rows"]:
        if r["status"] != "ok":
            problems.setdefault((r["impl"], r["status"][:160]), []).append(f"{r['op']} {r['pass']} {_shape(r)}")
    if problems:
        log("\nrows without a time:")
        for (impl, status), where in problems.items():
            log(f"  {impl}: {status} [{len(where)} rows, e.g. {where[0]}]")
    log("\n" + md)
    log(f"wrote {json_path} ({results['wall_s']:.0f} s)")
    wrong = [r for r in results["rows"] if r.get("check", "pass").startswith("fail")]
    return 1 if wrong else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--only", choices=("rms_norm", "permute"), help="one op only")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="where results go")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="start no new shape after this many seconds (results so far are kept)")
    args = parser.parse_args(argv)
    return gpu_main(args) if GPU else cpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
