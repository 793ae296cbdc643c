"""Where the host time of the Llama-style block's compiled step goes (`benchmarks/host.py`'s block), per
mode (compile, reduce-overhead) and norm (xkern, HF eager): wall µs per step, Inductor's counters (CUDA
graph skips among them), the top functions of a cProfile of the steps, and Inductor's generated code.

    python -m tools.block_profile --out DIR [--steps 200] [--modes compile,reduce-overhead] [--code] [--together]

Writes DIR/block_profile.txt, with `--code` DIR/block-<mode>-<norm>-<i>.py (the generated modules). A diagnostic: its
numbers are not the benchmark's (that is `benchmarks.host.block_table`, timed in turn).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--modes", default="compile,reduce-overhead")
    parser.add_argument("--code", action="store_true", help="also write Inductor's generated modules")
    parser.add_argument("--together", action="store_true",
                        help="as the benchmark's table: both norms compiled in one process (no reset between), "
                             "timed in turn, then each profiled again")
    args = parser.parse_args()
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    from benchmarks import timing
    from benchmarks.host import BLOCK, _block_step

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = BLOCK[device]
    os.makedirs(args.out, exist_ok=True)
    report = []
    modes = [m for m in args.modes.split(",") if device == "cuda" or m == "compile"]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for mode in modes:
        steps = {}
        if args.together:
            torch._dynamo.reset()
        for norm in ("xkern", "HF eager"):
            if not args.together:
                torch._dynamo.reset()
            counters.clear()
            steps[norm] = step = _block_step(mode, norm, cfg, device)
            _, codes = run_and_get_code(step)
            for i, code in enumerate(codes if args.code else ()):
                with open(os.path.join(args.out, f"block-{mode}-{norm.split()[0]}-{i}.py"), "w") as f:
                    f.write(code)
            wall, profile = _profile(step, sync, args.steps)
            launches = sum(code.count(".run(") for code in codes)
            report += [f"## {mode}, {norm} norm: {wall:.0f} µs per step (wall), {len(codes)} generated modules, "
                       f"{launches} '.run(' calls in them",
                       f"inductor counters: {dict(counters['inductor'])}", profile]
            print(report[-3], flush=True)
        if args.together:  # the benchmark's own procedure: both compiled in this process, timed in turn
            turns = timing.host_us_interleaved(steps, lambda _: sync(), args.steps)
            report.append(f"## {mode}, in turn: " + ", ".join(f"{k} {v[0]:.0f} µs" for k, v in turns.items()))
            print(report[-1], flush=True)
            for norm, step in steps.items():
                wall, profile = _profile(step, sync, args.steps)
                report += [f"## {mode}, {norm} norm, after both compiled: {wall:.0f} µs per step (wall)", profile]
                print(report[-2], flush=True)
    with open(os.path.join(args.out, "block_profile.txt"), "w") as f:
        f.write("\n".join(report))


def _profile(step, sync, steps: int) -> tuple[float, str]:
    """Wall µs per step of a warm tight loop, then the top functions of a cProfile of as many steps."""
    for _ in range(10):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    wall = (time.perf_counter() - start) / steps * 1e6
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    sync()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return wall, text.getvalue()


if __name__ == "__main__":
    main()
