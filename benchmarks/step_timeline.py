"""Where the host time of an eager RMSNorm training step goes, across the autograd engine's threads:
`torch.autograd.grad(f(x, w), (x, w), dy)` with f = xkern's rms_norm and with an autograd.Function that only
allocates (the host table's floor), each backward timed from inside. On CUDA the engine runs a backward on
its device thread, which cProfile of the calling thread cannot see. Per step (median µs):

    release       dropping the previous step's y, and with it that step's graph (its node, saved tensors)
    forward       the call of f
    to backward   from calling torch.autograd.grad to the backward's first line (the engine's handoff)
    backward      the backward's body (xkern: checks, cache lookup, allocations, launches)
    after         from the backward's return to torch.autograd.grad's return

    python -m benchmarks.step_timeline [--steps 2000]

A diagnostic for the host table's forward + backward row; its numbers are not the benchmark's.
"""

from __future__ import annotations

import argparse
import statistics
import time


def timeline(step_kind: str, steps: int, device: str, warmup: int = 50) -> dict:
    import torch

    import torch_api
    from benchmarks.host import _alloc_only_function, rms_inputs
    from torch_api.rms_norm import _RMSNormFunction

    _, _, dy, xg, wg = rms_inputs(device)
    cls = _RMSNormFunction if step_kind == "xkern" else _alloc_only_function()
    f = (lambda: torch_api.rms_norm(xg, wg, 1e-6)) if step_kind == "xkern" else (lambda: cls.apply(xg, wg))
    marks = {}
    real = cls.__dict__["backward"]

    def timed_backward(*args):
        marks["enter"] = time.perf_counter_ns()
        out = real.__func__(*args)
        marks["exit"] = time.perf_counter_ns()
        return out

    cls.backward = staticmethod(timed_backward)
    rows = []
    y = None
    try:
        for i in range(steps + warmup):
            t_release = time.perf_counter_ns()
            y = None
            t0 = time.perf_counter_ns()
            y = f()
            t1 = time.perf_counter_ns()
            torch.autograd.grad(y, (xg, wg), dy)
            t2 = time.perf_counter_ns()
            if i >= warmup:
                rows.append((t0 - t_release, t1 - t0, marks["enter"] - t1, marks["exit"] - marks["enter"],
                             t2 - marks["exit"], t2 - t_release))
    finally:
        cls.backward = real
    if device == "cuda":
        torch.cuda.synchronize()
    names = ("release", "forward", "to backward", "backward", "after", "step")
    return {k: statistics.median(r[i] for r in rows) / 1e3 for i, k in enumerate(names)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for kind in ("xkern", "allocations only"):
        got = timeline(kind, args.steps, device)
        print(f"{kind:17s} " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()) + " (median µs)", flush=True)


if __name__ == "__main__":
    main()
