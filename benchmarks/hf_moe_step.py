"""A Hugging Face Qwen3-MoE training step (forward, backward, AdamW step) with xkern's experts path against
transformers' own.

    python -m benchmarks.hf_moe_step [--layers N] [--tokens N] [--steps N] [--out DIR] [--smoke]

The model: `Qwen3MoeForCausalLM` built locally from a config of Qwen3-30B-A3B's widths (hidden 2048, 32 heads,
4 KV heads of 128, 128 experts of width 768, top 8, vocabulary 151936) with `--layers` decoder layers, random
weights (no download), bf16. The experts paths (`config._experts_implementation`): transformers' "grouped_mm"
(`torch._grouped_mm` between its own sort and `index_add_`-free weighted sum) and "xkern"
(`torch_api.use_xkern_experts`: `permute_rows(top_k)` and the FP32 weighted `unpermute_rows`). Each starts
from the same weights and AdamW state and gets the same batch.

Reported per path: the step's time (CUDA events around forward + backward + optimizer step, eager, median
of `--steps`: host launch gaps included, as a training loop sees them), the step's peak memory above what
was allocated before it, and the first step's logits and every gradient against an FP32 reference (the
same model in FP32 with transformers' eager experts): relative L2 per tensor; a path passes when the logits',
the worst gradient's and the worst expert gradient's are within `REF_TOL` or within twice transformers' own
path's (`judge`).
Results: `<out>/<gpu>-hf-moe-step.json` and `.md`.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys

from benchmarks.report import table

QWEN3_MOE = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                 head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                 vocab_size=151936, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                 max_position_embeddings=4096, tie_word_embeddings=False)
SMOKE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=128, decoder_sparse_step=1,
             mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False)
PATHS = ("grouped_mm", "xkern")
REF_TOL = 3e-2  # relative L2 to the FP32 model; bf16 weights and activations through the layers and the head


def build(layers: int, smoke: bool, device: str):
    """The bf16 model (random, every expert's weights drawn so that each matters) and its FP32 copy."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from torch_api import hf_moe

    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, **(SMOKE if smoke else QWEN3_MOE))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # experts' weights start at 0 in some classes
        for m in model.modules():
            if hf_moe._is_experts_module(m):
                for p in m.parameters():
                    p.normal_(0.0, config.hidden_size ** -0.5)
    ref = model
    ref.config._experts_implementation = "eager"
    model = copy.deepcopy(ref).to(torch.bfloat16)
    return model, ref


def logits_and_grads(model, ids) -> tuple:
    import torch

    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def reference_errors(model, ref_logits, ref_grads, ids) -> dict:
    """Relative L2 to the FP32 model's: the logits, and each parameter's gradient (the worst one named)."""
    logits, grads = logits_and_grads(model, ids)

    def rel(a, b):
        b = b.double()
        return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))

    per_param = {n: rel(grads[n], ref_grads[n]) for n in ref_grads}
    worst = max(per_param, key=per_param.get)
    return {"logits": rel(logits, ref_logits), "worst_grad": per_param[worst], "worst_grad_param": worst,
            "experts_grads": max(v for n, v in per_param.items() if ".experts." in n)}


def step_time_ms(model, ids, steps: int, device: str) -> tuple[float, float | None]:
    """(median ms per training step, peak MiB above what was allocated before the step)."""
    import torch

    from benchmarks import timing

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(ids).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        opt.step()

    step()  # AdamW's state allocated, kernels compiled
    return timing.training_step_ms(step, lambda: opt.zero_grad(set_to_none=True), steps, device)


def run(layers: int, tokens: int, steps: int, smoke: bool, device: str, log) -> list[dict]:
    import torch

    from torch_api import hf_moe

    model, ref = build(layers, smoke, device)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1)).to(device)
    ref_logits, ref_grads = logits_and_grads(ref, ids)
    del ref
    if device == "cuda":
        torch.cuda.empty_cache()
    initial = copy.deepcopy(model.state_dict())
    rows = []
    for path in PATHS:
        row = {"path": path, "layers": layers, "tokens": tokens, "experts": model.config.num_experts,
               "top_k": model.config.num_experts_per_tok, "hidden": model.config.hidden_size}
        try:
            model.load_state_dict(initial)
            if path == "xkern":
                hf_moe.use_xkern_experts(model)
            else:
                hf_moe.use_xkern_experts(model, enable=False, previous=path)
            row["ref_rel_l2"] = reference_errors(model, ref_logits, ref_grads, ids)
            model.zero_grad(set_to_none=True)
            row["step_ms"], row["peak_mib"] = step_time_ms(model, ids, 1 if smoke else steps, device)
            row["timing"] = ("smoke: run through once, not a measurement" if smoke else
                             f"CUDA events around eager steps (host gaps included), median of {steps}")
            row["status"] = "ok"
        except Exception as err:  # noqa: BLE001 - one failing path must not lose the other
            from benchmarks import timing

            row["status"] = timing.error_status(err)
        rows.append(row)
        log(f"hf qwen3-moe step, {path}: {row.get('step_ms', float('nan')):.1f} ms, peak "
            f"{row.get('peak_mib') or float('nan'):.0f} MiB, logits' relative L2 to the FP32 model "
            f"{row.get('ref_rel_l2', {}).get('logits', float('nan')):.2e} [{row['status']}]")
        if device == "cuda":
            torch.cuda.empty_cache()
    judge(rows)
    return rows


CHECKED = ("logits", "worst_grad", "experts_grads")


def judge(rows: list[dict]) -> None:
    """Each path's `ref_check`: every distance within REF_TOL, or within twice transformers' own path's (as
    close to the FP32 model as the library's bf16 path, flash-attn's test rule; a small parameter's gradient,
    summed over every token, can be farther than REF_TOL in both)."""
    own = next((r.get("ref_rel_l2") for r in rows if r["path"] == "grouped_mm"), None) or {}
    for r in rows:
        if "ref_rel_l2" in r:
            bad = [f"{k} {r['ref_rel_l2'][k]:.2e}" for k in CHECKED
                   if not r["ref_rel_l2"][k] <= max(REF_TOL, 2 * own.get(k, 0.0))]
            r["ref_check"] = f"fail: {', '.join(bad)}" if bad else "pass"


def markdown(rows: list[dict], gpu: str) -> str:
    r0 = rows[0]
    lines = [f"## Hugging Face Qwen3-MoE training step on {gpu} ({r0['layers']} layers, {r0['tokens']} tokens, "
             f"{r0['experts']} experts, top {r0['top_k']}, bf16, AdamW; FP32 reference: relative L2, pass <= "
             f"{REF_TOL:g} or <= twice transformers' own path's)", "",
             ]
    cols = []
    base = next((r["step_ms"] for r in rows if r["path"] == "grouped_mm" and "step_ms" in r), None)
    for r in rows:
        ms = f"{r['step_ms']:.2f}" if "step_ms" in r else ""
        ratio = f"{r['step_ms'] / base:.2f}x" if ms and base and r["path"] == "xkern" else ""
        peak = f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else ""
        ref = r.get("ref_rel_l2", {})
        cols.append([r["path"], ms, ratio, peak, f"{ref.get('logits', float('nan')):.2e}",
                     f"{ref.get('worst_grad', float('nan')):.2e} ({ref.get('worst_grad_param', '')})",
                     r["status"] + ("" if r.get("ref_check", "pass") == "pass" else ", " + r["ref_check"])])
    return "\n".join(lines + table(["experts path", "ms / step", "xkern / grouped_mm", "peak MiB", "logits rel L2",
                                    "worst grad rel L2", "status"], cols))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step, one sequence (default 4096)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    parser.add_argument("--out", help="directory for <gpu>-hf-moe-step.json/.md (default: benchmarks/results/<gpu "
                        "kind>/ on a GPU, nothing on CPU)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one step per path")
    args = parser.parse_args(argv)

    from benchmarks.machine import GPU, RESULTS, commit, gpu_kind  # noqa: I001 - first: the platform env on CPU
    import torch

    smoke = args.smoke or not GPU
    device = "cuda" if GPU else "cpu"
    gpu = torch.cuda.get_device_name(0) if GPU else "cpu"
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    rows = run(1 if smoke else args.layers, 8 if smoke else args.tokens, args.steps, smoke, device,
               lambda m: print(m, flush=True))
    md = markdown(rows, gpu)
    print("\n" + md)
    out_dir = args.out or (os.path.join(RESULTS, gpu_kind(gpu)) if GPU and not smoke else None)
    if out_dir:
        import transformers

        os.makedirs(out_dir, exist_ok=True)
        stem = os.path.join(out_dir, gpu_kind(gpu) + "-hf-moe-step")
        with open(stem + ".json", "w") as f:
            json.dump({"gpu": gpu, "commit": commit(), "started_utc": started, "smoke": smoke, "ref_tol": REF_TOL,
                       "transformers": transformers.__version__, "torch": torch.__version__, "rows": rows}, f,
                      indent=1)
        with open(stem + ".md", "w") as f:
            f.write(md + "\n")
        print(f"wrote {stem}.json and .md")
    return 0 if all(r["status"] == "ok" and r.get("ref_check") == "pass" for r in rows if r["path"] == "xkern") else 1


if __name__ == "__main__":
    sys.exit(main())
