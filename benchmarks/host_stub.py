"""The torch front end's host cost on the CPU, kernel launches stubbed: what `benchmarks.host` measures on the
GPU, less the launches themselves, so a change to torch_api's eager path can be timed on any machine.

    TRITON_INTERPRET=1 python benchmarks/host_stub.py [--profile NAME]

The tree measured is the one first on the import path (PYTHONPATH=/some/other/tree times another commit's
front end through the same script). Every call is a public one at benchmarks.host's shape (16x4096 bf16);
each loop of LOOP calls is taken in turn over ROUNDS rounds and the fastest kept (the
least disturbed by other processes on a shared machine). `--profile NAME` prints a
cProfile of that entry instead.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import os
import pstats
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors pass the front end's device check only so

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_api as tp  # noqa: E402
from torch_api import _launch  # noqa: E402

LOOP, ROUNDS = 500, 15


def _launches() -> list:
    """Stub every kernel launch (each tree's executors launch through `_Launcher.__call__`); return a list that
    counts them."""
    count = []
    _launch._Launcher.__call__ = lambda self, arrays, device: count.append(self.plan.kernel.__name__)
    return count


def entries() -> dict:
    gen = torch.Generator().manual_seed(7)
    x, dy, r = (torch.randn(16, 4096, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    w = torch.randn(4096, generator=gen, dtype=torch.bfloat16)
    xg, wg, rg = (t.detach().requires_grad_() for t in (x, w, r))
    grad = torch.autograd.grad
    return {
        "rms_norm fwd": lambda: tp.rms_norm(x, w),
        "rms_norm fwd+bwd": lambda: grad(tp.rms_norm(xg, wg), (xg, wg), dy),
        "add_rms_norm fwd": lambda: tp.add_rms_norm(x, r, w),
        "add_rms_norm fwd+bwd": lambda: grad(tp.add_rms_norm(xg, rg, wg), (xg, rg, wg), (dy, dy)),
        "F.rms_norm fwd+bwd (computes)": lambda: grad(F.rms_norm(xg, (4096,), wg, 1e-6), (xg, wg), dy),
    }


def measure(calls: dict) -> dict:
    times = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(LOOP):
                call()
            times[name].append((time.perf_counter() - start) / LOOP * 1e6)
    return {name: min(t) for name, t in times.items()}


def _steady_malloc() -> None:
    """Keep freed CPU buffers in glibc's heap: by default a buffer of 128 KiB or more is mmap'ed and unmapped
    per call, which cost tens of µs per fwd+bwd here and drowned the front end's own cost (the GPU's caching
    allocator pays nothing like it)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", help="an entry's name: print its cProfile instead of the table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _steady_malloc()
    count = _launches()
    calls = entries()
    launches = {}
    for name, call in calls.items():  # warm the executor caches; count each call's launches
        call()
        count.clear()
        call()
        launches[name] = len(count)
    if args.profile:
        call = calls[args.profile]
        prof = cProfile.Profile()
        prof.runcall(lambda: [call() for _ in range(LOOP)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    print(f"torch_api from {os.path.dirname(tp.__file__)}")
    for name, us in measure(calls).items():
        print(f"{name:32s} {us:7.1f} us  ({launches[name]} launches)")


if __name__ == "__main__":
    main()
