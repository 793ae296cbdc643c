"""Tables and plots generated from a benchmark JSON, and README's benchmarks section.

    python -m benchmarks.report benchmarks/results/<gpu>/<gpu>.json [--readme README.md] [--no-plots]
    python -m benchmarks.report --merge benchmarks/results/<gpu>/<gpu>-sweep.json PART.json PART.json ...

Writes `<stem>.md` (every table) and `<stem>-<figure>.png` beside the JSON. For a main JSON it also
rewrites README's benchmarks section (`benchmarks/readme.py`: every GPU kind's main set). `--merge` joins
the sweep's parts (`main --sweep --part K/N`) into one JSON. Plots need matplotlib (Agg); without it the
tables are still written.
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.ratios import group_by_impl, ratios, shape_key, shape_label

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASS_NAMES = {"fwd": "forward", "bwd": "backward alone", "fwd+bwd": "forward + backward"}
FIGURES = {"rms_norm": ("rms_norm",), "permute": ("permute_rows", "unpermute_rows")}  # PNG -> its ops


def _cell(row) -> str:
    if row is None:
        return ""
    if row["status"].startswith("wrong"):
        return "wrong"
    return "–" if row["frac"] is None else f"{row['frac']:.2f}"


def _ulp(row) -> str:
    ulp = (row or {}).get("ulp") or {}
    return " / ".join(f"{k} {v['max_ulp']}" for k, v in ulp.items()) if ulp else ""


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(c) + " |"
                                                                             for c in lines]


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
    return _table(["shape"] + present + [title for title, _ in extra], lines)


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
    out += _table(["op", "pass", "dtype", "shape", "torch µs", "JAX µs", "torch / JAX", "same kernels"],
                  [[r["op"], r["pass"], r["dtype"], r["shape"], f"{r['torch_us']:.2f}", f"{r['jax_us']:.2f}",
                    f"{r['ratio']:.3f}", "yes" if r["same_kernels"] else "no"] for r in jt])
    return out


def _versions(v: dict) -> str:
    names = [("torch", "torch"), ("triton", "triton"), ("jax", "jax"), ("jax-triton", "jax-triton"),
             ("liger-kernel", "Liger"), ("quack-kernels", "quack"), ("driver", "driver")]
    return ", ".join(f"{label} {v[key]}" for key, label in names if v.get(key))


def _header(results) -> str:
    c = results["ceiling"]
    source = f" Commit {results['commit']}." if results.get("commit") else ""
    source += f" {results['sources']}" if results.get("sources") else ""
    return (f"Measured on **{results['gpu']}**, {results['date']} ({_versions(results['versions'])}). Copy ceiling "
            f"**{c['gbps']:.0f} GB/s** (device-to-device copy, bytes read + written).{source}")


# ---------------------------------------------------------------------------------------------------
# Every table (the .md beside the JSON)


def host_tables(results) -> list[str]:
    out = []
    host = [h for h in results.get("host", []) if "wall_us" in h]
    if host:
        out += ["", "**Host cost per call** (eager tight loop, one synchronize at the end; wall µs per call, the "
                "device time of the call in a CUDA graph beside it). The floor of this host: an empty custom op, an "
                "empty Triton launch, and `torch.autograd.grad` through a native op (F.rms_norm's forward + "
                "backward); each xkern call's own floor: its eager executor's allocations and launches with every "
                "kernel empty (the rest of the call is its Python: checks, cache lookup, autograd).", ""]
        lines = []
        for (op, pass_), by in group_by_impl(host, lambda h: (h["op"], h["pass"])).items():
            if op == "floor":
                lines += [[f"floor: {impl}", f"{h['wall_us']:.1f}", "", "", ""] for impl, h in by.items()]
                continue
            xk = by.pop("xkern (torch)", None)
            floors = {impl: by.pop(impl) for impl in [i for i in by if i.startswith("floor:")]}
            own = [f"{h['wall_us']:.1f} ({impl.removeprefix('floor: its ')})" for impl, h in floors.items()]
            lines.append([f"{op} {PASS_NAMES[pass_]} ({(xk or next(iter(by.values())))['shape']})",
                          f"{xk['wall_us']:.1f}" if xk else "",
                          f"{xk['device_us']:.1f}" if xk and xk.get("device_us") is not None else "",
                          ", ".join(own), ", ".join(f"{impl} {h['wall_us']:.1f}" for impl, h in by.items())])
        out += _table(["call", "xkern wall µs", "xkern device µs", "its floor: wall µs (empty kernels)",
                       "peers: wall µs"], lines)
    block = [b for b in results.get("block", []) if "wall_us" in b]
    if block:
        cfg = block[0]["config"]
        out += ["", f"**Llama-style block, forward + backward** (`torch.autograd.grad`; batch {cfg['batch']}, seq "
                f"{cfg['seq']}, dim {cfg['dim']}, {cfg['heads']} heads, MLP {cfg['hidden']}, bf16): µs per step", ""]
        out += _table(["mode", "norm", "wall µs (median)", "rounds' range", "issue µs", "device µs"],
                      [[b["mode"], b["norm"], f"{b['wall_us']:.0f}",
                        "{:.0f}–{:.0f}".format(*b["wall_us_range"]) if "wall_us_range" in b else "",
                        f"{b['issue_us']:.0f}", f"{b['device_us']:.0f}" if b.get("device_us") is not None else ""]
                       for b in block])
        out += ["", "Each norm's steps are timed in rounds taken in turn with the other's; where two rounds' "
                "ranges overlap, the difference between the medians is within this host's drift. Reduce-overhead "
                "rows: the device column is do_bench of the graphs' replays, host-bound."]
    sharded = [r for r in results.get("sharded", []) if "device_us" in r]
    if sharded:
        out += ["", "**The sharded path on a 1-device mesh** (RMSNorm forward + backward, bf16): what the "
                "partitioning costs over the plain call. JAX: device µs per jitted step. torch: host wall µs per "
                "eager step at the small x, device µs at the large one.", ""]
        out += _table(["framework", "form", "x", "device µs", "wall µs (small x)", "results vs plain"],
                      [[r["framework"], r["form"], r["shape"], f"{r['device_us']:.1f}",
                        f"{r['wall_us']:.0f} ({r['host_shape']})" if "wall_us" in r else "",
                        "bitwise" if r["bitwise_equal_plain"] else f"max rel diff {r['max_rel_diff']:.1e}"]
                       for r in sharded])
    return out


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
        out += _table(["width", "rows × width"] + [PASS_NAMES[p] for p in passes]
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


def plot_sweep(results: dict, path: str) -> str | None:
    """xkern (torch) over the best peer against width (log scale), a line per pass and dtype; JAX/torch."""
    rs = ratios([r for r in results["rows"] if r.get("sweep")])
    if not rs:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6), squeeze=False)
    for ax, key, title in ((axes[0][0], "ratio", "xkern (torch) / best peer"),
                           (axes[0][1], "jax_ratio", "xkern JAX / xkern torch")):
        for pass_, dtype in dict.fromkeys((r["pass"], r["dtype"]) for r in rs):
            sel = sorted((r for r in rs if (r["pass"], r["dtype"]) == (pass_, dtype) and r[key]),
                         key=lambda r: r["width"])
            ax.plot([r["width"] for r in sel], [r[key] for r in sel], "-o" if dtype == "bfloat16" else ":x",
                    markersize=3, label=f"{PASS_NAMES[pass_]} {dtype}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("width")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"RMSNorm width sweep, {_stamp(results)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_host(results: dict, path: str) -> str | None:
    """Wall µs per call of every entry of the host table, grouped by op and pass."""
    host = [h for h in results.get("host", []) if "wall_us" in h]
    if not host:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(host) + 1.2))
    labels = [f"{h['op']} {h['pass']}: {h['impl']}" for h in host]
    colors = ["tab:blue" if h["impl"].startswith("xkern") else "tab:grey"
              if h["op"] == "floor" or h["impl"].startswith("floor:") else "tab:orange"
              for h in host]
    ax.barh(range(len(host)), [h["wall_us"] for h in host], color=colors)
    ax.set_yticks(range(len(host)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("wall µs per call (eager loop)")
    ax.set_title(f"Host cost per call, {_stamp(results)}", fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(results: dict, out_dir: str, stem: str) -> list[str]:
    made = [plot_fractions(results, os.path.join(out_dir, f"{stem}-{name}.png"), ops) for name, ops in FIGURES.items()]
    made += [plot_sweep(results, os.path.join(out_dir, f"{stem}-widths.png")),
             plot_host(results, os.path.join(out_dir, f"{stem}-host.png"))]
    return [p for p in made if p]


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
        from benchmarks import readme as readme_section

        if not readme_section.update(readme, readme_section.body(os.path.dirname(os.path.abspath(readme)))):
            log(f"{readme}: no benchmarks section markers, not updated")
    return md


def _row_key(r: dict) -> tuple:
    return r["op"], r["pass"], r["impl"], tuple(r["shape"]), r["dtype"]


def merge(out_path: str, parts: list[str]) -> None:
    """One sweep JSON from its parts: the first part's header, every part's rows and notes. A row of a later
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
    parser = argparse.ArgumentParser(description="Tables, plots and README section from a benchmark JSON")
    parser.add_argument("json_path")
    parser.add_argument("parts", nargs="*", help="with --merge: the sweep's part JSONs")
    parser.add_argument("--merge", action="store_true", help="write json_path from the parts first")
    parser.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    if args.merge:
        merge(args.json_path, args.parts)
    write_all(args.json_path, args.readme, draw=not args.no_plots)
    if args.json_path.endswith("-sweep.json"):  # README's section links the sweep's tables
        main_json = args.json_path[: -len("-sweep.json")] + ".json"
        if os.path.exists(main_json):
            write_all(main_json, args.readme, draw=not args.no_plots)
    print(f"wrote the tables and plots of {args.json_path}; README: {args.readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
