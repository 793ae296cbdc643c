"""The one table writer: tables and plots from a benchmark JSON, and README's benchmarks section.

    python -m benchmarks.report [benchmarks/results/<gpu>/<gpu>.json ...] [--readme README.md] [--no-plots]
    python -m benchmarks.report --merge benchmarks/results/<gpu>/<gpu>.json PART.json PART.json ...

Writes `<stem>.md` (every table) and `<stem>-<figure>.png` beside each JSON, then rewrites README's benchmarks
section from the current set of every GPU kind (`benchmarks/results/<gpu>/<gpu>.json` and the step results
beside it); with no JSON, README's section only. `--merge` joins a run's parts (`main --part K/N`) into one
JSON first. Plots need matplotlib (Agg); without it the tables are still written.

Ratios are stated as "time of the other / time of xkern", so above 1 always means xkern (or, in the JAX
column, the JAX front end) is faster; each pair is timed by one method (the profiler's where both rows have
it, else the CUDA graphs' of the torch rows).
"""

from __future__ import annotations

import argparse
import glob
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASS_NAMES = {"fwd": "forward", "bwd": "backward alone", "fwd+bwd": "forward + backward"}
FIGURES = {"rms_norm": ("rms_norm",), "permute": ("permute_rows", "unpermute_rows")}  # PNG -> its ops


def table(header: list[str], lines: list[list[str]], align: str = "---") -> list[str]:
    """A markdown table: the header, its rule (`align` per column, or one per column as a list), the lines."""
    rule = align if isinstance(align, list) else [align] * len(header)
    return ["| " + " | ".join(header) + " |", "|" + "".join(a + "|" for a in rule)] + [
        "| " + " | ".join(str(c) for c in ln) + " |" for ln in lines]


def versions_line(v: dict) -> str:
    names = [("torch", "torch"), ("triton", "triton"), ("jax", "jax"), ("jax-triton", "jax-triton"),
             ("liger-kernel", "Liger-Kernel"), ("quack-kernels", "quack"), ("driver", "driver")]
    return ", ".join(f"{label} {v[key]}" for key, label in names if v.get(key))


# ---------------------------------------------------------------------------------------------------
# xkern against its peers and across its front ends


def shape_label(row) -> str:
    """A row's shape as the tables print it: 32768×128."""
    return "×".join(str(d) for d in row["shape"]) if isinstance(row["shape"], list) else str(row["shape"])


def shape_key(row) -> tuple:
    """(op, pass, dtype, shape): the rows of one measurement, one per implementation."""
    return row["op"], row["pass"], row["dtype"], shape_label(row)


def group_by_impl(rows, key) -> dict:
    """key(row) -> {impl: row}, in the order first met."""
    out: dict = {}
    for r in rows:
        out.setdefault(key(r), {})[r["impl"]] = r
    return out


# Row labels of result sets measured before the gathers' peers were named after torchtitan.
RENAMED = {"previous (vstack + index)": "torchtitan (vstack + index)",
           "previous (zeros + index_put)": "torchtitan (zeros + index_put)"}


def jax_speed(xk: dict, xj: dict | None) -> float | None:
    """JAX's speed over torch's for xkern (torch µs / JAX µs; below 1, JAX is slower): by the same method,
    the profiler's (`profile_us`), where both rows have it (results before it: the two rows' fractions)."""
    if not xj:
        return None
    if xk.get("profile_us") and xj.get("profile_us"):
        return xk["profile_us"] / xj["profile_us"]
    return xj["frac"] / xk["frac"] if xj.get("frac") and xk.get("frac") else None


def peer_speed(xk: dict, peer: dict) -> float | None:
    """A peer's device time over xkern (torch)'s (above 1: xkern is faster), both by one method: the
    profiler's where both rows have it (the JAX peers are timed by it alone), else the CUDA graphs' of the
    torch peers and of xkern's `us` (their fractions of the ceiling: the same bytes over each time)."""
    if xk.get("profile_us") and peer.get("profile_us"):
        return peer["profile_us"] / xk["profile_us"]
    return xk["frac"] / peer["frac"] if xk.get("frac") and peer.get("frac") else None


def ratios(rows) -> list[dict]:
    """Per (op, pass, dtype, shape): the fastest peer's time over xkern (torch)'s (`ratio`, `peer_speed`: one
    timing method for each pair), and JAX over torch (`jax_speed`)."""
    out = []
    rows = [{**r, "impl": RENAMED.get(r["impl"], r["impl"])} for r in rows if r.get("frac") is not None]
    for (op, pass_, dtype, shape), by in group_by_impl(rows, shape_key).items():
        xk, xj = by.get("xkern (torch)"), by.get("xkern (jax)")
        if not xk or not xk["frac"]:
            continue
        # xkern's own kernels under another driver (torch.compile's fusion pass) are not a peer
        speeds = [(peer_speed(xk, r), name) for name, r in by.items() if "xkern" not in name]
        ratio, peer = min(((s, n) for s, n in speeds if s is not None), default=(None, None))
        out.append({"op": op, "pass": pass_, "dtype": dtype, "shape": shape, "width": int(shape.split("×")[-1]),
                    "xkern": xk["frac"], "best_peer": peer, "ratio": ratio, "jax_ratio": jax_speed(xk, xj)})
    return out


def _cell(row) -> str:
    if row is None:
        return ""
    if row["status"].startswith("wrong"):
        return "wrong"
    return "–" if row["frac"] is None else f"{row['frac']:.2f}"


def _ulp(row) -> str:
    ulp = (row or {}).get("ulp") or {}
    return " / ".join(f"{k} {v['max_ulp']}" for k, v in ulp.items()) if ulp else ""


def _group_rows(rows, key) -> dict:
    """key(row) -> [rows], in the order first met."""
    out: dict = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def _impls(rows) -> list[str]:
    """The implementations in `rows`: xkern's first, then the peers in the order met."""
    names = list(dict.fromkeys(r["impl"] for r in rows))
    return sorted(names, key=lambda name: not name.startswith("xkern"))


def _frac_table(rows, extra=()) -> list[str]:
    """A line per shape, a column per implementation, the best fraction of a line in bold; `extra`:
    (title, fn({impl: row})) columns."""
    present = _impls(rows)
    lines = []
    for (shape, _), by in group_by_impl(rows, lambda r: (shape_label(r), r["dtype"])).items():
        best = max((r["frac"] for r in by.values() if r["frac"] is not None), default=None)
        cells = [f"**{_cell(by.get(i))}**" if by.get(i) and by[i]["frac"] is not None and by[i]["frac"] == best
                 else _cell(by.get(i)) for i in present]
        lines.append([shape] + cells + [fn(by) for _, fn in extra])
    return table(["shape"] + present + [title for title, _ in extra], lines)


def jax_torch(rows) -> list[dict]:
    """Per (op, pass, dtype, shape): xkern's torch and JAX front ends' device µs per call by the same method
    (`timing.profile_device_us`) and `ratio` = torch µs / JAX µs (below 1: JAX is slower)."""
    out = []
    mine = [r for r in rows if r.get("impl") in ("xkern (torch)", "xkern (jax)")]
    for (op, pass_, dtype, shape), by in group_by_impl(mine, shape_key).items():
        t, j = ((by.get(i) or {}).get("profile_us") for i in ("xkern (torch)", "xkern (jax)"))
        if t and j:
            names = [sorted(k["name"] for k in by[i].get("kernels", [])) for i in ("xkern (torch)", "xkern (jax)")]
            out.append({"op": op, "pass": pass_, "dtype": dtype, "shape": shape, "torch_us": t, "jax_us": j,
                        "ratio": t / j, "same_kernels": names[0] == names[1]})
    return out


def jax_torch_table(rows) -> list[str]:
    jt = jax_torch(rows)
    if not jt:
        return []
    ratios_ = sorted(r["ratio"] for r in jt)
    out = ["", "**xkern, JAX against torch** (the same kernels; device µs per call by the same method: the "
           "profiler's device activities of one call per input set, L2 flushed per round; ratio = torch µs / "
           f"JAX µs, below 1: JAX is slower). Median {ratios_[len(ratios_) // 2]:.3f}, worst {ratios_[0]:.3f}.", ""]
    out += table(["op", "pass", "dtype", "shape", "torch µs", "JAX µs", "torch / JAX", "same kernels"],
                  [[r["op"], r["pass"], r["dtype"], r["shape"], f"{r['torch_us']:.2f}", f"{r['jax_us']:.2f}",
                    f"{r['ratio']:.3f}", "yes" if r["same_kernels"] else "no"] for r in jt])
    return out


def _header(results) -> str:
    c = results["ceiling"]
    source = f" Commit {results['commit']}." if results.get("commit") else ""
    source += f" {results['sources']}" if results.get("sources") else ""
    return (f"Measured on **{results['gpu']}**, {results['date']} ({versions_line(results['versions'])}). Copy ceiling "
            f"**{c['gbps']:.0f} GB/s** (device-to-device copy, bytes read + written).{source}")


def host_tables(results) -> list[str]:
    host = [h for h in results.get("host", []) if "wall_us" in h]
    if not host:
        return []
    lines = []
    for (op, pass_), by in group_by_impl(host, lambda h: (h["op"], h["pass"])).items():
        if op == "floor":
            lines += [[f"floor: {impl}", f"{h['wall_us']:.1f}", "", ""] for impl, h in by.items()]
            continue
        xk = by.pop("xkern (torch)", None)
        lines.append([f"{op} {PASS_NAMES[pass_]} ({(xk or next(iter(by.values())))['shape']})",
                      f"{xk['wall_us']:.1f}" if xk else "",
                      f"{xk['device_us']:.1f}" if xk and xk.get("device_us") is not None else "",
                      ", ".join(f"{impl} {h['wall_us']:.1f}" for impl, h in by.items())])
    return ["", "**Host cost per call** (eager tight loop, one synchronize at the end; wall µs per call, the device "
            "time of the call in a CUDA graph beside it). The floor of this host: an empty custom op, an empty Triton "
            "launch, an autograd.Function that only allocates, and `torch.autograd.grad` through a native op "
            "(F.rms_norm's forward + backward).", ""] + table(
        ["call", "xkern wall µs", "xkern device µs", "peers: wall µs"], lines)


def sweep_tables(rows) -> list[str]:
    out = []
    rs = ratios(rows)
    for dtype in dict.fromkeys(r["dtype"] for r in rs):
        sel = [r for r in rs if r["dtype"] == dtype]
        widths = sorted({r["width"] for r in sel})
        passes = [p for p in PASS_NAMES if any(r["pass"] == p for r in sel)]
        by = {(r["width"], r["pass"]): r for r in sel}
        out += ["", f"**RMSNorm width sweep, {dtype}**: xkern (torch) / best peer (device time), best peer named; "
                "JAX / torch", ""]
        lines = []
        for w in widths:
            cells = [str(w), by[(w, passes[0])]["shape"] if (w, passes[0]) in by else ""]
            for p in passes:
                r = by.get((w, p))
                cells.append(f"{r['ratio']:.2f} ({r['best_peer']})" if r and r["ratio"] else "")
            cells += [f"{by[(w, p)]['jax_ratio']:.2f}" if by.get((w, p)) and by[(w, p)]["jax_ratio"] else ""
                      for p in passes]
            lines.append(cells)
        out += table(["width", "rows × width"] + [PASS_NAMES[p] for p in passes]
                      + [f"JAX/torch {p}" for p in passes], lines)
    return out


def markdown(results: dict, json_rel: str, plots_rel: list[str]) -> str:
    rows = [r for r in results["rows"] if not r.get("sweep")]
    out = [_header(results), "",
           "Each cell: achieved bandwidth over the minimum bytes as a fraction of the copy ceiling; the best of "
           "a line in bold; `wrong`: failed the oracle check, so not timed; `–`: not available or failed (the "
           f"JSON says why). Data: `{json_rel}`; method: `docs/benchmarks.md`.", ""]
    if results.get("smoke"):
        out += ["**Smoke run: the code paths ran, nothing here is a measurement.**", ""]
    out += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots_rel]
    extra = [("xkern µs", lambda by: f"{by['xkern (torch)']['us']:.1f}" if (by.get("xkern (torch)") or {}).get("us")
               else ""), ("xkern max ULP", lambda by: _ulp(by.get("xkern (torch)")))]
    for (op, dtype, pass_), sel in _group_rows(rows, lambda r: (r["op"], r["dtype"], r["pass"])).items():
        out += ["", f"**{op}, {dtype}, {PASS_NAMES[pass_]}**", ""] + _frac_table(sel, extra)
    if "routing" in results.get("permute", {}):
        out += ["", f"Gathers: {results['permute']['routing']}; bytes (N + N_padded)·H·2; shape T×H."]
    out += jax_torch_table(rows + results.get("add_rms_norm", []))
    out += host_tables(results)
    out += sweep_tables([r for r in results["rows"] if r.get("sweep")])
    if results.get("skipped"):
        out += ["", "Not run: " + "; ".join(results["skipped"])]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------
# Plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _stamp(results) -> str:
    """GPU, date and commit: every plot says which run drew it."""
    return ", ".join(str(v) for v in (results["gpu"], results["date"], results.get("commit")) if v)


def plot_fractions(results: dict, path: str, ops) -> str | None:
    """Fraction of the copy ceiling per shape, a line per implementation, a panel per (op, pass), bf16."""
    rows = [r for r in results["rows"] if not r.get("sweep") and r["dtype"] == "bfloat16" and r["op"] in ops]
    panels = list(dict.fromkeys((r["op"], r["pass"]) for r in rows))
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), squeeze=False)
    for ax, (op, pass_) in zip(axes[0], panels, strict=True):
        sel = [r for r in rows if r["op"] == op and r["pass"] == pass_]
        shapes = list(dict.fromkeys(shape_label(r) for r in sel))
        for impl in [i for i in _impls(sel) if any(r["impl"] == i and r["frac"] is not None for r in sel)]:
            by = {shape_label(r): r["frac"] for r in sel if r["impl"] == impl}
            ys = [by.get(s) if by.get(s) is not None else float("nan") for s in shapes]
            xkern = impl.startswith("xkern")
            ax.plot(range(len(shapes)), ys, "-o" if xkern else "--.", label=impl, linewidth=2 if xkern else 1)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, rotation=45, ha="right", fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{op} {PASS_NAMES[pass_]}, bfloat16", fontsize=10)
        ax.set_ylabel("fraction of copy bandwidth")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{_stamp(results)}: copy ceiling {results['ceiling']['gbps']:.0f} GB/s",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(results: dict, out_dir: str, stem: str) -> list[str]:
    made = [plot_fractions(results, os.path.join(out_dir, f"{stem}-{name}.png"), ops) for name, ops in FIGURES.items()]
    return [p for p in made if p]


# ---------------------------------------------------------------------------------------------------
# README's benchmarks section: every GPU kind's current set

BEGIN, END = "<!-- section: benchmarks -->", "<!-- /section: benchmarks -->"
# What each peer's row label means, for the line under the table.
PEERS = {
    "quack": "quack (CuTe DSL kernels)",
    "Liger": "Liger-Kernel",
    "torch.compile": "torch.compile of the Llama expression (Inductor)",
    "F.rms_norm": "torch.nn.functional.rms_norm",
    "HF eager": "Hugging Face LlamaRMSNorm, eager",
    "jax.jit (XLA)": "jax.jit of the Llama expression (XLA)",
    "index_select": "torch.index_select of the rows",
    "jnp.take": "jnp.take of the rows",
    "jnp.take + mask": "jnp.take, padding rows masked to zero",
    "torchtitan (vstack + index)": "torchtitan's gather (a zero row stacked under x, then indexed)",
    "torchtitan (zeros + index_put)": "torchtitan's scatter (zeros, then index_put)",
}
# What the main table's columns mean, said once above every GPU kind's table.
COLUMNS = ("Device time of each call. *Fraction of ceiling*: the minimum bytes the op must move over its time, as a "
           "fraction of the copy ceiling (1 = copy speed). *Slowest against the best peer*: over the shapes, the "
           "smallest ratio best peer's time / xkern's time (above 1: xkern is faster at every shape), each pair by one "
           "method (the torch peers' CUDA graphs against xkern's, the JAX peers' profiler times against xkern's). "
           "*Slowest JAX against torch*: the smallest ratio torch_api's time / jax_api's time (above 1: JAX is as "
           "fast), both by the profiler (device time per call, L2 flushed).")
# The MoE benchmarks' path names, as the README's table shows them.
MOE_PATHS = {"liger": "Liger fused MoE", "maxtext": "MaxText-style"}


def _worst(sel, key):
    vals = [r for r in sel if r[key] is not None]
    return min(vals, key=lambda r: r[key]) if vals else None


# The host table's calls README quotes, those a model's layer makes (the rest: the full table beside the JSON)
README_HOST_CALLS = {("rms_norm", "fwd"), ("rms_norm", "fwd+bwd"), ("add_rms_norm", "fwd"), ("add_rms_norm", "fwd+bwd"),
                     ("topk_permute_indices", "fwd"), ("permute_rows(top_k)", "fwd"),
                     ("unpermute_rows(top_k, probs)", "fwd")}


def _host(results, commit: str | None = None) -> list[str]:
    """xkern's eager call beside torch's own op (F.rms_norm) and the fastest other peer, µs per call (`commit`: the
    host table's own run, where it is not the set's)."""
    host = {(h["op"], h["pass"], h["impl"]): h for h in results.get("host", []) if "wall_us" in h}
    lines = []
    for (op, pass_, impl), h in host.items():
        if impl != "xkern (torch)" or (op, pass_) not in README_HOST_CALLS:
            continue
        native = host.get((op, pass_, "F.rms_norm"))
        others = [(o["wall_us"], i) for (o_op, o_pass, i), o in host.items()
                  if (o_op, o_pass) == (op, pass_) and i not in ("xkern (torch)", "F.rms_norm")
                  and not i.startswith("floor")]
        fastest = min(others) if others else None
        if native is None and fastest is None:  # nothing to compare with
            continue
        lines.append([f"{op} {PASS_NAMES[pass_]}", str(h.get("shape", "")).removeprefix("x "), f"{h['wall_us']:.1f}",
                      f"{native['wall_us']:.1f}" if native else "",
                      f"{h['wall_us'] / native['wall_us']:.2f}" if native else "",
                      f"{fastest[0]:.1f} ({fastest[1]})" if fastest else ""])
    if not lines:
        return []
    run = f"; its own run, commit {commit}" if commit else ""
    return ["", "Host cost of one eager call (µs, a tight loop synchronized once; F.rms_norm: torch's native op, "
            f"after the add for the fused add; the calls of a layer, every call in the full table{run}):", ""] + \
        table(["call", "shape", "xkern", "F.rms_norm", "xkern / F.rms_norm", "fastest other"], lines)


def _jax_torch(path: str, rel: str) -> list[str]:
    """One line from a kernel profile's JSON (both front ends by the profiler) where there is one: the range
    of torch / JAX over its shape-passes, the slowest named."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        prof = json.load(f)
    slowest = sorted((p["torch_over_jax"], f"{p['op']} {'×'.join(map(str, p['shape']))} {p['pass']}")
                    for p in prof.get("pairs", []))
    if not slowest:
        return []
    at = f" at {prof['commit'][:7]}" if prof.get("commit") else ""
    return ["", f"JAX against torch, both by the profiler (device time per call, L2 flushed; "
            f"each kernel profiled{at}, [its table]({rel}-jax-torch-profile.txt)), on the "
            f"{len(slowest)} shape-passes where the table above has JAX slowest: torch / JAX {slowest[0][0]:.2f}–"
            f"{slowest[-1][0]:.2f} (slowest: {slowest[0][1]}; below 1, JAX slower)."]


def _moe_rows(path: str, framework: str):
    """One MoE JSON's rows that ran and pass the FP32 reference, grouped by (size, tokens, part)."""
    with open(path) as f:
        res = json.load(f)
    rows = [r for r in res["rows"] if r.get("framework", framework) == framework and r.get("status") == "ok"
            and r.get("ref_check") == "pass"]
    for key in dict.fromkeys((r["size"], r["tokens"], r["part"]) for r in rows):
        yield res, key, {r["impl"]: r for r in rows if (r["size"], r["tokens"], r["part"]) == key}


def _moe_path(row: dict) -> str:
    """A MoE row's path as the README names it."""
    return MOE_PATHS.get(row["impl"], row["impl"]) + (" (autotune off)" if row.get("liger_autotune") is False else "")


def _moe(folder: str, stem: str) -> list[str]:
    """The MoE layer step per front end, size and part: xkern, each peer, xkern's peak memory beside the lowest
    peer's, JAX's time over torch's; and the Hugging Face training step, where they ran."""
    lines, gemms = [], set()
    for framework, kind in (("torch", "moe-layer"), ("jax", "jax-moe-layer")):
        for path in sorted(glob.glob(os.path.join(folder, f"{stem}-{kind}-*.json"))):
            for res, key, sel in _moe_rows(path, framework):
                if "xkern" not in sel or len(sel) < 2:
                    continue
                x, peers = sel.pop("xkern"), sorted(sel.values(), key=lambda r: r["us"])
                if framework == "jax" and key[2] == "layer":  # dispatch + combine runs no expert GEMM
                    gemms.add(res.get("experts_gemm_name") or res.get("experts_gemm", "?"))
                lines.append([framework, f"{key[0]} (T={key[1]})", key[2], f"{x['us'] / 1000:.2f}",
                              ", ".join(f"{_moe_path(r)} {r['us'] / 1000:.2f}" for r in peers),
                              f"{x['us'] / peers[0]['us']:.2f}",
                              f"{x['peak_mib']:.0f} / {min(r['peak_mib'] for r in peers):.0f}",
                              str(res.get("commit", "?"))[:7],
                              f"{x['vs_torch_xkern']:.2f}" if x.get("vs_torch_xkern") else ""])
    hf, hf_words = os.path.join(folder, f"{stem}-hf-moe-step.json"), ""
    if os.path.exists(hf):
        with open(hf) as f:
            step = json.load(f)
        by = {r["path"]: r for r in step["rows"] if r.get("status") == "ok"}
        if "xkern" in by and "grouped_mm" in by:
            x, g = by["xkern"], by["grouped_mm"]
            lines.append(["torch", f"Hugging Face Qwen3-MoE ({x['layers']} layers, T={x['tokens']})",
                          "training step (AdamW)", f"{x['step_ms']:.2f}",
                          f"transformers' grouped_mm {g['step_ms']:.2f}",
                          f"{x['step_ms'] / g['step_ms']:.2f}", f"{x['peak_mib']:.0f} / {g['peak_mib']:.0f}",
                          str(step.get("commit", "?"))[:7], ""])
            hf_words = "; the last row a Hugging Face model's training step, forward, backward and optimizer"
    out = []
    if lines:
        jax_words = (", compiled peaks for JAX; JAX / torch: JAX's xkern step time over torch's, below 1: JAX "
                     "faster; JAX's experts' GEMM, the same for both its paths: " + "; ".join(sorted(gemms))
                     if gemms else "")  # a GPU kind with the torch steps alone
        out += ["", "MoE layer step, forward + backward (ms; the paths within the FP32 reference's tolerance; "
                "xkern / fastest below 1: xkern faster; peak MiB: xkern / the lowest peer's" + jax_words + hf_words
                + "):", ""]
        head = ["front end", "size", "part", "xkern", "peers", "xkern / fastest", "peak MiB", "commit",
                "JAX / torch (xkern)"]
        out += table(head, lines) if gemms else table(head[:-1], [line[:-1] for line in lines])
    return out


def _ratio_words(r: dict) -> str:
    return f"{r['ratio']:.2f} ({r['best_peer']})" if r.get("ratio") else "–"


def _fused_add(folder: str, stem: str, rel: str) -> list[str]:
    """One line from the fused add's table where it ran: per pass xkern's fraction of the ceiling, the best
    peer's time over xkern's (its range, the lowest named) and JAX against torch."""
    path = os.path.join(folder, f"{stem}-add_rms_norm.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        res = json.load(f)
    rs = ratios(res.get("add_rms_norm") or res.get("rows", []))
    if not rs:
        return []
    parts = []
    for pass_ in ("fwd+bwd", "fwd", "bwd"):
        sel = [r for r in rs if r["pass"] == pass_]
        if not sel:
            continue
        fr, w = [r["xkern"] for r in sel], _worst(sel, "ratio")
        peer = (f", the best peer's time over xkern's {w['ratio']:.2f}–{max(r['ratio'] for r in sel if r['ratio']):.2f}"
                f" (lowest at {w['shape']}, {w['best_peer']})") if w else ""
        parts.append(f"{PASS_NAMES[pass_]} {min(fr):.2f}–{max(fr):.2f} of the ceiling{peer}")
    js = [r["jax_ratio"] for r in rs if r["jax_ratio"] is not None]
    widths = sorted({r["width"] for r in rs})
    dtypes = "/".join(sorted({r["dtype"] for r in rs}))
    commit = str(res.get("commit", "?"))[:7]
    return ["", f"Fused residual add + RMSNorm ([its table]({rel}-add_rms_norm.md), commit {commit}; "
            f"{dtypes}, {len(widths)} widths from {widths[0]} to {widths[-1]}): " + "; ".join(parts)
            + (f"; JAX against torch {min(js):.2f}–{max(js):.2f}" if js else "") + "."]


def _sweep_widths(folder: str, stem: str, readme_dir: str) -> list[str]:
    """Widths measured outside the main set with every peer (`--sweep --widths`), one clause per shape: the
    best peer's time over xkern's per pass."""
    clauses = []
    for path in sorted(glob.glob(os.path.join(folder, f"{stem}-sweep-w*.json"))):
        with open(path) as f:
            res = json.load(f)
        rs = ratios(res.get("rows", []))
        by_shape: dict = {}
        for r in rs:
            by_shape.setdefault((r["shape"], r["dtype"]), {})[r["pass"]] = r
        shapes = [f"{shape} {dtype}: " + ", ".join(f"{PASS_NAMES[p]} {_ratio_words(by[p])}"
                                                   for p in ("fwd", "bwd", "fwd+bwd") if p in by)
                  for (shape, dtype), by in sorted(by_shape.items(), key=lambda kv: int(kv[0][0].split("×")[-1]))]
        md = os.path.relpath(os.path.splitext(path)[0] + ".md", readme_dir)
        clauses.append("; ".join(shapes) + f" ([rows]({md}), commit {str(res.get('commit', '?'))[:7]})")
    if not clauses:
        return []
    return ["", "Widths outside this set, with every peer (the best peer's time over xkern (torch)'s; above 1: "
            "xkern faster): " + "; ".join(clauses) + "."]


def _peers_line(peers: set) -> list[str]:
    named = [f"{p}: {PEERS[p]}" for p in sorted(peers) if p in PEERS]
    return ["", "Peers: " + "; ".join(named) + "."] if named else []


def section(json_path: str, readme_dir: str, peers: set) -> str:
    """One GPU kind's part of README's benchmarks section: the GPU, commit, date and versions of the run, the
    RMSNorm plot, one table of xkern against its peers and of JAX against torch, the side results (the fused
    add, extra widths), the MoE steps and the host cost per eager call. The peers it names join `peers`, for
    one legend after every kind's section."""
    with open(json_path) as f:
        results = json.load(f)
    folder = os.path.dirname(os.path.abspath(json_path))
    stem = os.path.splitext(os.path.basename(json_path))[0]
    rel = os.path.relpath(os.path.join(folder, stem), readme_dir)
    commit = results.get("kernels_commit") or results.get("commit", "?")
    out = [f"### {results['gpu']}", "",
           f"Commit {commit}, {results['date']}; {versions_line(results.get('versions', {}))}. Copy ceiling "
           f"{results['ceiling']['gbps']:.0f} GB/s (device-to-device copy, bytes read + written)."]
    if results.get("kernels_note"):
        out[2] += " " + results["kernels_note"]
    if os.path.exists(os.path.join(folder, f"{stem}-rms_norm.png")):
        out += ["", f"![RMSNorm on {results['gpu']}]({rel}-rms_norm.png)"]
    rs = ratios([r for r in results["rows"] if not r.get("sweep")])  # the sweep: its own table
    lines, peers_seen = [], set()
    for key in dict.fromkeys((r["op"], r["pass"], r["dtype"]) for r in rs):
        sel = [r for r in rs if (r["op"], r["pass"], r["dtype"]) == key]
        w, j = _worst(sel, "ratio"), _worst(sel, "jax_ratio")
        if w:
            peers_seen.add(w["best_peer"])
        fr = [r["xkern"] for r in sel]
        lines.append([key[0], PASS_NAMES[key[1]], key[2], str(len(sel)), f"{min(fr):.2f}–{max(fr):.2f}",
                      f"{w['ratio']:.2f} at {w['shape']} ({w['best_peer']})" if w else "",
                      f"{j['jax_ratio']:.2f} at {j['shape']}" if j else ""])
    out += [""] + table(["op", "pass", "dtype", "shapes", "xkern (torch), fraction of ceiling",
                          "slowest against the best peer", "slowest JAX against torch"], lines)
    peers |= peers_seen
    # the side results' lines, one paragraph
    side = [line for part in (_jax_torch(os.path.join(folder, stem + "-jax-torch-profile.json"), rel),
                              _sweep_widths(folder, stem, readme_dir), _fused_add(folder, stem, rel))
            for line in part if line]
    out += ["", " ".join(side)] if side else []
    out += _moe(folder, stem)
    host_path = os.path.join(folder, stem + "-host.json")  # a later run of the host table alone, if any
    if os.path.exists(host_path):
        with open(host_path) as f:
            host = json.load(f)
        out += _host(host, host.get("commit", "?"))
    else:
        out += _host(results)
    links = [f"[every table]({rel}.md)", f"[data]({rel}.json)"]
    for suffix, label in (("-add_rms_norm.md", "fused residual add"), ("-host.md", "host cost")):
        if os.path.exists(os.path.join(folder, stem + suffix)):
            links.append(f"[{label}]({rel}{suffix})")
    for kind, label in (("moe-layer", "MoE layer"), ("jax-moe-layer", "JAX MoE layer")):
        for md in sorted(glob.glob(os.path.join(folder, f"{stem}-{kind}-*.md"))):
            size = os.path.basename(md)[len(stem) + len(kind) + 2:-3]
            links.append(f"[{label}, {size}]({os.path.relpath(md, readme_dir)})")
    out += ["", "More: " + ", ".join(links) + "."]
    return "\n".join(out) + "\n"


def body(readme_dir: str, results_dir: str | None = None) -> str:
    results_dir = results_dir or os.path.join(ROOT, "benchmarks", "results")
    kinds = sorted(d for d in os.listdir(results_dir) if os.path.exists(os.path.join(results_dir, d, d + ".json")))
    parts = ["One run of the main benchmark per GPU kind, at one commit ([method](docs/benchmarks.md)). " + COLUMNS, ""]
    peers: set = set()
    for kind in kinds:
        parts.append(section(os.path.join(results_dir, kind, kind + ".json"), readme_dir, peers))
    return "\n".join(parts + _peers_line(peers)[1:]) + "\n"


def update_readme(readme: str, results_dir: str | None = None) -> bool:
    """README's benchmarks section (between its markers) rewritten from the result sets; False without them."""
    text = body(os.path.dirname(os.path.abspath(readme)), results_dir)
    with open(readme) as f:
        old = f.read()
    if BEGIN not in old or END not in old:
        return False
    head, rest = old.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w") as f:
        f.write(f"{head}{BEGIN}\n## Benchmarks\n\n{text}{END}{tail}")
    return True


# ---------------------------------------------------------------------------------------------------


def write_all(json_path: str, readme: str | None, draw: bool = True, log=print) -> str:
    """Plots and every table beside the JSON; README's benchmarks section refreshed (main JSONs); returns the
    tables."""
    with open(json_path) as f:
        results = json.load(f)
    out_dir = os.path.dirname(os.path.abspath(json_path))
    stem = os.path.splitext(os.path.basename(json_path))[0]
    paths = []
    if draw:
        try:
            paths = plots(results, out_dir, stem)
        except ImportError as err:
            log(f"plots: not drawn ({err}); run `python -m benchmarks.report {json_path}` where matplotlib is")
    jt = jax_torch([r for r in results["rows"] if not r.get("sweep")] + results.get("add_rms_norm", []))
    if jt and results.get("jax_torch") != jt:  # the JAX / torch table in the JSON too
        results["jax_torch"] = jt
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    md = markdown(results, os.path.basename(json_path), paths)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(md)
    if readme and results.get("mode", "main") == "main":  # README quotes every GPU kind's main set
        if not update_readme(readme):
            log(f"{readme}: no benchmarks section markers, not updated")
    return md


def _row_key(r: dict) -> tuple:
    return r["op"], r["pass"], r["impl"], tuple(r["shape"]), r["dtype"]


def merge(out_path: str, parts: list[str]) -> None:
    """One JSON from a run's parts: the first part's header, every part's rows and notes. A row of a later
    part replaces an earlier one of the same case and implementation (a `--widths` re-run of some widths
    after a plan change); each replacement is listed in `replaced`, with the commit that measured it. A case
    one part skipped (over its time budget) and another measured is no longer listed as skipped."""
    with open(parts[0]) as f:
        merged = json.load(f)
    names = merged.get("parts") or [os.path.basename(parts[0])]  # the first may be a merged sweep already
    merged.setdefault("replaced", [])
    for part in parts[1:]:
        with open(part) as f:
            res = json.load(f)
        where = {_row_key(r): i for i, r in enumerate(merged["rows"])}
        for r in res["rows"]:
            if _row_key(r) in where:
                merged["rows"][where[_row_key(r)]] = r
                merged["replaced"].append({"case": "/".join(map(str, _row_key(r))), "by": os.path.basename(part),
                                           "commit": res.get("commit")})
            else:
                merged["rows"].append(r)
        merged["skipped"] += res.get("skipped", [])
        merged["wall_s"] = merged.get("wall_s", 0) + res.get("wall_s", 0)
        names.append(os.path.basename(part))
    measured = {f"{r['op']} {'x'.join(map(str, r['shape']))} {r['dtype']}" for r in merged["rows"]}
    merged["skipped"] = [s for s in merged["skipped"] if s.split(":")[0] not in measured]  # a later part ran it
    merged["parts"] = names
    with open(out_path, "w") as f:
        json.dump(merged, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Tables, plots and README's section from benchmark JSONs")
    parser.add_argument("json_paths", nargs="*", help="result JSONs (none: README's section only)")
    parser.add_argument("--merge", action="store_true", help="write the first JSON from the others (parts) first")
    parser.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    paths = args.json_paths
    if args.merge:
        merge(paths[0], paths[1:])
        paths = paths[:1]
    for path in paths:
        write_all(path, None, draw=not args.no_plots)
        print(f"wrote the tables and plots of {path}")
    if not update_readme(args.readme):
        print(f"{args.readme}: no benchmarks section markers")
        return 1
    print(f"{args.readme}: benchmarks section written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
