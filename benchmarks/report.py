"""Tables and plots generated from a benchmark JSON, and README's benchmarks section.

    python -m benchmarks.report benchmarks/results/<gpu>-<date>.json [--readme README.md] [--no-plots]

Writes `<json stem>.md` and `<json stem>-<op>.png` beside the JSON and replaces README's text between
`<!-- section: benchmarks -->` and `<!-- /section: benchmarks -->`. Plots need matplotlib (Agg); without
it the tables are still written.
"""

from __future__ import annotations

import argparse
import json
import os

BEGIN, END = "<!-- section: benchmarks -->", "<!-- /section: benchmarks -->"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RMS_IMPLS = ["xkern (torch)", "xkern (jax)", "HF eager", "F.rms_norm", "torch.compile", "Liger", "quack",
             "jax.jit (XLA)"]
GATHER_IMPLS = ["xkern (torch)", "xkern (jax)", "previous (vstack + index)", "previous (zeros + index_put)",
                "index_select", "jnp.take + mask", "jnp.take"]
PASS_NAMES = {"fwd": "forward", "bwd": "backward alone", "fwd+bwd": "forward + backward"}


def _shape(row) -> str:
    m, n = row["shape"]
    return f"{m}×{n}"


def _cell(row) -> str:
    if row is None:
        return ""
    if row["status"].startswith("wrong"):
        return "wrong"
    if row["frac"] is None:
        return "–"
    return f"{row['frac']:.2f}"


def _ulp(row) -> str:
    ulp = (row or {}).get("ulp") or {}
    return " / ".join(f"{k} {v['max_ulp']}" for k, v in ulp.items()) if ulp else ""


def _table(rows, impls, first_col, extra=None) -> list[str]:
    """One markdown table: a line per shape (in the order first met), a column per implementation present,
    the best fraction of a line in bold; `extra` adds (title, fn(rows of the shape)) columns."""
    shapes = list(dict.fromkeys(_shape(r) for r in rows))
    present = [i for i in impls if any(r["impl"] == i for r in rows)]
    present += sorted({r["impl"] for r in rows} - set(present))
    extra = extra or []
    lines = ["| " + " | ".join([first_col] + present + [title for title, _ in extra]) + " |",
             "|" + "---|" * (1 + len(present) + len(extra))]
    for shape in shapes:
        by_impl = {r["impl"]: r for r in rows if _shape(r) == shape}
        fracs = [r["frac"] for r in by_impl.values() if r["frac"] is not None]
        best = max(fracs) if fracs else None
        cells = []
        for impl in present:
            cell = _cell(by_impl.get(impl))
            row = by_impl.get(impl)
            cells.append(f"**{cell}**" if row and row["frac"] is not None and row["frac"] == best else cell)
        cells += [fn(by_impl) for _, fn in extra]
        lines.append("| " + " | ".join([shape] + cells) + " |")
    return lines


def _versions(v: dict) -> str:
    names = [("torch", "torch"), ("triton", "triton"), ("jax", "jax"), ("jax-triton", "jax-triton"),
             ("liger-kernel", "Liger"), ("quack-kernels", "quack"), ("driver", "driver")]
    return ", ".join(f"{label} {v[key]}" for key, label in names if v.get(key))


def markdown(results: dict, json_rel: str, plots_rel: list[str]) -> str:
    rows = results["rows"]
    ceiling = results["ceiling"]
    out = [f"Measured on **{results['gpu']}**, {results['date']} ({_versions(results['versions'])}). "
           f"Copy ceiling **{ceiling['gbps']:.0f} GB/s** (device-to-device copy of "
           f"{ceiling['bytes'] / 2 / 2**30:g} GiB, bytes read + written).",
           "",
           "Each cell is the achieved bandwidth over the minimum bytes (each input read once, each output "
           "written once) as a fraction of that ceiling; the best of a line in bold; `wrong`: failed the "
           "FP64-oracle check, so not timed; `–`: not available or failed (the JSON says why). Device time: "
           "torch in CUDA graphs under `do_bench` (median), JAX inside one jitted `fori_loop`. "
           f"Data: [`{json_rel}`]({json_rel}); method: [`benchmarks/NOTES.md`](benchmarks/NOTES.md); "
           f"regenerate with `python -m benchmarks.report {json_rel}`.", ""]
    out += [f"![{os.path.basename(p)}]({p})" for p in plots_rel]
    rms = [r for r in rows if r["op"] == "rms_norm"]
    for dtype in dict.fromkeys(r["dtype"] for r in rms):
        for pass_ in ("fwd", "bwd", "fwd+bwd"):
            sel = [r for r in rms if r["dtype"] == dtype and r["pass"] == pass_]
            if not sel:
                continue
            extra = [("xkern µs", lambda by: f"{by['xkern (torch)']['us']:.1f}"
                      if by.get("xkern (torch)", {}).get("us") else ""),
                     ("xkern max ULP", lambda by: _ulp(by.get("xkern (torch)")))]
            out += ["", f"**RMSNorm, {dtype}, {PASS_NAMES[pass_]}** (rows × width)", ""]
            out += _table(sel, RMS_IMPLS, "shape", extra)
    eager = [r for r in rms if r["pass"] == "fwd+bwd" and r.get("us_eager")]
    if eager:
        out += ["", "**RMSNorm forward + backward launched eagerly from Python**: µs per step, host overhead "
                "(autograd, dispatch) included where it exceeds the device time", ""]
        shapes = list(dict.fromkeys((_shape(r), r["dtype"]) for r in eager))
        impls = [i for i in RMS_IMPLS if any(r["impl"] == i for r in eager)]
        out += ["| shape | " + " | ".join(impls) + " |", "|" + "---|" * (1 + len(impls))]
        for shape, dtype in shapes:
            by = {r["impl"]: r for r in eager if _shape(r) == shape and r["dtype"] == dtype}
            out.append(f"| {shape} {dtype} | " + " | ".join(f"{by[i]['us_eager']:.0f}" if i in by else ""
                                                           for i in impls) + " |")
    host = [h for h in results.get("host_overhead", []) if "wall_us" in h]
    if host:
        out += ["", f"**Host overhead per call** at {_shape(host[0])} bf16: wall-clock per call of a tight loop "
                "minus device time", "", "| front end | pass | wall µs/call | device µs | host µs |",
                "|---|---|---|---|---|"]
        out += [f"| {h['impl']} | {h['pass']} | {h['wall_us']:.1f} | {h['device_us']:.1f} | {h['host_us']:.1f} |"
                for h in host]
    gather = [r for r in rows if r["op"] in ("permute_rows", "unpermute_rows")]
    if gather:
        out += ["", f"Row gather: {results.get('permute', {}).get('routing', '')}; bytes (N + N_padded)·H·2."]
    for op in ("permute_rows", "unpermute_rows"):
        for pass_ in ("fwd", "bwd"):
            sel = [r for r in gather if r["op"] == op and r["pass"] == pass_]
            if sel:
                out += ["", f"**{op}, bf16, {PASS_NAMES[pass_]}** (tokens × hidden)", ""]
                out += _table(sel, GATHER_IMPLS, "T × H")
    if results.get("skipped"):
        out += ["", "Not run: " + "; ".join(results["skipped"])]
    return "\n".join(out) + "\n"


def plot(results: dict, out_dir: str, stem: str) -> list[str]:
    """One PNG per op: fraction of the copy ceiling per shape, a line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    groups = {"rms_norm": ([("rms_norm", p) for p in ("fwd", "bwd", "fwd+bwd")], RMS_IMPLS, "bfloat16"),
              "permute": ([(o, p) for o in ("permute_rows", "unpermute_rows") for p in ("fwd", "bwd")],
                          GATHER_IMPLS, "bfloat16")}
    for name, (panels, impls, dtype) in groups.items():
        panels = [(op, p) for op, p in panels
                  if any(r["op"] == op and r["pass"] == p and r["dtype"] == dtype for r in results["rows"])]
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), squeeze=False)
        for ax, (op, pass_) in zip(axes[0], panels, strict=True):
            sel = [r for r in results["rows"] if r["op"] == op and r["pass"] == pass_ and r["dtype"] == dtype]
            shapes = list(dict.fromkeys(_shape(r) for r in sel))
            for impl in [i for i in impls if any(r["impl"] == i and r["frac"] is not None for r in sel)]:
                by = {_shape(r): r["frac"] for r in sel if r["impl"] == impl}
                ys = [by.get(s) if by.get(s) is not None else float("nan") for s in shapes]
                style = "-o" if impl.startswith("xkern") else "--."
                ax.plot(range(len(shapes)), ys, style, label=impl, linewidth=2 if impl.startswith("xkern") else 1)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels(shapes, rotation=45, ha="right", fontsize=8)
            ax.set_ylim(0, 1.05)
            ax.set_title(f"{op} {PASS_NAMES[pass_]}, {dtype}", fontsize=10)
            ax.set_ylabel("fraction of copy bandwidth")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7, loc="lower right")
        fig.suptitle(f"{results['gpu']}, {results['date']}: copy ceiling {results['ceiling']['gbps']:.0f} GB/s",
                     fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{stem}-{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def update_readme(readme: str, body: str) -> bool:
    with open(readme) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        return False
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w") as f:
        f.write(f"{head}{BEGIN}\n## Benchmarks\n\n{body}{END}{tail}")
    return True


def write_all(json_path: str, readme: str | None, plots: bool = True, log=print) -> str:
    """Plots and the markdown table beside the JSON, README's section refreshed; returns the markdown."""
    with open(json_path) as f:
        results = json.load(f)
    out_dir = os.path.dirname(os.path.abspath(json_path))
    stem = os.path.splitext(os.path.basename(json_path))[0]
    paths = []
    if plots:
        try:
            paths = plot(results, out_dir, stem)
        except ImportError as err:
            log(f"plots: not drawn ({err}); run `python -m benchmarks.report {json_path}` where matplotlib is")
    base = os.path.dirname(os.path.abspath(readme)) if readme else ROOT
    md = markdown(results, os.path.relpath(os.path.abspath(json_path), base),
                  [os.path.relpath(p, base) for p in paths])
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(md)
    if readme and not update_readme(readme, md):
        log(f"{readme}: no benchmarks section markers, not updated")
    return md


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Tables, plots and README section from a benchmark JSON")
    parser.add_argument("json_path")
    parser.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    write_all(args.json_path, args.readme, plots=not args.no_plots)
    print(f"updated {args.readme} from {args.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
