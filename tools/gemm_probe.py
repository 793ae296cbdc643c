"""xkern's grouped GEMM (`xkern.grouped_mm`) at the MoE step's six GEMMs, candidate tiles against torch._grouped_mm.

    python -m tools.gemm_probe [--sizes qwen3-moe,deepseek-v3] [--out DIR] [--torch-layout] [--smoke]

The GEMMs of benchmarks/moe_layer.py's step at its sizes: the up projection w13 [E, H, 2I] and the down projection
w2 [E, I, H], each forward (y = x @ w[e]), dx (dy @ w[e].T: the rows kernel reading w transposed) and dw (x_e.T @
dy_e), on the padded expert-major layout of the benchmark's router (`route`, `xkern_layout`; the rows of the up
projection are `permute_rows` of its tokens). Weights are contiguous [E, K, N] (jax.lax.ragged_dot's layout);
`--torch-layout` makes them the transpose of a contiguous [E, N, K], as the torch step's `w13.transpose(-2, -1)`
(the forward then reads K-contiguous weights and dx N-contiguous ones: the other binary of each).

Each candidate tile (`GemmTile`: block_m, block_n, block_k, warps, stages, group_m; the plans' `tile` parameter)
runs through the eager executor (`torch_api._launch.Executor`) on the core's recipe and is timed with
`benchmarks.timing.do_bench_us` (median device time, L2 flushed); torch: `torch._grouped_mm` on the same operands
(the torch step's GEMM; dw as its backward computes it, `torch._grouped_mm(x.t(), dy, offs)`). Printed per
candidate: ms, TFLOP/s (2 S K N over all S slots, as tools.mgpu_probe counts), whether it is the plan's result bit
for bit, and its largest difference from torch's relative to torch's largest element (rows before the last offset;
`ok` within 2**-7: two bf16 ULPs at the top magnitude; where torch refuses the operands as they are, contiguous
copies of them, and where it refuses those too, no comparison). Then the fastest `ok` candidate per GEMM and per form
(summed over both projections). JSON of every time: `<out>/gemm-probe-<size>.json`, written after each size.
`--smoke` (or no GPU): the smoke size, each call timed once, on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from xkern.grouped_mm import GemmTile, grouped_mm_dw_recipe, grouped_mm_dx_recipe, grouped_mm_recipe

# (block_m, block_n, block_k, num_warps, num_stages, group_m); the first is the plan's bf16 tile
ROWS_CANDIDATES = (GemmTile(128, 128, 64, 8, 3, 8), GemmTile(128, 128, 64, 8, 4, 8), GemmTile(128, 256, 64, 8, 3, 8),
                   GemmTile(128, 256, 64, 8, 4, 8), GemmTile(128, 128, 64, 4, 4, 8), GemmTile(256, 128, 64, 8, 3, 8),
                   GemmTile(128, 128, 128, 8, 3, 8), GemmTile(128, 128, 64, 8, 3, 16))
# dw: block_m x block_n of dw[e] (K x N), block_k slots per step
DW_CANDIDATES = (GemmTile(128, 128, 64, 8, 3), GemmTile(128, 128, 64, 8, 4), GemmTile(128, 256, 64, 8, 3),
                 GemmTile(128, 128, 32, 8, 4), GemmTile(128, 128, 128, 8, 3), GemmTile(64, 128, 64, 4, 4),
                 GemmTile(128, 64, 64, 4, 4), GemmTile(256, 128, 64, 8, 3))
SMOKE_CANDIDATES = 2  # candidates per form in a smoke run
REL_OK = 2.0**-7


def label(tile: GemmTile) -> str:
    return "x".join(str(v) for v in tile[:3]) + f",w{tile.num_warps},s{tile.num_stages},g{tile.group_m}"


def operands(size: dict, device: str, torch_layout: bool) -> tuple[dict, object, int]:
    """The six GEMMs' operands: {name: (form, a, b)} (forward: rows a [S, K], weights b [E, K, N]; dx: dy a [S, N],
    weights b; dw: rows a [S, K], dy b [S, N]), m_offsets, and the slot count."""
    import torch

    import torch_api
    from benchmarks import moe_layer

    inp = moe_layer.torch_inputs(size, device)
    k, e, h, i = size["top_k"], size["experts"], size["hidden"], size["inter"]
    with torch.no_grad():
        _, ids = moe_layer.route(inp["x"], inp["w_router"], k)
        slot_copy, _, _, offs = moe_layer.xkern_layout(ids, e)
        xp = torch_api.permute_rows(inp["x"], slot_copy, top_k=k)
    del inp
    n_slots = xp.shape[0]
    g = torch.Generator(device).manual_seed(2)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16).mul_(scale)

    def weight(k_dim, n_dim):
        if torch_layout:  # the torch step's w.transpose(-2, -1) of a contiguous [E, N, K]
            return rnd(e, n_dim, k_dim, scale=k_dim ** -0.5).transpose(-2, -1)
        return rnd(e, k_dim, n_dim, scale=k_dim ** -0.5)

    w13, w2 = weight(h, 2 * i), weight(i, h)
    h_rows, dy_up, dy_down = rnd(n_slots, i), rnd(n_slots, 2 * i), rnd(n_slots, h)
    gemms = {"up forward": ("forward", xp, w13), "down forward": ("forward", h_rows, w2),
             "up dx": ("dx", dy_up, w13), "down dx": ("dx", dy_down, w2),
             "up dw": ("dw", xp, dy_up), "down dw": ("dw", h_rows, dy_down)}
    return gemms, offs, n_slots


def xkern_call(form: str, a, b, offs, tile: GemmTile):
    """The eager executor of `form` on the core's recipe with `tile`: a call with no arguments."""
    from torch_api._launch import Executor, dtype_name

    n_experts, dtype = int(offs.shape[0]), dtype_name(a.dtype)
    if form == "dw":
        recipe = grouped_mm_dw_recipe(a.shape[0], a.shape[1], b.shape[1], n_experts, dtype, a.stride(0), b.stride(0),
                                      tile)
        names = ("x", "dy", "offs")
    else:
        make = grouped_mm_recipe if form == "forward" else grouped_mm_dx_recipe
        recipe = make(a.shape[0], b.shape[1], b.shape[2], n_experts, dtype, a.stride(0), tuple(b.stride()), tile)
        names = ("x", "w", "offs") if form == "forward" else ("dy", "w", "offs")
    run = Executor(recipe, names).run
    return lambda: run(a, b, offs)[0]


def torch_operands(form: str, a, b) -> tuple:
    """torch._grouped_mm's operands for `form`: (x, w), (dy, w.T), or (x.T, dy) as its backward makes dw."""
    return {"forward": (a, b), "dx": (a, b.transpose(-2, -1)), "dw": (a.t(), b)}[form]


def relative_difference(got, want, rows: int | None) -> float:
    """max |got - want| / max |want| over the first `rows` rows (all of dw), in chunks (dw can be 15 GB)."""
    got, want = (t.reshape(-1, t.shape[-1]) for t in ((got, want) if rows is None else (got[:rows], want[:rows])))
    step = max(1, (1 << 26) // max(1, got.shape[1]))
    diff = top = 0.0
    for r in range(0, got.shape[0], step):
        a, b = got[r:r + step].float(), want[r:r + step].float()
        diff, top = max(diff, float((a - b).abs().max())), max(top, float(b.abs().max()))
    return diff / (top or 1.0)


def probe(size: dict, device: str, torch_layout: bool, smoke: bool, log) -> dict:
    import torch

    from benchmarks.moe_layer import fingerprint
    from benchmarks.timing import do_bench_us

    gemms, offs, n_slots = operands(size, device, torch_layout)
    last = int(offs[-1])
    results = {}
    for name, (form, a, b) in gemms.items():
        flops = 2 * n_slots * a.shape[1] * (b.shape[2] if form == "forward" else b.shape[1])  # 2 S x (summed x out)
        rows = None if form == "dw" else last
        entry = results[name] = {"form": form, "flops": flops, "candidates": {}}
        reference = None
        for copies in (False, True):  # the operands as they are; then contiguous copies, should torch refuse them
            args = [t.contiguous() for t in torch_operands(form, a, b)] if copies else torch_operands(form, a, b)
            note = " (contiguous copies of the operands)" if copies else ""
            try:
                reference = torch._grouped_mm(*args, offs=offs)
                us = do_bench_us(lambda args=args: torch._grouped_mm(*args, offs=offs))
            except Exception as err:  # noqa: BLE001 - a torch without this layout is a finding, not a stop
                why = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                entry.setdefault("torch_errors", []).append(why + note)
                log(f"{name:13s} torch._grouped_mm{note}: {why}")
                reference = None
                continue
            entry["torch"] = {"ms": us / 1e3, "tflops": flops / us / 1e6, "copies": copies}
            log(f"{name:13s} torch._grouped_mm{note}: {us / 1e3:.3f} ms, {flops / us / 1e6:.0f} TFLOP/s")
            break
        del args
        plan_out = None
        candidates = DW_CANDIDATES if form == "dw" else ROWS_CANDIDATES
        for tile in candidates[:SMOKE_CANDIDATES] if smoke else candidates:
            start = time.perf_counter()
            try:
                call = xkern_call(form, a, b, offs, tile)
                call()  # compiles (the result dropped at once: deepseek-v3's dw is 15 GB)
                compile_s = time.perf_counter() - start
                us = do_bench_us(call)
                out = call()
            except Exception as err:  # noqa: BLE001 - shared memory or registers: a finding
                entry["candidates"][label(tile)] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
                log(f"{name:13s} {label(tile)}: {entry['candidates'][label(tile)]['error']}")
                continue
            bits = fingerprint(out)  # the result itself, or sums of its bits where it is large (dw: 14 GiB)
            if plan_out is None:
                plan_out = bits
            same = bool(torch.equal(bits, plan_out))
            rel = None if reference is None else relative_difference(out, reference, rows)
            tail_zero = rows is None or not bool(torch.any(out[rows:]))
            ok = tail_zero and (rel is None or rel <= REL_OK)  # rel None: torch refused both ways
            entry["candidates"][label(tile)] = {"tile": list(tile), "ms": us / 1e3, "tflops": flops / us / 1e6,
                                                "bitwise_plan": same, "rel_diff_torch": rel, "tail_zero": tail_zero,
                                                "ok": ok, "compile_s": compile_s}
            log(f"{name:13s} {label(tile)}: {us / 1e3:.3f} ms, {flops / us / 1e6:.0f} TFLOP/s, "
                f"{'= plan' if same else '!= plan'}, rel diff vs torch {rel if rel is None else f'{rel:.2e}'}"
                f"{'' if ok else '  [NOT OK]'}")
            del out
            if device == "cuda":  # the caching allocator's freed blocks back, before the next candidate's
                torch.cuda.empty_cache()
        del plan_out, reference
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def best(results: dict) -> dict:
    """The fastest ok candidate per GEMM, and per form the fastest summed over both projections."""
    chosen = {"per_gemm": {}, "per_form": {}}
    for name, entry in results.items():
        oks = {lab: c for lab, c in entry["candidates"].items() if c.get("ok")}
        if oks:
            lab = min(oks, key=lambda x: oks[x]["ms"])
            chosen["per_gemm"][name] = {"tile": lab, "ms": oks[lab]["ms"], "tflops": oks[lab]["tflops"],
                                        "torch_ms": entry.get("torch", {}).get("ms")}
    for form in ("forward", "dx", "dw"):
        names = [n for n, e in results.items() if e["form"] == form]
        labels = set.intersection(*(set(results[n]["candidates"]) for n in names)) if names else set()
        labels = [lab for lab in labels if all(results[n]["candidates"][lab].get("ok") for n in names)]
        if labels:
            lab = min(labels, key=lambda x: sum(results[n]["candidates"][x]["ms"] for n in names))
            torch_ms = [results[n].get("torch", {}).get("ms") for n in names]
            chosen["per_form"][form] = {"tile": lab, "ms": sum(results[n]["candidates"][lab]["ms"] for n in names),
                                        "torch_ms": None if None in torch_ms else sum(torch_ms)}
    return chosen


def run(args, device: str, smoke: bool) -> None:
    import torch

    from benchmarks import moe_layer

    sizes = {"smoke": moe_layer.SMOKE_SIZE} if smoke else {s: moe_layer.SIZES[s] for s in args.sizes.split(",")}
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    for name, size in sizes.items():
        start = time.perf_counter()
        results = probe(size, device, args.torch_layout, smoke, lambda line: print(line, flush=True))
        chosen = best(results)
        for form, c in chosen["per_form"].items():
            vs = "" if c["torch_ms"] is None else f", torch {c['torch_ms']:.3f} ms"
            print(f"{name} {form}: {c['tile']} ({c['ms']:.3f} ms over both projections{vs})")
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"gemm-probe-{name}.json"), "w") as f:
                json.dump({"size": name, **size, "gpu": gpu, "torch_layout": args.torch_layout,
                           "torch": torch.__version__, "chosen": chosen, "results": results}, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="qwen3-moe,deepseek-v3",
                        help="comma-separated sizes of benchmarks.moe_layer.SIZES")
    parser.add_argument("--out", help="directory for gemm-probe-<size>.json")
    parser.add_argument("--torch-layout", action="store_true",
                        help="weights as the torch step's w.transpose(-2, -1) of a contiguous [E, N, K]")
    parser.add_argument("--smoke", action="store_true", help="the smoke size, each call once (CPU: the interpreter)")
    args = parser.parse_args(argv)

    import torch

    from benchmarks import timing

    device = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = args.smoke or device != "cuda"
    was_smoke = timing.smoke()
    timing.set_smoke(smoke)
    try:
        run(args, device, smoke)
    finally:
        timing.set_smoke(was_smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
