"""Where the index ops' one-launch regime should end (`xkern.permute.one_launch`, ONE_LAUNCH_SLOTS): unpermute_rows,
inverse_permutation and generate_permute_indices timed in both regimes at slot counts around the threshold, on
the main benchmark's routing (T tokens x top-8 over 8 ranks x 8 experts, alignment 16, bf16 rows of H).

Per op, slot count and regime: device µs (a CUDA graph of one call, replayed under do_bench) and host wall µs
per eager call (a tight loop, one synchronize; the two regimes taken in turn), and the host's launch floor
(an empty kernel through xkern's launcher): what one launch fewer saves depends on it. The results of both regimes
are checked equal bit for bit (pure data movement) before anything is timed. Above 4096 slots the one-launch
generate spills (its one block holds every slot; docs/design.md), so its rows there bound a looped form.

    python -m tools.index_threshold [--tokens 64,128,256,384,512,768,1024] [--hidden 4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os

# (ONE_LAUNCH_SLOTS, SEARCH_ROWS) forcing each regime; the second one-launch form gives the searches 16 rows
# per program instead of 64: 4x the programs, each scanning the slots in 4x fewer steps (the same compares
# per thread), for the inverse's search, which 64-row programs leave at 8 programs for 512 rows.
REGIMES = {"one launch": (1 << 30, None), "one launch, 16-row searches": (1 << 30, 16), "two launches": (0, None)}


@contextlib.contextmanager
def regime(slots_limit: int, search_rows: int | None = None):
    """Every index op planned with ONE_LAUNCH_SLOTS = `slots_limit` and SEARCH_ROWS = `search_rows` (None: the
    plan's), recipes and eager executors rebuilt."""
    from torch_api._launch import executor_cache
    from xkern import permute
    from xkern.permute import plans as permute_plans

    def clear():
        for recipe in (permute.inverse_recipe, permute.unpermute_recipe, permute.generate_recipe):
            recipe.cache_clear()

    saved = permute_plans.ONE_LAUNCH_SLOTS, permute_plans.SEARCH_ROWS
    permute_plans.ONE_LAUNCH_SLOTS, permute_plans.SEARCH_ROWS = slots_limit, search_rows or permute_plans.SEARCH_ROWS
    clear()
    try:
        with executor_cache():  # executors built on this regime's plans, apart from the process's
            yield
    finally:
        permute_plans.ONE_LAUNCH_SLOTS, permute_plans.SEARCH_ROWS = saved
        clear()


def _calls(t: int, h: int, device: str) -> tuple[int, dict]:
    """(slots, {op: zero-argument call}) on the benchmark's routing for t tokens."""
    import torch

    import torch_api as tp
    from benchmarks import permute as P

    counts, n, n_pad = P.routing(t, h)
    counts_t = torch.from_numpy(counts).to(device)
    idx = P.layout(counts_t, n_pad, tp)
    y = torch.randn(n_pad, h, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(t)).to(device)
    return n_pad, {
        "unpermute_rows": functools.partial(tp.unpermute_rows, y, idx, n),
        "inverse_permutation": functools.partial(tp.inverse_permutation, idx, n),
        "generate_permute_indices": functools.partial(P.layout, counts_t, n_pad, tp),
    }


def _bound(op, executors: dict):
    """`op` run with this regime's eager executors."""
    from torch_api._launch import executor_cache

    def call():
        with executor_cache(executors):
            return op()

    return call


def measure(tokens: list[int], h: int, device: str, log=print) -> list[dict]:
    return [row for t in tokens for row in _measure_one(t, h, device, log)]


def _measure_one(t: int, h: int, device: str, log) -> list[dict]:
    import torch

    from benchmarks import timing
    from benchmarks.host import _sync
    from torch_api._launch import executor_cache

    results, devices, calls, counts = {}, {}, {}, {}
    for name, (limit, search_rows) in REGIMES.items():
        with regime(limit, search_rows):
            n_pad, ops = _calls(t, h, device)
            executors, counts[name], results[name] = {}, {}, {}
            for op, call in ops.items():  # each op's executors built alone, to count its launches
                with executor_cache() as built:
                    results[name][op] = call()
                counts[name][op] = sum(ex.launches for ex in built.values())
                executors.update(built)
            bound = {op: _bound(call, executors) for op, call in ops.items()}
            devices[name] = {op: timing.torch_device_us(lambda call=call: [call], eager_fallback=False)[0]
                             for op, call in bound.items()}
            calls.update({(op, name): call for op, call in bound.items()})  # host: timed in turn below
    for op in results["two launches"]:
        if not all(torch.equal(got[op], results["two launches"][op]) for got in results.values()):
            raise AssertionError(f"{op} at {n_pad} slots: the regimes' results differ")
    rows = []
    for (op, name), got in timing.host_us_interleaved(calls, _sync(device)).items():
        if isinstance(got, BaseException):
            raise got
        rows.append({"op": op, "regime": name, "tokens": t, "slots": n_pad, "hidden": h,
                     "launches": counts[name][op], "device_us": devices[name][op], "wall_us": got[0],
                     "issue_us": got[1]})
        log(f"{op:25s} {n_pad:6d} slots  {name:27s}  device {devices[name][op]:7.1f} µs  wall {got[0]:6.1f} µs")
    return rows


def launch_floor_us(device: str) -> float:
    """Host wall µs of an empty kernel launched through xkern's launcher. What a launch saves depends on it:
    on H200 hosts measured on 2026-12-04 it took 5.9-7.9 µs, and a second launch cost a call 10-15 µs there,
    but about nothing on another H200 host (docs/benchmarks.md, entry 18)."""
    import torch

    from benchmarks import timing
    from benchmarks.host import _sync, xkern_launch_floor

    return timing.host_us_per_call(xkern_launch_floor(torch.zeros(16, device=device)), _sync(device), 2000)[0]


def table(rows: list[dict]) -> str:
    lines = ["| op | slots | " + " | ".join(f"{k}: device / wall µs" for k in REGIMES) + " |",
             "|---|---|" + "---|" * len(REGIMES)]
    by = {}
    for r in rows:
        by.setdefault((r["op"], r["slots"]), {})[r["regime"]] = r
    for (op, slots), got in by.items():
        cells = [f"{got[k]['device_us']:.1f} / {got[k]['wall_us']:.1f}" for k in REGIMES]
        lines.append(f"| {op} | {slots} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="64,128,256,384,512,768,1024")  # ~512 to ~8300 slots
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--out")
    args = parser.parse_args()
    import torch

    from benchmarks import timing

    device = "cuda" if torch.cuda.is_available() else "cpu"
    timing.set_smoke(device == "cpu")  # CPU: runs once, no timing is a measurement
    rows = measure([int(t) for t in args.tokens.split(",")], args.hidden, device)
    print(table(rows))
    floor = launch_floor_us(device)
    print(f"this host's floor: an empty kernel through xkern's launcher, {floor:.1f} µs per call")
    if args.out:
        name = torch.cuda.get_device_name().lower().replace(" ", "-") if device == "cuda" else "cpu"
        path = os.path.join(args.out, f"{name}-index-threshold.json")
        with open(path, "w") as f:
            json.dump({"device": device, "launch_floor_us": floor, "rows": rows}, f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
