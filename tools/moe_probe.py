"""The MoE layer's row kernels (`permute_rows(top_k)`, the copy-sum and weighted combine of `unpermute_rows`,
the weighted combine's backward) at the MoE benchmark's sizes, each launched alone with candidate tiles in
place of the plan's, timed with `timing.do_bench_us` (median, L2 flushed before each call). Prints each
candidate's time and its fraction of the copy ceiling over the bytes the kernel must move, the plan's
row marked; every candidate's output is compared with the plan's bit for bit (the j-order FP32 sums do not
depend on the tile), but the combine backward's dprobs, whose FP32 sum over a row goes in BLOCK_H chunks
(within 2 % of the plan's: another tile, another order).

    python -m tools.moe_probe [--sizes qwen3-moe,deepseek-v3] [--kernels combine,...] [--out DIR]

Each candidate compiles once (about a second); 24 tiles, 48 for each combine: about 3 minutes a size.

Candidates: rows per program (BLOCK_M) x columns per step (BLOCK_H) x warps, and for the combine its loop
over the copies as a loop (TOP_K 0) or unrolled (TOP_K = top_k); the plans' tiles are `xkern.permute.plans._row_tile`
(16 KB per step, 8 warps at bf16 1024 columns: the gather) and `xkern.permute.plans._token_tile` (4 rows of 512 bytes,
4 warps: the combines, the combine backward and the token-major kernels).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os

import torch

from benchmarks import timing
from benchmarks.moe_layer import SIZES, SMOKE_SIZE, layout, route
from xkern import permute
from xkern.launch import bind, cdiv

# permute_rows(top_k) token-major (each token row read once): checked against the gather's result too
TOKEN_MAJOR = "permute_rows(top_k) token-major"
BWD_TOKEN_MAJOR = "combine backward token-major"  # checked against the slot-major kernel's result
BLOCK_MS = (4, 8, 16)
BLOCK_HS = (256, 512, 1024, 2048)
WARPS = (4, 8)


def _dtype(name: str):
    return getattr(torch, name)


def op_steps(size: dict, device: str):
    """(name, step, arrays, minimum bytes, reference) of each kernel at this size: the recipe's last step (the
    kernel probed), its input and output arrays (the earlier steps run once to make its inputs), and where
    another path defines its result, that result's maker (else the plan's own result is the reference)."""
    from torch_api._launch import run_recipe

    t, k, h, e = size["tokens"], size["top_k"], size["hidden"], size["experts"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(t, h, generator=gen).to(device, torch.bfloat16)
    w_router = torch.randn(h, e, generator=gen).to(device, torch.bfloat16) / h ** 0.5
    probs, ids = route(x, w_router, k)
    probs = probs.to(torch.bfloat16).reshape(-1).contiguous()
    slot_copy = layout(ids, e)[0]
    n_slots, rows = slot_copy.numel(), t * k
    y = torch.randn(n_slots, h, generator=gen).to(device, torch.bfloat16)
    dout = torch.randn(t, h, generator=gen).to(device, torch.bfloat16)
    item, valid = 2, rows * h * 2  # bytes of the routed rows (padding slots hold no copy)
    recipes = {
        "permute_rows(top_k)": (permute.permute_recipe(n_slots, h, t, "bfloat16", h, k, "int32", token_major=False),
                                dict(x=x, idx=slot_copy), t * h * item + n_slots * h * item),
        TOKEN_MAJOR: (permute.permute_recipe(n_slots, h, t, "bfloat16", h, k, "int32", token_major=True),
                      dict(x=x, idx=slot_copy), t * h * item + n_slots * h * item),
        "copy-sum": (permute.unpermute_recipe(n_slots, h, rows, "bfloat16", h, "int32", k, None),
                     dict(y=y, idx=slot_copy), valid + t * h * item),
        "weighted combine": (permute.unpermute_recipe(n_slots, h, rows, "bfloat16", h, "int32", k, "bfloat16"),
                             dict(y=y, idx=slot_copy, probs=probs), valid + t * h * item),
        "combine backward": (permute.combine_bwd_recipe(n_slots, h, rows, "bfloat16", h, h, k, "bfloat16", "int32",
                                                   token_major=False),
                             dict(dout=dout, y=y, idx=slot_copy, probs=probs),
                             t * h * item + valid + n_slots * h * item),
        BWD_TOKEN_MAJOR: (permute.combine_bwd_recipe(n_slots, h, rows, "bfloat16", h, h, k, "bfloat16", "int32",
                                                token_major=True),
                          dict(dout=dout, y=y, idx=slot_copy, probs=probs), t * h * item + valid + n_slots * h * item),
    }

    # what the token-major forms must equal bit for bit: the gather's and the slot-major backward's results
    references = {TOKEN_MAJOR: lambda: run_recipe(recipes["permute_rows(top_k)"][0], device, x=x, idx=slot_copy),
                  BWD_TOKEN_MAJOR: lambda: run_recipe(recipes["combine backward"][0], device, dout=dout, y=y,
                                                      idx=slot_copy, probs=probs)}
    for name, (recipe, inputs, nbytes) in recipes.items():
        *before, last = recipe.steps
        env = dict(inputs)
        if before:
            env.update(zip([b.name for s in before for b in s.outputs],
                           run_recipe(dataclasses.replace(recipe, steps=tuple(before),
                                                          results=tuple(b.name for s in before for b in s.outputs)),
                                      device, **inputs)))
        outs = [torch.empty(b.shape, dtype=getattr(torch, b.dtype), device=device) for b in last.outputs]
        yield name, last, [env[n] for n in last.inputs] + outs, nbytes, references.get(name)


def _regrid(step, plan, bm: int):
    """The grid (and its token-program count) of a candidate with BLOCK_M `bm`."""
    if "token_programs" not in step.scalars:
        return {}, (max(1, cdiv(_items(step), bm)),)
    tokens = cdiv(step.scalars["n_tokens"], bm)
    return {"token_programs": tokens}, (tokens + cdiv(step.scalars["n_slots"], bm),)


def _items(step) -> int:
    return step.scalars.get("n_tokens") or step.scalars.get("n_rows") or step.scalars["n_slots"]


def candidates(step, n_items: int):
    """(launch, its scalars): the plan's first, then every tile of BLOCK_MS x BLOCK_HS x WARPS that is not it;
    for the combine, each tile also with its loop over the copies unrolled (TOP_K = top_k)."""
    plan = step.launch
    yield plan, step.scalars
    unroll = (0, step.scalars["top_k"]) if "top_k" in step.scalars and "TOP_K" in plan.constexprs else (None,)
    for bm, bh, w, k in itertools.product(BLOCK_MS, BLOCK_HS, WARPS, unroll):
        tile = {"BLOCK_M": bm, "BLOCK_H": bh, **({} if k is None else {"TOP_K": k})}
        if (tile, w) != ({n: plan.constexprs[n] for n in tile}, plan.num_warps):
            scalars, grid = _regrid(step, plan, bm)
            yield (dataclasses.replace(plan, grid=grid, num_warps=w, constexprs={**plan.constexprs, **tile}),
                   {**step.scalars, **scalars})  # the token-major grid's split is a scalar


def probe(size_name: str, size: dict, device: str, smoke: bool, kernels: str | None = None) -> list[dict]:
    ceiling = timing.copy_ceiling()["gbps"] if device == "cuda" else None
    rows = []
    for name, step, arrays, nbytes, reference in op_steps(size, device):
        if kernels and not any(k in name for k in kernels.split(",")):
            continue
        n_items = _items(step)
        outs = arrays[len(step.inputs):]
        want, unrolled = reference() if reference else None, False
        for i, (cand, scalars) in enumerate(candidates(step, n_items)):
            if smoke and i > 1 and (unrolled or not cand.constexprs.get("TOP_K")):
                continue  # the smoke run: the plan, one other tile, one unrolled combine
            unrolled |= bool(cand.constexprs.get("TOP_K"))
            for o in outs:  # poison: every element must be written again
                o.fill_(float("nan")) if o.dtype.is_floating_point else o.fill_(-7)
            if name.startswith("combine backward"):
                outs[1].zero_()  # dprobs arrives zero-filled
            kwargs = bind(cand, arrays, scalars)

            def call(cand=cand, kwargs=kwargs):
                cand.kernel[cand.grid](**kwargs, num_warps=cand.num_warps, num_stages=cand.num_stages)
            call()
            got = [o.clone() for o in outs]
            if want is None:
                want = got
            bits = [torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                                b.view(torch.uint8) if b.is_floating_point() else b) for a, b in zip(got, want)]
            same = all(bits)
            # the combine backward's dprobs sums each row in BLOCK_H chunks: another tile, another FP32 order
            close = all(b or (name.startswith("combine backward") and i == 1 and torch.allclose(
                a.float(), w.float(), rtol=2e-2, atol=1e-3)) for i, (b, a, w) in enumerate(zip(bits, got, want)))
            us = timing.do_bench_us(call) if device == "cuda" else None
            row = {"size": size_name, "kernel": name, "BLOCK_M": cand.constexprs["BLOCK_M"],
                   "BLOCK_H": cand.constexprs["BLOCK_H"], "num_warps": cand.num_warps,
                   "TOP_K": cand.constexprs.get("TOP_K"), "plan": i == 0,
                   "bitwise_equal_plan": same, "equal_plan": close, "us": us, "bytes": nbytes,
                   "frac": nbytes / us / 1e3 / ceiling if us and ceiling else None}
            rows.append(row)
            print(f"{size_name} {name} BLOCK_M {row['BLOCK_M']} BLOCK_H {row['BLOCK_H']} warps {row['num_warps']}"
                  + (f" TOP_K {row['TOP_K']}" if row["TOP_K"] is not None else "")
                  + f"{' (plan)' if i == 0 else ''}: " + (f"{us:.1f} us, {row['frac']:.2f} of the ceiling" if us
                                                         else "ran")
                  + ("" if same else " (dprobs in another FP32 order)" if close else " DIFFERS"), flush=True)
    return rows


def best(rows: list[dict]) -> list[str]:
    """Per size and kernel: the plan's time and the fastest candidate's."""
    out = []
    for key in dict.fromkeys((r["size"], r["kernel"]) for r in rows):
        sel = [r for r in rows if (r["size"], r["kernel"]) == key and r["us"] and r["equal_plan"]]
        if sel:
            plan, fast = sel[0], min(sel, key=lambda r: r["us"])
            out.append(f"{key[0]} {key[1]}: plan {plan['us']:.1f} us ({plan['frac']:.2f}), best {fast['us']:.1f} us "
                       f"({fast['frac']:.2f}) at BLOCK_M {fast['BLOCK_M']}, BLOCK_H {fast['BLOCK_H']}, "
                       f"{fast['num_warps']} warps" + (f", TOP_K {fast['TOP_K']}" if fast["TOP_K"] else ""))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="qwen3-moe,deepseek-v3")
    parser.add_argument("--kernels", help="only the kernels whose names contain one of these (comma-separated), "
                        "e.g. combine")
    parser.add_argument("--smoke", action="store_true", help="the smoke size, the plan and one candidate (CPU)")
    parser.add_argument("--out", help="directory for moe_probe.json")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = {"smoke": SMOKE_SIZE} if args.smoke else {s: SIZES[s] for s in args.sizes.split(",")}
    rows = []
    for name, size in sizes.items():
        rows += probe(name, size, device, args.smoke, args.kernels)
        torch.cuda.empty_cache() if device == "cuda" else None
    for line in best(rows):
        print(line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "moe_probe.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": rows}, f, indent=1)
    return 0 if all(r["equal_plan"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
