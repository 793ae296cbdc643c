"""README's benchmarks section, from the current result set of every GPU kind in `benchmarks/results/`.

    python -m benchmarks.readme [--readme README.md]

One subsection per GPU kind (`benchmarks/results/<gpu>/<gpu>.json`, the main job's JSON): the GPU, the commit
and date of the run, the versions, the RMSNorm plot, one table of xkern against its peers and of JAX against
torch, and a small table of the host cost per eager call. A set whose JSON says `"kernels_current": false`
(measured before the current kernels and plans) gets its note and a link only. The fused add's table, the
width sweep and the MoE layer steps are linked where their tables are beside it. Ratios are stated as "time of
the other / time of xkern", so above 1 always means xkern (or, in the JAX column, the JAX front end) is faster.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

from benchmarks.ratios import ratios

BEGIN, END = "<!-- section: benchmarks -->", "<!-- /section: benchmarks -->"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASS_NAMES = {"fwd": "forward", "bwd": "backward alone", "fwd+bwd": "forward + backward"}
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


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(ln) + " |"
                                                                           for ln in lines]


def _worst(sel, key):
    vals = [r for r in sel if r[key] is not None]
    return min(vals, key=lambda r: r[key]) if vals else None


def _versions(v: dict) -> str:
    names = [("torch", "torch"), ("triton", "triton"), ("jax", "jax"), ("jax-triton", "jax-triton"),
             ("liger-kernel", "Liger-Kernel"), ("quack-kernels", "quack"), ("driver", "driver")]
    return ", ".join(f"{label} {v[key]}" for key, label in names if v.get(key))


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
        _table(["call", "shape", "xkern", "F.rms_norm", "xkern / F.rms_norm", "fastest other"], lines)


def _jax_torch(path: str, rel: str) -> list[str]:
    """One line from `tools.jax_torch_profile`'s JSON (both front ends by the profiler) where it ran: the range
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
            f"`python -m tools.jax_torch_profile`{at}, [its table]({rel}-jax-torch-profile.txt)), on the "
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
        out += _table(head, lines) if gemms else _table(head[:-1], [line[:-1] for line in lines])
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


def section(json_path: str, readme_dir: str, peers: set | None = None) -> str:
    """One GPU kind's part of README's benchmarks section. With `peers`, the peers its summary names are added
    there for one legend after every kind's section; without, the legend follows its table."""
    with open(json_path) as f:
        results = json.load(f)
    folder = os.path.dirname(os.path.abspath(json_path))
    stem = os.path.splitext(os.path.basename(json_path))[0]
    rel = os.path.relpath(os.path.join(folder, stem), readme_dir)
    commit = results.get("kernels_commit") or results.get("commit", "?")
    out = [f"### {results['gpu']}", "",
           f"Commit {commit}, {results['date']}; {_versions(results.get('versions', {}))}. Copy ceiling "
           f"{results['ceiling']['gbps']:.0f} GB/s (device-to-device copy, bytes read + written)."]
    if results.get("kernels_current") is False:  # an older set: one paragraph that points to it
        return "\n".join(out[:2] + [f"{out[2]} {results.get('kernels_note', '')} Its tables: [{rel}.md]({rel}.md)."])\
            + "\n"
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
    same = all(r.get("profile_us") for r in results["rows"] if r["impl"] in ("xkern (torch)", "xkern (jax)"))
    if not same:
        out += ["", "This set timed JAX in a jitted loop and torch in CUDA graphs, not the one profiler method both "
                "use now."]
    out += [""] + _table(["op", "pass", "dtype", "shapes", "xkern (torch), fraction of ceiling",
                          "slowest against the best peer", "slowest JAX against torch"], lines)
    if peers is None:
        out += _peers_line(peers_seen)
    else:
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
    for suffix, label in (("-add_rms_norm.md", "fused residual add"), ("-sweep.md", "width sweep"),
                          ("-host.md", "host cost")):
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


def update(readme: str, text: str) -> bool:
    with open(readme) as f:
        old = f.read()
    if BEGIN not in old or END not in old:
        return False
    head, rest = old.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w") as f:
        f.write(f"{head}{BEGIN}\n## Benchmarks\n\n{text}{END}{tail}")
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="README's benchmarks section from benchmarks/results/")
    parser.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    args = parser.parse_args(argv)
    if not update(args.readme, body(os.path.dirname(os.path.abspath(args.readme)))):
        print(f"{args.readme}: no benchmarks section markers")
        return 1
    print(f"{args.readme}: benchmarks section written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
