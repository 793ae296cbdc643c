"""The torch front end's host cost per eager call, for comparing two trees: on the CPU with every kernel launch
stubbed (default), or on a GPU with real launches (`--cuda`, one synchronize per loop, as benchmarks.host's
wall time).

    PYTHONPATH=. python benchmarks/host_front_end.py [--cuda] [--profile NAME]
    PYTHONPATH=/another/tree python benchmarks/host_front_end.py [--cuda]

The tree measured is the one first on the import path, so one script times another commit's front end too
(stubbed at `_Launcher.__call__`, which every tree's executors launch through). Public calls only, at
benchmarks.host's shape (16x4096 bf16), beside F.rms_norm and an autograd.Function that only allocates (the
floor of any Python-defined op); each loop of LOOP calls is taken in turn over ROUNDS rounds and the fastest
kept (the least disturbed by other processes on a shared machine); on the CPU, of the thread's CPU time.
`--profile NAME` prints a cProfile of that entry instead.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

CUDA = "--cuda" in sys.argv
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors pass the front end's device check only so

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_api as tp  # noqa: E402
from benchmarks.host import _alloc_only_function  # noqa: E402
from torch_api import _launch  # noqa: E402

LOOP, ROUNDS = 500, 15
_REAL_LAUNCH = _launch._Launcher.__call__


def _launches(stub: bool) -> list:
    """Count every kernel launch (each tree's executors launch through `_Launcher.__call__`) in the list
    returned; with `stub`, launch nothing."""
    count, real = [], _launch._Launcher.__call__

    def call(self, arrays, device):
        count.append(self.plan.kernel.__name__)
        if not stub:
            real(self, arrays, device)

    _launch._Launcher.__call__ = call
    return count


def entries(device: str) -> dict:
    gen = torch.Generator(device).manual_seed(7)
    x, dy, r = (torch.randn(16, 4096, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(3))
    w = torch.randn(4096, generator=gen, device=device, dtype=torch.bfloat16)
    xg, wg, rg = (t.detach().requires_grad_() for t in (x, w, r))
    grad = torch.autograd.grad
    alloc_only = _alloc_only_function()  # the host table's floor, here with two inputs of x's shape
    return {
        "floor: Function, allocations only": lambda: grad(alloc_only.apply(xg, rg), (xg, rg), dy),
        "rms_norm fwd": lambda: tp.rms_norm(x, w),
        "rms_norm fwd+bwd": lambda: grad(tp.rms_norm(xg, wg), (xg, wg), dy),
        "add_rms_norm fwd": lambda: tp.add_rms_norm(x, r, w),
        "add_rms_norm fwd+bwd": lambda: grad(tp.add_rms_norm(xg, rg, wg), (xg, rg, wg), (dy, dy)),
        "F.rms_norm fwd+bwd (computes)": lambda: grad(F.rms_norm(xg, (4096,), wg, 1e-6), (xg, wg), dy),
    }


def measure(calls: dict, sync, clock) -> dict:
    times = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            sync()
            start = clock()
            for _ in range(LOOP):
                call()
            sync()
            times[name].append((clock() - start) / LOOP * 1e6)
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", help="an entry's name: print its cProfile instead of the table")
    parser.add_argument("--cuda", action="store_true", help="on the GPU, real launches (default: CPU, stubbed)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = "cuda" if CUDA else "cpu"
    calls = entries(device)
    count = _launches(stub=not CUDA)
    launches = {}
    for name, call in calls.items():  # warm the executor caches; count each call's launches
        call()
        count.clear()
        call()
        launches[name] = len(count)
    if CUDA:  # launches counted, now the real ones alone
        _launch._Launcher.__call__ = _REAL_LAUNCH
    if args.profile:
        call = calls[args.profile]
        prof = cProfile.Profile()
        prof.runcall(lambda: [call() for _ in range(LOOP)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    print(f"torch_api from {os.path.dirname(tp.__file__)}, {device}" + ("" if CUDA else ", launches stubbed"))
    # On the CPU the thread's own CPU time: time the thread spent descheduled (a shared machine) is not counted
    timed = measure(calls, torch.cuda.synchronize, time.perf_counter) if CUDA else \
        measure(calls, lambda: None, time.thread_time)
    for name, us in timed.items():
        print(f"{name:32s} {us:7.1f} us  ({launches[name]} launches)")


if __name__ == "__main__":
    main()
