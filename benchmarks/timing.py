"""How the benchmarks time things: the copy ceiling, device time of torch and JAX work, host time per call.

- `profile_device_us`, one device-time method for both frameworks (xkern's torch and JAX rows, every JAX row,
  the JAX / torch ratio): the calls of a pass, one per rotated input set, each launched on its own (torch
  eager; JAX one jitted call per input set), in rounds under `torch.profiler` with CUDA activities (CUPTI
  records XLA's kernels too). Each round: a kernel of its own name (`_l2_flush_kernel`) writes `L2_BYTES`,
  the device is synchronized, the calls run, the device is synchronized; the round's kernels, memsets and
  copies after the flush are summed, and the median round over the calls is the time per call.
- `torch_device_us` (the torch rows' `us`): the pass's calls captured in one CUDA graph, its replays timed by
  `triton.testing.do_bench` (median, L2 flushed before each replay); where capture fails, the eager calls
  timed the same way and the row says so.
- `jax_device_us` (the JAX MoE layer step): `n` steps inside one jitted `lax.fori_loop` (two per iteration,
  so XLA needs no copy of the carry), host wall time over the steps, median of a few.
- Inputs: a shape whose working set fits in L2 is run over several input sets in turn (`n_sets`).

Smoke mode (`set_smoke(True)`; always without a CUDA GPU) runs every timed path through the same code a few
times, marked as not a measurement.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback

WARMUP_MS = 25
REP_MS = 100
L2_BYTES = 60 * 10**6          # H200 L2 (50 MB on the datasheet; rounded up for margin)
ROTATE_BYTES = 4 * L2_BYTES    # rotated input sets of a small shape add up to at least this
MAX_SETS = 16
JAX_TARGET_MS = 50             # one timed JAX call runs about this long
JAX_REPEATS = 5
PROFILE_ROUNDS = 20            # rounds of calls under the profiler; the median round counts
PROFILE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")  # the chrome trace's device activities
FLUSH_KERNEL = "_l2_flush_kernel"
SMOKE_NOTE = "smoke: run through once, not a measurement"
_smoke = False


def set_smoke(on: bool) -> None:
    global _smoke
    _smoke = on


def smoke() -> bool:
    return _smoke


def n_sets(bytes_per_call: int) -> int:
    """How many input sets to rotate among so that a call's inputs are not left in L2 by the last one."""
    if _smoke:
        return min(2, MAX_SETS)
    return max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / max(1, bytes_per_call))))


def do_bench_us(fn, warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS) -> float:
    """Median device time of `fn` in µs (triton's do_bench: CUDA events, L2 flushed before each call)."""
    import torch

    if _smoke and not torch.cuda.is_available():
        return _wall_us(fn)
    if _smoke:
        warmup_ms, rep_ms = 1, 3
    from triton.testing import do_bench

    return 1e3 * do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def _wall_us(fn, n: int = 2) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - start) / n


def copy_ceiling(nbytes: int = 2**31) -> dict:
    """Device-to-device copy of `nbytes` (random bytes): GB/s counting bytes read plus bytes written."""
    import torch

    if _smoke:
        nbytes = 2**20
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda" if torch.cuda.is_available() else "cpu")
    dst = torch.empty_like(src)
    copy = functools.partial(dst.copy_, src)
    us = do_bench_us(copy)
    del copy, src, dst
    torch.cuda.empty_cache()
    return {"bytes": 2 * nbytes, "us": us, "gbps": 2 * nbytes / us / 1e3,
            "method": SMOKE_NOTE if _smoke else f"torch copy_ of {nbytes / 2**30:g} GiB uint8, do_bench median, "
            "read + write bytes"}


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"


def torch_device_us(make_calls, eager_fallback: bool = True) -> tuple[float, str]:
    """Device time per call. `make_calls()` runs on the capture stream (so a forward made there is the one
    autograd replays on that stream) and returns one zero-argument callable per input set. Where the CUDA
    graph capture fails: the calls timed eagerly, said so in the method (`eager_fallback`, the benchmark's
    peers), or the capture's error raised (tools whose number must be device time)."""
    import torch

    if _smoke and not torch.cuda.is_available():
        calls = make_calls()
        return _wall_us(lambda: [call() for call in calls], 1) / len(calls), SMOKE_NOTE
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls = make_calls()
        for _ in range(3):  # compile, autotune, allocate outside the capture
            for call in calls:
                call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for call in calls:
                call()
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - any capture failure: time eagerly and say so
        del graph
        torch.cuda.synchronize()
        if not eager_fallback:
            raise
        us = torch_eager_us(calls)
        return us, f"do_bench of eager calls (CUDA graph capture failed: {_short(err)})"
    us = do_bench_us(graph.replay) / len(calls)
    del graph
    return us, f"CUDA graph of {len(calls)} call(s), one per input set, replayed under do_bench (median)"


def torch_eager_us(calls) -> float:
    """Per call, launched from Python: host overhead (autograd's included) shows where it exceeds the
    device time of the previous call and the L2 flush."""
    return do_bench_us(lambda: [call() for call in calls]) / len(calls)


def jax_device_us(step, consts, state, est_us_per_iter: float) -> tuple[float, str]:
    """Device time per iteration of `state = step(consts, state)` run inside one jitted fori_loop.

    `consts` (weights, indices, vjp residuals) are arguments, not closures, so they are not baked into the
    program as constants. `state` is donated; pass fresh copies."""
    import jax

    n = 2 if _smoke else 2 * max(1, min(50_000, round(JAX_TARGET_MS * 1e3 / max(est_us_per_iter, 1.0) / 2)))
    repeats = 1 if _smoke else JAX_REPEATS

    # Two steps per loop iteration: with one, an out-of-place custom call (a Triton kernel) cannot write
    # the loop carry's buffer (its input is still live there), so XLA adds a copy of the whole state every
    # iteration (seen in the compiled HLO). With two, the second step writes where the first one read.
    def _loop(consts, state):
        return jax.lax.fori_loop(0, n // 2, lambda i, s: step(consts, step(consts, s)), state)

    loop = jax.jit(_loop, donate_argnums=1)
    state = jax.block_until_ready(loop(consts, state))  # compile and warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state = jax.block_until_ready(loop(consts, state))
        times.append(time.perf_counter() - start)
    del state
    if _smoke:
        return 1e6 * times[0] / n, SMOKE_NOTE
    return 1e6 * statistics.median(times) / n, f"jit(fori_loop) of {n} calls, two per iteration, host wall / calls, " \
        f"median of {repeats}"


def host_us_per_call(call, sync, n: int = 2000) -> tuple[float, float]:
    """(wall, issue) µs per call of a tight Python loop of `n` calls synchronized once at the end: wall
    counts the final synchronize, issue stops before it (the host's own time while the device keeps up)."""
    n = 2 if _smoke else n
    for _ in range(2 if _smoke else 20):
        out = call()
    sync(out)
    start = time.perf_counter()
    for _ in range(n):
        out = call()
    issued = time.perf_counter()
    sync(out)
    end = time.perf_counter()
    return 1e6 * (end - start) / n, 1e6 * (issued - start) / n


def host_us_rounds(calls: dict, sync, n: int = 2000, rounds: int = 5) -> dict:
    """`host_us_per_call` of several calls measured in turn: `rounds` rounds of `n / rounds` calls of each.
    The host's speed drifts by tens of percent within minutes; taken in turn, the calls compared see the
    same drift. Returns {key: [(wall, issue) per round]} or {key: exception} for a call that raised (it is
    left out of the later rounds)."""
    rounds = 1 if _smoke else rounds
    per_round = max(1, n // rounds)
    got: dict = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            if isinstance(got[key], BaseException):
                continue
            try:
                got[key].append(host_us_per_call(call, sync, per_round))
            except Exception as err:  # noqa: BLE001 - one failing call must not stop the others
                got[key] = err
    return got


def host_us_interleaved(calls: dict, sync, n: int = 2000, rounds: int = 5) -> dict:
    """`host_us_rounds`, the median per call: {key: (wall, issue)} or {key: exception}."""
    return {key: v if isinstance(v, BaseException) else
            (statistics.median(w for w, _ in v), statistics.median(i for _, i in v))
            for key, v in host_us_rounds(calls, sync, n, rounds).items()}


def error_status(err: BaseException) -> str:
    """A result row's status for a failed implementation; the traceback's last frames go to stderr."""
    print("".join(traceback.format_exception(err, limit=-4)), file=sys.stderr, flush=True)
    return f"error: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


# ---------------------------------------------------------------------------------------------------
# One device-time method for torch and JAX: the profiler's kernels


@functools.cache
def _flusher():
    """(kernel, buffer): a Triton kernel named `FLUSH_KERNEL` and the `L2_BYTES` it writes. Made on first use:
    importing triton here at import time would precede a caller's TRITON_INTERPRET."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _l2_flush_kernel(buf, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(buf + offs, tl.zeros([BLOCK], tl.int32), mask=offs < n)

    return _l2_flush_kernel, torch.empty(L2_BYTES // 4, dtype=torch.int32, device="cuda")


def l2_flush() -> None:
    """Evict L2 by writing `L2_BYTES` with a kernel whose name (`FLUSH_KERNEL`) marks a round's start."""
    kernel, buf = _flusher()
    kernel[(-(-buf.numel() // 4096),)](buf, buf.numel(), BLOCK=4096)


def device_activities(trace: dict) -> list[dict]:
    """The device's activities in a chrome trace (torch.profiler's export): {name, cat, ts, dur} in µs,
    by start time."""
    return sorted(({"name": e["name"], "cat": e["cat"], "ts": float(e["ts"]), "dur": float(e["dur"])}
                   for e in trace.get("traceEvents", [])
                   if e.get("ph") == "X" and e.get("cat") in PROFILE_CATEGORIES), key=lambda e: e["ts"])


def rounds_after_flush(events: list[dict]) -> list[list[dict]]:
    """`events` split at the flush kernels: the activities after each flush (the flushes left out)."""
    rounds: list[list[dict]] = []
    for e in events:
        if FLUSH_KERNEL in e["name"]:
            rounds.append([])
        elif rounds:
            rounds[-1].append(e)
    return rounds


def per_call(rounds: list[list[dict]], n_calls: int) -> tuple[float, list[dict]]:
    """(median round's summed duration / n_calls, kernels: one entry per activity name with its count and µs
    per call, over every round, longest first)."""
    if not rounds or not all(rounds):
        raise RuntimeError(f"the profiler recorded no device activity in {sum(not r for r in rounds)} of "
                           f"{len(rounds)} rounds (CUPTI saw no kernels of these calls)")
    us = statistics.median(sum(e["dur"] for e in r) for r in rounds) / n_calls
    kernels: dict = {}
    for e in (e for r in rounds for e in r):
        k = kernels.setdefault(e["name"], {"name": e["name"], "cat": e["cat"], "count": 0, "us": 0.0})
        k["count"] += 1
        k["us"] += e["dur"]
    scale = len(rounds) * n_calls
    out = [dict(k, count=k["count"] / scale, us=k["us"] / scale) for k in kernels.values()]
    return us, sorted(out, key=lambda k: -k["us"])


def profile_device_us(calls, sync, rounds: int = PROFILE_ROUNDS) -> tuple[float, str, list[dict]]:
    """(device µs per call, method, kernels per call) of `calls` (zero-argument callables, one per input set,
    each returning its outputs): `rounds` rounds of an L2 flush then every call once, under torch.profiler
    with CUDA activities; each round's device activities summed, the median round / len(calls). `sync(outs)`
    waits for the outputs (torch.cuda.synchronize, jax.block_until_ready)."""
    import torch

    if _smoke and not torch.cuda.is_available():
        start = time.perf_counter()
        sync([call() for call in calls])
        return 1e6 * (time.perf_counter() - start) / len(calls), SMOKE_NOTE, []
    rounds = 2 if _smoke else rounds
    for _ in range(3):  # compile, autotune, allocate outside the trace
        outs = [call() for call in calls]
    sync(outs)
    torch.cuda.synchronize()
    del outs
    # The flush runs on torch's stream and JAX's calls on XLA's: both synchronized around each round, so that
    # the rounds follow one another on the device and every call starts after its round's flush.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            l2_flush()
            torch.cuda.synchronize()
            outs = [call() for call in calls]
            sync(outs)
            torch.cuda.synchronize()
            del outs  # each call's outputs were made (and returned); freeing them keeps memory flat
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    us, kernels = per_call(rounds_after_flush(device_activities(trace))[:rounds], len(calls))
    method = SMOKE_NOTE if _smoke else (
        f"profiler: device activities per call (CUPTI), {len(calls)} call(s) per round, one per input set, "
        f"L2 flushed before each round, median of {rounds} rounds")
    return us, method, kernels


def torch_sync(outs) -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def jax_sync(outs) -> None:
    import jax

    jax.block_until_ready(outs)


def training_step_ms(step, zero_grad, steps: int, device: str) -> tuple[float, float | None]:
    """A training loop's view of `step()` (forward, backward, optimizer; already warmed up): (median ms of
    `steps` calls, CUDA events around each, eager, host gaps included; peak MiB of one more step above what was
    allocated before it, after `zero_grad()`; None off CUDA). Without CUDA, host wall time."""
    import torch

    peak = None
    if device == "cuda":
        zero_grad()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    times = []
    for _ in range(steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times), peak
