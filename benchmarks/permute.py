"""The padded expert row gather, declared to the runner: `permute_rows` and `unpermute_rows` (forward and
backward) in both front ends, against torchtitan's implementation (zero-row `vstack` + index; zero-fill +
`index_put`), `torch.index_select` and `jnp.take` with masking.

Routing: T tokens x top-8 = N rows arrive rank-major from 8 ranks (expert parallel 8, 8 local experts:
64 groups), each row in a uniformly random group; alignment 16; `max_len` = N_padded exactly (the sum of
the aligned expert blocks). Bytes = (N + N_padded) * H * itemsize for every op and pass (unpermute need
not read the padding rows: that overstates its minimum by <= 0.2 % here).

Check: bit for bit against the same gather done by torch's index ops on the device (a gather is exact).
Each front end's indices come from its own `generate_permute_indices`, so a wrong layout fails too.
"""

from __future__ import annotations

import numpy as np

from benchmarks.runner import Case, Inputs, Op, same_bits_torch, to_jax
from xkern import reference as R

SHAPES = [(8192, 2048), (8192, 7168), (16384, 2048), (16384, 7168)]  # (tokens T, hidden H)
VALIDATE = [(64, 96), (40, 33)]
SMOKE = [(16, 40)]
TOP_K, EXPERTS_PER_RANK, NUM_RANKS, ALIGNMENT = 8, 8, 8, 16
DTYPE = "bfloat16"
ROUTING = (f"T x top-{TOP_K} rows from {NUM_RANKS} ranks x {EXPERTS_PER_RANK} local experts, uniform random "
           f"group per row, alignment {ALIGNMENT}, max_len = N_padded")


def routing(t: int, h: int) -> tuple[np.ndarray, int, int]:
    """(tokens_per_expert_group int32 [ranks * experts], N, N_padded), the same for the same (T, H)."""
    n = t * TOP_K
    groups = NUM_RANKS * EXPERTS_PER_RANK
    counts = np.random.default_rng(t + h).multinomial(n, np.full(groups, 1.0 / groups))
    totals = counts.reshape(NUM_RANKS, EXPERTS_PER_RANK).sum(axis=0)
    n_padded = int((-(-np.maximum(totals, ALIGNMENT) // ALIGNMENT) * ALIGNMENT).sum())
    return counts.astype(np.int32), n, n_padded


def layout(counts, n_pad: int, lib):
    """`generate_permute_indices` of a front end (`torch_api` or `jax_api`) on this routing."""
    return lib.generate_permute_indices(counts, EXPERTS_PER_RANK, NUM_RANKS, n_pad, ALIGNMENT)[0]


def _cases(op: str):
    def cases(mode: str) -> list[Case]:
        shapes = {"main": SHAPES, "validate": VALIDATE, "smoke": SMOKE}.get(mode, [])
        out = []
        for t, h in shapes:
            _, n, n_pad = routing(t, h)
            out.append(Case(op, (t, h), DTYPE, ("fwd", "bwd"), {"rows": n, "rows_padded": n_pad}))
        return out
    return cases


def min_bytes(case: Case, pass_: str) -> int:
    return (case.info["rows"] + case.info["rows_padded"]) * case.shape[1] * 2


# ---------------------------------------------------------------------------------------------------
# Implementations: torch fn(x, idx, idx64, inv64); JAX fn(x, idx, inv). idx: the front end's own layout.


def prev_permute(x, idx, idx64, inv64):
    import torch

    return torch.vstack((x, x.new_zeros((1, x.shape[1]))))[idx64]


def prev_unpermute(y, idx, idx64, inv64):
    out = y.new_zeros((inv64.shape[0] + 1, y.shape[1]))
    out[idx64] = y  # padding slots (-1) all land in the extra last row, dropped below
    return out[:-1]


def index_select_unpermute(y, idx, idx64, inv64):
    return y.index_select(0, inv64)


def torch_impls(case: Case) -> dict:
    import torch_api as tp

    n = case.info["rows"]
    if case.op == "permute_rows":
        return {"xkern (torch)": lambda x, idx, *_: tp.permute_rows(x, idx),
                "torchtitan (vstack + index)": prev_permute}
    return {"xkern (torch)": lambda y, idx, *_: tp.unpermute_rows(y, idx, n),
            "torchtitan (zeros + index_put)": prev_unpermute, "index_select": index_select_unpermute}


def jax_impls(case: Case) -> dict:
    import jax.numpy as jnp

    import jax_api as jp

    n = case.info["rows"]

    def take_permute(x, idx, inv):
        rows = jnp.take(x, jnp.maximum(idx, 0), axis=0, mode="clip")
        return jnp.where((idx >= 0)[:, None], rows, jnp.zeros((), x.dtype))

    def take_unpermute(y, idx, inv):
        return jnp.take(y, inv, axis=0, mode="clip")

    if case.op == "permute_rows":
        return {"xkern (jax)": lambda x, idx, inv: jp.permute_rows(x, idx), "jnp.take + mask": take_permute}
    return {"xkern (jax)": lambda y, idx, inv: jp.unpermute_rows(y, idx, n), "jnp.take": take_unpermute}


# ---------------------------------------------------------------------------------------------------
# Inputs and check


def make(case: Case, device: str, n_sets: int) -> Inputs:
    import jax.numpy as jnp
    import torch

    import jax_api
    import torch_api

    t, h = case.shape
    counts, n, n_pad = routing(t, h)
    gen = torch.Generator(device=device).manual_seed(t * 7 + h)
    rows_in, rows_out = (n, n_pad) if case.op == "permute_rows" else (n_pad, n)
    sets = [([torch.randn(rows_in, h, generator=gen, device=device, dtype=torch.bfloat16)],
             torch.randn(rows_out, h, generator=gen, device=device, dtype=torch.bfloat16)) for _ in range(n_sets)]
    idx_ref = R.generate_permute_indices(counts, EXPERTS_PER_RANK, NUM_RANKS, n_pad, ALIGNMENT)[0]
    idx64 = torch.from_numpy(idx_ref.astype(np.int64)).to(device)
    valid = idx64 >= 0
    inv64 = torch.full((n,), -1, dtype=torch.int64, device=device)
    inv64[idx64[valid]] = torch.arange(n_pad, device=device)[valid]
    idx_t = layout(torch.from_numpy(counts).to(device), n_pad, torch_api)

    # the truth by torch's index ops: permute gathers through idx (zero row at -1), unpermute through inv
    (x,), cot = sets[0]
    fwd, bwd = prev_permute, index_select_unpermute
    if case.op == "unpermute_rows":
        fwd, bwd = bwd, fwd
    ref = {"y": fwd(x, None, idx64, inv64), "dx": bwd(cot, None, idx64, inv64)}

    def jax_consts():
        return layout(jnp.asarray(counts), n_pad, jax_api), to_jax(inv64.to(torch.int32))

    return Inputs(sets, consts=(idx_t, idx64, inv64), jax_consts=jax_consts, ref=ref)


def check(case: Case, ref: dict, got: dict) -> tuple[dict, str | None]:
    bad = [key for key in ("y", "dx") if not same_bits_torch(got[key], ref[key])]
    return {}, f"{', '.join(bad)} differ from torch's index ops" if bad else None


PERMUTE = Op("permute_rows", _cases("permute_rows"), make, check, min_bytes, torch_impls, jax_impls, ("dx",))
UNPERMUTE = Op("unpermute_rows", _cases("unpermute_rows"), make, check, min_bytes, torch_impls, jax_impls, ("dx",))
