"""Where the host time of the Llama-style block's compiled step goes (`benchmarks/host.py`'s block), per
mode (compile, reduce-overhead) and norm (xkern, HF eager): wall µs per step, Inductor's counters (CUDA
graph skips among them), the top functions of a cProfile of the steps, and Inductor's generated code.

    python -m benchmarks.block_profile --out DIR [--steps 200] [--modes compile,reduce-overhead] [--code]

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
    args = parser.parse_args()
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    from benchmarks.host import BLOCK, _block_step

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = BLOCK[device]
    os.makedirs(args.out, exist_ok=True)
    report = []
    modes = [m for m in args.modes.split(",") if device == "cuda" or m == "compile"]
    for mode in modes:
        for norm in ("xkern", "HF eager"):
            torch._dynamo.reset()
            counters.clear()
            step = _block_step(mode, norm, cfg, device)
            _, codes = run_and_get_code(step)
            for i, code in enumerate(codes if args.code else ()):
                with open(os.path.join(args.out, f"block-{mode}-{norm.split()[0]}-{i}.py"), "w") as f:
                    f.write(code)
            for _ in range(10):
                step()
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync()
            wall = (time.perf_counter() - start) / args.steps * 1e6
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                step()
            sync()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
            launches = sum(code.count(".run(") for code in codes)
            report += [f"## {mode}, {norm} norm: {wall:.0f} µs per step (wall), {len(codes)} generated modules, "
                       f"{launches} '.run(' calls in them",
                       f"inductor counters: {dict(counters['inductor'])}", text.getvalue()]
            print(report[-3], flush=True)
    with open(os.path.join(args.out, "block_profile.txt"), "w") as f:
        f.write("\n".join(report))


if __name__ == "__main__":
    main()
