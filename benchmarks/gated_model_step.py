"""A training step of a few Hugging Face Qwen3-Next decoder layers at the real widths, with transformers' own
norms and with xkern's (`torch_api.replace_rms_norm`: the gated norm after each linear attention, and the
one-input norms).

    python -m benchmarks.gated_model_step [--layers N] [--batch N] [--seq N] [--steps N] [--out DIR] [--tiny]

The model: `Qwen3NextForCausalLM` built locally from Qwen3-Next-80B-A3B's config (hidden 2048; linear attention
with 16 key heads and 32 value heads of 128, whose gated norm runs on rows of 128; full attention 16 heads of
256, 2 KV heads; vocabulary 151936), random weights (no download), bf16, `--layers` decoder layers of the
model's pattern (three linear-attention layers, then a full-attention one; the last layer full attention).
Every layer's MLP is the dense MLP of the config's `intermediate_size` (`mlp_only_layers`), not the 512
experts: the experts' weights would not fit twice, and they are not what is measured. The linear attention
runs flash-linear-attention's kernels where `fla` is importable, else transformers' torch fallback (the JSON
says which).

Each path starts from the same weights and gets the same batch. Reported per path: the step's time (forward,
backward, AdamW step; CUDA events, eager, median of `--steps` after `--warmup` steps), the step's peak memory
above what was allocated before it, and the first step's logits against the eager path's: bit for bit, or the
fraction of logits that differ and their relative L2 (the statistic's FP32 sum order can move a bf16
rounding that later layers carry on). Results: `<out>/<gpu>-gated-model-step.json` and `.md`.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys

from benchmarks.report import table

LAYER_PATTERN = ("linear_attention", "linear_attention", "linear_attention", "full_attention")
# The tiny model (`--tiny`, and every CPU run): the real model's proportions at width 64.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4)
PATHS = ("eager", "xkern")
LOGITS_TOL = 1e-2  # relative L2 of the xkern path's first logits to the eager path's; above it the run fails


def config(layers: int, tiny: bool):
    """The model's config: the layer pattern with the last layer a full-attention one (2 layers: one of each)."""
    from transformers import AutoConfig

    types = [LAYER_PATTERN[i % len(LAYER_PATTERN)] for i in range(layers - 1)] + ["full_attention"]
    return AutoConfig.for_model("qwen3_next", num_hidden_layers=layers, mlp_only_layers=list(range(layers)),
                                layer_types=types, **(TINY if tiny else {}))


def build(layers: int, tiny: bool, device: str):
    """The bf16 model; every norm's weight moved off its initial constant (ones, or zeros for the `1 + w`
    norms), so that the weight matters to the bits compared."""
    import torch
    from transformers import AutoModelForCausalLM

    from torch_api.hf import NORM_NAME

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config(layers, tiny), dtype=torch.bfloat16)
    with torch.no_grad():
        for m in model.modules():
            if NORM_NAME.search(type(m).__name__) and isinstance(getattr(m, "weight", None), torch.nn.Parameter):
                m.weight.add_(0.1 * torch.randn_like(m.weight))
    return model.train()


def linear_attention_kernels() -> str:
    """Which linear attention transformers' Qwen3-Next runs: fla's (with its version) or its torch fallback."""
    try:
        from importlib import metadata

        import fla  # noqa: F401

        return f"fla-core {metadata.version('fla-core')}"
    except Exception:  # noqa: BLE001 - any import failure means transformers falls back too
        return "transformers' torch fallback"


def loss_of(model, ids):
    import torch

    logits = model(ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    return logits, loss


def step_stats(model, ids, steps: int, warmup: int, device: str) -> tuple:
    """(the first step's logits, median ms per training step, peak MiB above what was allocated before the
    step: `timing.training_step_ms`)."""
    import torch

    from benchmarks import timing

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step():
        opt.zero_grad(set_to_none=True)
        logits, loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        return logits.detach()

    first = step()  # with the initial weights; AdamW's state allocated, kernels compiled and autotuned
    for _ in range(warmup - 1):
        step()
    return (first, *timing.training_step_ms(step, lambda: opt.zero_grad(set_to_none=True), steps, device))


def compare(logits, ref) -> dict:
    """The logits against the eager path's: bitwise, the fraction that differ, relative L2."""
    import torch

    a, b = logits.float(), ref.float()
    return {"bitwise": bool(torch.equal(logits.view(-1).view(torch.int16), ref.view(-1).view(torch.int16))),
            "differ": float((logits != ref).float().mean()),
            "rel_l2": float((a - b).norm() / b.norm().clamp_min(1e-30))}


def run(layers: int, batch: int, seq: int, steps: int, warmup: int, tiny: bool, device: str, log) -> list[dict]:
    import torch

    from torch_api import replace_rms_norm
    from torch_api.hf import gated

    model = build(layers, tiny, device)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    initial = copy.deepcopy(model.state_dict())
    rows, ref_logits = [], None
    for path in PATHS:
        row = {"path": path, "layers": layers, "layer_types": list(cfg.layer_types), "batch": batch, "seq": seq,
               "hidden": cfg.hidden_size, "value_heads": cfg.linear_num_value_heads,
               "head_dim": cfg.linear_value_head_dim, "vocab": cfg.vocab_size}
        try:
            model.load_state_dict(initial)
            if path == "xkern":
                row["norms_patched"] = replace_rms_norm(model)
                row["gated_norms_patched"] = sum(isinstance(m.__dict__.get("forward"), gated._GatedForward)
                                                 for m in model.modules())
            logits, row["step_ms"], row["peak_mib"] = step_stats(model, ids, 1 if tiny else steps,
                                                                 1 if tiny else max(warmup, 1), device)
            if ref_logits is None:
                ref_logits = logits
            else:
                row["logits_vs_eager"] = compare(logits, ref_logits)
            del logits
            row["timing"] = ("tiny: run through once, not a measurement" if tiny else
                             f"CUDA events around eager steps (host gaps included), median of {steps} after "
                             f"{warmup} warm-up steps")
            row["status"] = "ok"
        except Exception as err:  # noqa: BLE001 - one failing path must not lose the other
            from benchmarks import timing

            row["status"] = timing.error_status(err)
        rows.append(row)
        log(f"qwen3-next {layers} layers step, {path} norms: {row.get('step_ms', float('nan')):.1f} ms, peak "
            f"{row.get('peak_mib') or float('nan'):.0f} MiB [{row['status']}]"
            + (f", logits vs eager {row['logits_vs_eager']}" if "logits_vs_eager" in row else ""))
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def passed(rows: list[dict]) -> bool:
    xk = next(r for r in rows if r["path"] == "xkern")
    return all(r["status"] == "ok" for r in rows) and xk.get("gated_norms_patched", 0) > 0 and \
        xk["logits_vs_eager"]["rel_l2"] <= LOGITS_TOL


def markdown(rows: list[dict], gpu: str, linear: str) -> str:
    r0 = rows[0]
    n_linear = r0["layer_types"].count("linear_attention")
    lines = [f"## Hugging Face Qwen3-Next training step on {gpu} ({r0['layers']} layers, {n_linear} of them linear "
             f"attention; hidden {r0['hidden']}, gated norm on {r0['value_heads']} heads x {r0['head_dim']}; "
             f"batch {r0['batch']} x {r0['seq']} tokens, bf16, AdamW; dense MLPs; linear attention: {linear})", ""]
    base = next((r["step_ms"] for r in rows if r["path"] == "eager" and "step_ms" in r), None)
    cols = []
    for r in rows:
        ms = f"{r['step_ms']:.2f}" if "step_ms" in r else ""
        ratio = f"{r['step_ms'] / base:.3f}x" if ms and base and r["path"] == "xkern" else ""
        peak = f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else ""
        cmp = r.get("logits_vs_eager")
        logits = "" if cmp is None else ("bit for bit" if cmp["bitwise"] else
                                         f"{100 * cmp['differ']:.3f} % differ, rel L2 {cmp['rel_l2']:.1e}")
        patched = "" if "norms_patched" not in r else f"{r['norms_patched']} ({r['gated_norms_patched']} gated)"
        cols.append([r["path"], patched, ms, ratio, peak, logits, r["status"]])
    return "\n".join(lines + table(["norms", "modules through xkern", "ms / step", "xkern / eager", "peak MiB",
                                    "logits vs eager", "status"], cols))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4,
                        help="decoder layers, at least 2 (default 4: 3 linear, 1 full)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median; default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, at least 1 (default 3)")
    parser.add_argument("--out", help="directory for <gpu>-gated-model-step.json/.md (default: benchmarks/results/"
                        "<gpu kind>/ on a GPU, nothing on CPU)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model, 2 layers (one linear, one full "
                        "attention), 8 tokens, one step per path (every CPU run)")
    args = parser.parse_args(argv)

    from benchmarks.machine import GPU, RESULTS, commit, gpu_kind  # noqa: I001 - first: the platform env on CPU
    import torch

    tiny = args.tiny or not GPU
    device = "cuda" if GPU else "cpu"
    gpu = torch.cuda.get_device_name(0) if GPU else "cpu"
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    linear = linear_attention_kernels() if GPU else "transformers' torch fallback"
    shape = (2, 1, 8) if tiny else (args.layers, args.batch, args.seq)
    rows = run(*shape, args.steps, args.warmup, tiny, device, lambda m: print(m, flush=True))
    md = markdown(rows, gpu, linear)
    print("\n" + md)
    out_dir = args.out or (os.path.join(RESULTS, gpu_kind(gpu)) if GPU and not tiny else None)
    if out_dir:
        import transformers

        os.makedirs(out_dir, exist_ok=True)
        stem = os.path.join(out_dir, gpu_kind(gpu) + "-gated-model-step")
        with open(stem + ".json", "w") as f:
            json.dump({"gpu": gpu, "commit": commit(), "started_utc": started, "tiny": tiny,
                       "logits_tol": LOGITS_TOL, "linear_attention": linear,
                       "transformers": transformers.__version__, "torch": torch.__version__, "rows": rows}, f,
                      indent=1)
        with open(stem + ".md", "w") as f:
            f.write(md + "\n")
        print(f"wrote {stem}.json and .md")
    return 0 if passed(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
