"""How xkern's rows of a result set compare: with the fastest peer and across its two front ends, each pair
timed by one method (the profiler's where both rows have it, else the CUDA graphs' of the torch rows).
`benchmarks.report` (the tables) and `benchmarks.readme` (README's summary) both read them from here."""

from __future__ import annotations


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
