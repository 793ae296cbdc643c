"""Where xkern's JAX front end spends its time against its torch front end, on the benchmark's worst shapes:
for each case and pass, each kernel launched per call with its device time (the profiler's, the
benchmark's method: `timing.profile_device_us`), for torch_api, jax_api and XLA's own RMSNorm (CUPTI
records XLA's kernels too: its kernels listed here show it), beside the earlier methods (torch: CUDA graph
under do_bench; JAX: host wall time of a jitted fori_loop) and the host's time to issue one call.

    python3 -m tools.jax_torch_profile [--out DIR] [--cases all|quick]

Reading it: the same kernels with the same device time in both front ends, and a JAX loop time above
the JAX device time by about the JAX host issue time, say that the difference the loop measured is host
launch cost (XLA's thunk and jax-triton's custom call, per kernel), not device work. A kernel in one list
only, or one whose time differs, is device work to remove. Without a GPU it runs through once at tiny
sizes (smoke: not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# (op, shape, passes): rms_norm's worst JAX / torch ratios on the H100 (main set) and unpermute_rows' worst
CASES = {"quick": [("rms_norm", (32768, 128), ("fwd", "bwd", "fwd+bwd"))],
         "all": [("rms_norm", (32768, 128), ("fwd", "bwd", "fwd+bwd")),
                 ("rms_norm", (65536, 256), ("fwd+bwd",)),
                 ("rms_norm", (8192, 2048), ("fwd+bwd",)),
                 ("unpermute_rows", (16384, 7168), ("fwd",))]}
SMOKE_CASES = [("rms_norm", (9, 128), ("fwd", "bwd", "fwd+bwd")), ("unpermute_rows", (16, 40), ("fwd",))]


def _case(op_name: str, shape):
    from benchmarks import permute as P
    from benchmarks import rms_norm as RN
    from benchmarks.runner import Case

    if op_name == "rms_norm":
        return RN.OP, Case("rms_norm", shape, "bfloat16", RN.PASSES)
    op = P.PERMUTE if op_name == "permute_rows" else P.UNPERMUTE
    _, n, n_pad = P.routing(*shape)
    return op, Case(op_name, shape, P.DTYPE, ("fwd", "bwd"), {"rows": n, "rows_padded": n_pad})


def profile_case(op_name: str, shape, passes, device: str) -> list[dict]:
    """A dict per (pass, implementation): device µs per call by each method, host issue µs, kernels."""
    from benchmarks import timing
    from benchmarks.runner import jax_calls, jax_loop, to_jax, torch_make_calls

    op, case = _case(op_name, shape)
    inputs = op.make(case, device, timing.n_sets(op.min_bytes(case, "fwd")))
    jsets = [([to_jax(a) for a in args], to_jax(cot)) for args, cot in inputs.sets]
    jconsts = inputs.jax_consts()
    torch_impls, jax_impls = op.torch_impls(case), op.jax_impls(case)
    impls = [("torch", "xkern (torch)", torch_impls["xkern (torch)"]), ("jax", "xkern (jax)", jax_impls["xkern (jax)"])]
    if op_name == "rms_norm":
        impls.append(("jax", "jax.jit (XLA)", jax_impls["jax.jit (XLA)"]))
    out = []
    for pass_ in passes:
        for framework, name, fn in impls:
            row = {"op": op_name, "shape": list(shape), "pass": pass_, "impl": name, "input_sets": len(jsets)}
            try:
                if framework == "torch":
                    calls, sync = torch_make_calls(fn, pass_, inputs)(), timing.torch_sync
                    row["graph_us"], _ = timing.torch_device_us(torch_make_calls(fn, pass_, inputs))
                else:
                    calls, sync = jax_calls(fn, pass_, jsets, jconsts), timing.jax_sync
                    step, consts, state = jax_loop(fn, pass_, jsets, jconsts)
                    loop_us, _ = timing.jax_device_us(step, consts, state, len(jsets) * 10.0)
                    row["loop_us"] = loop_us / len(jsets)
                row["device_us"], row["timing"], row["kernels"] = timing.profile_device_us(calls, sync)
                row["host_wall_us"], row["host_issue_us"] = timing.host_us_per_call(calls[0], sync, 500)
            except Exception as err:  # noqa: BLE001 - one failing implementation must not hide the others
                row["status"] = timing.error_status(err)
            out.append(row)
    return out


def text(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        head = f"## {row['op']} {'x'.join(map(str, row['shape']))} bf16 {row['pass']}, {row['impl']}"
        if "status" in row:
            lines += [head + f": {row['status']}"]
            continue
        other = (f"CUDA graph (do_bench) {row['graph_us']:.2f} µs" if "graph_us" in row else
                 f"fori_loop (host wall) {row['loop_us']:.2f} µs")
        lines.append(f"{head}: device {row['device_us']:.2f} µs/call; {other}; host per call: issue "
                     f"{row['host_issue_us']:.1f} µs, wall {row['host_wall_us']:.1f} µs; {row['input_sets']} set(s)")
        lines += [f"    {k['us']:8.2f} µs  x{k['count']:<4.3g} {k['cat']:<10} {k['name'][:100]}"
                  for k in row["kernels"]]
    pairs = {}
    for row in rows:
        if row.get("device_us") and row["impl"].startswith("xkern"):
            pairs.setdefault((row["op"], tuple(row["shape"]), row["pass"]), {})[row["impl"]] = row["device_us"]
    lines += ["", "JAX / torch, device time per call (torch µs / JAX µs: below 1, JAX is slower):"]
    for (op, shape, pass_), by in pairs.items():
        if len(by) == 2:
            t, j = by["xkern (torch)"], by["xkern (jax)"]
            lines.append(f"  {op} {'x'.join(map(str, shape))} {pass_}: torch {t:.2f} µs, JAX {j:.2f} µs, {t / j:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for jax_torch_profile.json and .txt")
    parser.add_argument("--cases", choices=tuple(CASES), default="all")
    args = parser.parse_args(argv)
    from benchmarks.main import GPU  # noqa: I001 - first: sets the platform env on CPU
    from benchmarks import timing

    timing.set_smoke(not GPU)
    device = "cuda" if GPU else "cpu"
    rows = []
    for op_name, shape, passes in CASES[args.cases] if GPU else SMOKE_CASES:
        rows += profile_case(op_name, shape, passes, device)
        print(f"{op_name} {shape}: done", file=sys.stderr, flush=True)
    report = text(rows)
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "jax_torch_profile.json"), "w") as f:
            json.dump({"smoke": timing.smoke(), "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "jax_torch_profile.txt"), "w") as f:
            f.write(report + "\n")
    return 0 if all("status" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
