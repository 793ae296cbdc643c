"""Where an eager torch call of xkern spends the host's time, with every kernel launch stubbed out: the
Python path alone (checks, cache lookup, autograd, allocations), beside torch's own floor for the same work.

    python -m tools.host_profile [--device cpu|cuda] [--loop 20000] [--rounds 5] [--real] [--parts]
                                 [--profile PATH] [--top 25]

Every xkern launch is a no-op (`_Launcher.__call__`: the outputs are allocated, no kernel runs), so it runs on
a CPU machine (Triton's interpreter is switched on, never entered; the executors allocate through the CPU
twin of the CUDA path's allocator entry, as on a GPU) as well as on a GPU (`--real` there keeps the
launches). Per path (forward; forward + backward through `torch.autograd.grad`; backward alone, through
one kept forward) it prints µs per call, taken in rounds in turn (`benchmarks.timing.host_us_rounds`: a tight
loop, one synchronize), for:
- xkern: the public function (`torch_api.rms_norm`, ...) on plain tensors, inputs from
  `benchmarks.host` (the host table's);
- torch: the native peer (`F.rms_norm`; on the CPU it computes, its time is not a floor);
- floor: an autograd.Function (C++ apply, as xkern's) whose forward and backward only allocate the outputs
  xkern's executors allocate, the same way (the executors' code, launches no-ops), and save
  nothing: what any Python-defined op with these outputs pays torch (the forward alone: the allocations).
  xkern − floor is xkern's own Python, with the saving of its inputs for the backward (~0.5 µs on a CPU).
`--profile PATH` (e.g. "rms_norm fwd+bwd") adds cProfile's top functions of that path's xkern call, `--parts`
rms_norm's eager path timed step by step.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import os
import pstats
import statistics
import sys


def setup_device(device: str | None) -> str:
    """The device to profile on: CUDA where there is one, else the CPU with Triton's interpreter (which must
    be chosen before triton is imported: the kernels are never run, but the front end takes CPU tensors only
    under it)."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise RuntimeError("CPU profiling needs TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    return device


@contextlib.contextmanager
def cuda_allocations(device: str):
    """Inside the block, executors built on the CPU allocate as they do on CUDA: the executors' path
    through the caching allocator's entry point (`_empty_strided_cpu`, the twin of the CUDA one: no
    torch.empty argument parsing), which torch.empty would otherwise take on the CPU. Executors built in the
    block are cached apart (`executor_cache`) and dropped after it."""
    import torch

    from torch_api import _launch

    alloc = getattr(torch._C._dynamo.guards, "_empty_strided_cpu", None)
    with _launch.executor_cache():
        if device != "cpu" or alloc is None:
            yield
            return
        saved = _launch._ALLOC, _launch._CURRENT_DEVICE
        _launch._ALLOC, _launch._CURRENT_DEVICE = alloc, lambda: None  # a CPU tensor's device index is None
        try:
            yield
        finally:
            _launch._ALLOC, _launch._CURRENT_DEVICE = saved


@contextlib.contextmanager
def stubbed_launches(launched: list | None = None):
    """Inside the block every eager xkern launch does nothing (appending its kernel's name to `launched`); the
    executors still allocate every output."""
    from torch_api._launch import _Launcher

    real = _Launcher.__call__

    def stub(self, arrays, device):
        if launched is not None:
            launched.append(self.plan.kernel.fn.__name__)

    _Launcher.__call__ = stub
    try:
        yield launched
    finally:
        _Launcher.__call__ = real


@functools.cache
def _floor_function():
    import torch

    class AllocOnly(torch.autograd.Function):
        """The floor: forward and backward allocate the op's outputs (`fwd`, `bwd`: executors whose launches
        do nothing) and nothing else; gradients for the first `len(bwd outputs)` inputs. A forward apart from
        its setup_context, as xkern's (the form torch.func transforms take)."""

        @staticmethod
        def forward(fwd, bwd, *inputs):
            out = fwd(*inputs)
            return out[0] if len(out) == 1 else tuple(out)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.bwd, ctx.n = inputs[1], len(inputs) - 2

        @staticmethod
        def backward(ctx, *grads):
            got = ctx.bwd(*grads)
            return None, None, *got, *(None,) * (ctx.n - len(got))

    from torch_api._launch import raw_apply

    return raw_apply(AllocOnly)


def _alloc_only(recipe, input_names: tuple[str, ...], shapes: dict | None = None):
    """`recipe`'s allocations, the way its eager executor makes them, its launches no-ops: called with one or
    more tensors, the first giving the device."""
    from torch_api._launch import Executor

    run = Executor(recipe, input_names, shapes, wrap=lambda _: lambda arrays, device: None).run
    k = len(input_names)
    return lambda first, *_: run(*(first,) * k)


def _grad_paths(name: str, fn, inputs: tuple, wrt: tuple, dys: tuple, fwd=None) -> dict:
    """{(name, path): call} for fwd (`fwd`, default `fn`, on `inputs`), fwd+bwd (`torch.autograd.grad` of
    `fn` on `wrt`) and bwd (through one kept forward)."""
    import torch

    def fwd_bwd():
        out = fn(*wrt)
        return torch.autograd.grad(out, wrt, dys)

    kept = {}

    def bwd():
        if "out" not in kept:
            kept["out"] = fn(*wrt)
        return torch.autograd.grad(kept["out"], wrt, dys, retain_graph=True)

    return {(name, "fwd"): functools.partial(fwd or fn, *inputs), (name, "fwd+bwd"): fwd_bwd, (name, "bwd"): bwd}


def _floor_paths(name: str, fwd, bwd, inputs: tuple, wrt: tuple, dys: tuple) -> dict:
    """The floor's paths: the forward alone is `fwd`'s allocations (xkern's forward skips autograd where no
    input requires grad); with autograd, the allocate-only Function of `fwd` and `bwd`."""
    floor = _floor_function()
    return _grad_paths(name, lambda *a: floor(fwd, bwd, *a), inputs, wrt, dys, fwd=fwd)


def entries(device: str) -> dict:
    """{(op, path): {impl: call}}: xkern, the native torch peer, and the floor."""
    import torch
    import torch.nn.functional as F

    import torch_api as tp
    from benchmarks.host import rms_inputs
    from benchmarks.rms_norm import EPS
    from xkern.add_rms_norm import add_rms_norm_bwd_recipe, add_rms_norm_fwd_recipe
    from xkern.permute import permute_recipe, unpermute_recipe
    from xkern.rms_norm import rms_norm_bwd_recipe, rms_norm_fwd_recipe

    table: dict = {}

    def add(impl, calls):
        for key, call in calls.items():
            table.setdefault(key, {})[impl] = call

    # RMSNorm: x [M, N] bf16 with its weight
    x, w, dy, xg, wg = rms_inputs(device)
    m, n = x.shape
    add("xkern", _grad_paths("rms_norm", lambda a, b: tp.rms_norm(a, b, EPS), (x, w), (xg, wg), (dy,)))
    add("torch", _grad_paths("rms_norm", lambda a, b: F.rms_norm(a, (n,), b, EPS), (x, w), (xg, wg), (dy,)))
    fwd = _alloc_only(rms_norm_fwd_recipe(m, n, EPS, "bfloat16", "bfloat16", n, "llama"), ("x", "w"), {"y": x.shape})
    bwd = _alloc_only(rms_norm_bwd_recipe(m, n, EPS, "bfloat16", "bfloat16", n, n, variant="llama"),
                      ("x", "w", "dy"), {"dx": x.shape, "dw": w.shape})
    add("floor", _floor_paths("rms_norm", fwd, bwd, (x, w), (xg, wg), (dy,)))

    # The fused residual add: (y, residual_out) from x, residual, w
    r, rg = x.flip(0).contiguous(), x.flip(0).contiguous().requires_grad_()
    dres = dy.flip(1).contiguous()
    add("xkern", _grad_paths("add_rms_norm", lambda a, b, c: tp.add_rms_norm(a, b, c, EPS), (x, r, w), (xg, rg, wg),
                             (dy, dres)))

    def add_then_norm(a, b, c):
        s = a + b
        return F.rms_norm(s, (n,), c, EPS), s

    add("torch", _grad_paths("add_rms_norm", add_then_norm, (x, r, w), (xg, rg, wg), (dy, dres)))
    fwd = _alloc_only(add_rms_norm_fwd_recipe(m, n, EPS, "bfloat16", "bfloat16", "bfloat16", "bfloat16", n, n,
                                              "llama"), ("x", "r", "w"), {"y": x.shape, "residual_out": x.shape})
    bwd = _alloc_only(add_rms_norm_bwd_recipe(m, n, EPS, "bfloat16", "bfloat16", "bfloat16", True, n, n, n,
                                              variant="llama"), ("x", "w", "dy", "dres"),
                      {"dx": x.shape, "dw": w.shape})
    bwd = _twice_first(bwd)  # d(sum) serves x and residual alike, as xkern's backward returns it
    add("floor", _floor_paths("add_rms_norm", fwd, bwd, (x, r, w), (xg, rg, wg), (dy, dres)))

    # The MoE row gather: permute_rows (backward: unpermute_rows) of T x top-8 rows
    rows, h = 8 * x.shape[0], x.shape[1]
    gen = torch.Generator().manual_seed(7)
    idx = torch.randperm(rows, generator=gen).to(device=device, dtype=torch.int32)
    xr = torch.randn(rows, h, generator=gen).to(device=device, dtype=torch.bfloat16)
    xrg, dout = xr.detach().requires_grad_(), xr.flip(0).contiguous()
    add("xkern", _grad_paths("permute_rows", lambda a: tp.permute_rows(a, idx), (xr,), (xrg,), (dout,)))
    idx64 = idx.long()
    add("torch", _grad_paths("permute_rows", lambda a: a.index_select(0, idx64), (xr,), (xrg,), (dout,)))
    fwd = _alloc_only(permute_recipe(rows, h, rows, "bfloat16", h, 1), ("x", "idx"))
    bwd = _alloc_only(unpermute_recipe(rows, h, rows, "bfloat16", h, "int32", 1, None), ("y", "idx"))
    add("floor", _floor_paths("permute_rows", fwd, bwd, (xr,), (xrg,), (dout,)))
    return table


def _twice_first(run):
    """A backward's allocations giving its first output twice (x's and residual's gradient), then the rest."""
    def twice(*grads):
        out = run(*grads)
        return [out[0], out[0], *out[1:]]
    return twice


def measure(device: str, loop: int, rounds: int, real: bool = False) -> list[dict]:
    """One row per (op, path): µs per call (median and min over the rounds) of each implementation."""
    import torch

    from benchmarks import timing

    sync = (lambda _: torch.cuda.synchronize()) if device == "cuda" else (lambda _: None)
    with cuda_allocations(device), contextlib.nullcontext() if real else stubbed_launches():
        table = entries(device)
        calls = {(op, path, impl): call for (op, path), impls in table.items() for impl, call in impls.items()}
        got = timing.host_us_rounds(calls, sync, loop, rounds)
    rows = []
    for (op, path), impls in table.items():
        row = {"op": op, "path": path}
        for impl in impls:
            res = got[(op, path, impl)]
            if isinstance(res, BaseException):
                row[impl] = f"error: {type(res).__name__}: {res}"
                continue
            walls = [wall for wall, _ in res]
            row[impl] = statistics.median(walls)
            row[impl + "_min"] = min(walls)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    """The table: µs per call, median of the rounds (min in parentheses); xkern over the floor."""
    def cell(row, impl):
        v = row.get(impl)
        return v if isinstance(v, str) or v is None else f"{v:.2f} ({row[impl + '_min']:.2f})"

    lines = ["| op | path | xkern µs | floor µs | xkern − floor | xkern / floor | torch µs | xkern / torch |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ours, base, peer = (row.get(k) for k in ("xkern", "floor", "torch"))
        nums = all(isinstance(v, float) for v in (ours, base, peer))
        lines.append(f"| {row['op']} | {row['path']} | {cell(row, 'xkern')} | {cell(row, 'floor')} | "
                     + (f"{ours - base:.2f} | {ours / base:.2f} | " if nums else " | | ")
                     + f"{cell(row, 'torch')} | " + (f"{ours / peer:.2f} |" if nums else " |"))
    return "\n".join(lines)


def parts(device: str, loop: int, rounds: int, real: bool = False) -> list[tuple[str, float]]:
    """(step, µs per call, the min over the rounds) of rms_norm's eager path taken apart, on cached
    signatures: the steps of a forward without autograd, then those of the backward, each executor beside
    its run alone (the allocations and launches: the floor's share)."""
    import torch

    import torch_api
    from benchmarks import timing
    from benchmarks.host import rms_inputs
    from benchmarks.rms_norm import EPS
    from torch_api import _launch

    rn = sys.modules["torch_api.rms_norm"]  # the module (torch_api.rms_norm is also the function)
    x, w, dy, xg, wg = rms_inputs(device)
    sync = (lambda _: torch.cuda.synchronize()) if device == "cuda" else (lambda _: None)
    with cuda_allocations(device), contextlib.nullcontext() if real else stubbed_launches():
        y = torch_api.rms_norm(xg, wg, EPS)
        torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)  # both executors built
        key = ("rms_norm_fwd", _launch.signature(x), _launch.signature(w), EPS, "llama")
        fwd = _launch.cached(key, None)
        bwd_key = ("rms_norm_bwd", _launch.signature(dy), _launch.signature(x), _launch.signature(w), EPS, "llama")
        bwd = _launch.cached(bwd_key, None)
        steps = {
            "rms_norm(x, w): the whole forward, no autograd": functools.partial(torch_api.rms_norm, x, w, EPS),
            "  direct(x, w): how the call runs": functools.partial(_launch.direct, x, w),
            "  the key: two signatures": lambda: ("rms_norm_fwd", _launch.signature(x), _launch.signature(w), EPS,
                                                  "llama"),
            "  cached(key): the lookup": functools.partial(_launch.cached, key, None),
            "  the executor: in-place check, allocation, launch": functools.partial(fwd, x, w),
            "    its run: allocation, launch (the floor)": functools.partial(fwd.run.run, x, w),
            "backward of a kept forward: torch.autograd.grad": lambda: torch.autograd.grad(y, (xg, wg), dy,
                                                                                          retain_graph=True),
            "  the key: three signatures": lambda: ("rms_norm_bwd", _launch.signature(dy), _launch.signature(x),
                                                    _launch.signature(w), EPS, "llama"),
            "  _backward_direct: key, lookup, executor": functools.partial(rn._backward_direct, dy, x, w, EPS,
                                                                           "llama"),
            "    its run: 3 allocations, 2 launches (the floor)": functools.partial(bwd.run.run, x, w, dy),
        }
        got = timing.host_us_rounds(steps, sync, loop, rounds)
    return [(name, min(wall for wall, _ in got[name])) for name in steps]


def profile(device: str, key: str, calls: int, top: int, real: bool = False) -> str:
    """cProfile's `top` functions by own time over `calls` calls of path `key` ("op path") of xkern."""
    op, path = key.rsplit(" ", 1)
    with cuda_allocations(device), contextlib.nullcontext() if real else stubbed_launches():
        call = entries(device)[(op, path)]["xkern"]
        for _ in range(50):
            call()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            call()
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where there is one")
    parser.add_argument("--loop", type=int, default=20000, help="calls per implementation, over all rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--real", action="store_true", help="keep the launches (CUDA only)")
    parser.add_argument("--profile", metavar="PATH", help='e.g. "rms_norm fwd+bwd": cProfile of that xkern call')
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--parts", action="store_true", help="rms_norm's eager path taken apart, step by step")
    args = parser.parse_args(argv)
    device = setup_device(args.device)
    if args.real and device != "cuda":
        parser.error("--real launches kernels: CUDA only")
    stub = "launches real" if args.real else "every xkern launch stubbed (a no-op; outputs allocated)"
    print(f"host µs per call on {device} ({stub}), {args.loop} calls in {args.rounds} rounds taken in turn; "
          "median of the rounds (min)\n")
    print(markdown(measure(device, args.loop, args.rounds, args.real)))
    if args.parts:
        print("\nrms_norm's eager path taken apart (µs per call, min of the rounds):\n")
        print("\n".join(f"{us:8.2f}  {name}" for name, us in parts(device, args.loop, args.rounds, args.real)))
    if args.profile:
        print(f"\ncProfile, xkern {args.profile}, {args.loop} calls:\n")
        print(profile(device, args.profile, args.loop, args.top, args.real))


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)  # the CPU peer's compute on one thread, as the Python around it
    main()
