"""Padded expert row gather benchmark: `permute_rows`, `unpermute_rows` and their backwards in both front
ends, against the previous implementation (zero-row `vstack` + index; zero-fill + `index_put`),
`torch.index_select` and `jnp.take` with masking.

Routing: T tokens x top-8 = N rows arrive rank-major from 8 ranks (expert parallel 8, 8 local experts:
64 groups), each row in a uniformly random group; alignment 16; `max_len` = N_padded exactly (the sum of
the aligned expert blocks). Bytes = (N + N_padded) * H * itemsize for every op and pass (unpermute need
not read the padding rows: that overstates its minimum by <= 0.2 % here).

Every xkern output is compared bit for bit with the same gather done by torch's own index ops (a gather
is exact), and the JAX front end's with the torch front end's; a mismatch gets no speed.
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace

import numpy as np
import torch

from benchmarks import timing
from benchmarks._helpers import rand, same_bits, to_numpy, to_torch
from benchmarks.timing import error_status as _err
from xkern import reference as R

DEVICE = "cuda"  # the benchmark runs on the GPU; CPU only in dry runs of this code
SHAPES = [(8192, 2048), (8192, 7168), (16384, 2048), (16384, 7168)]  # (tokens T, hidden H)
QUICK_SHAPES = [(8192, 2048)]
TOP_K, EXPERTS_PER_RANK, NUM_RANKS, ALIGNMENT = 8, 8, 8, 16
DTYPE = "bfloat16"
OPS = (("permute_rows", "fwd"), ("permute_rows", "bwd"), ("unpermute_rows", "fwd"), ("unpermute_rows", "bwd"))
API = ("generate_permute_indices", "permute_rows", "inverse_permutation", "unpermute_rows")
ROUTING = (f"T x top-{TOP_K} rows from {NUM_RANKS} ranks x {EXPERTS_PER_RANK} local experts, uniform random "
           f"group per row, alignment {ALIGNMENT}, max_len = N_padded")


def load(front: str):
    """`torch_api.permute` / `jax_api.permute`, or a 'skipped: why' string while it is not there."""
    try:
        mod = importlib.import_module(f"{front}.permute")
        for name in API:
            getattr(mod, name)
    except Exception as err:  # noqa: BLE001 - written concurrently by another engineer
        return f"skipped: {front}.permute not importable ({type(err).__name__}: {err})"
    return mod


def routing(t: int, rng: np.random.Generator) -> tuple[np.ndarray, int, int]:
    """(tokens_per_expert_group int32 [ranks * experts], N, N_padded)."""
    n = t * TOP_K
    groups = NUM_RANKS * EXPERTS_PER_RANK
    counts = rng.multinomial(n, np.full(groups, 1.0 / groups))
    totals = counts.reshape(NUM_RANKS, EXPERTS_PER_RANK).sum(axis=0)
    n_padded = int((-(-np.maximum(totals, ALIGNMENT) // ALIGNMENT) * ALIGNMENT).sum())
    return counts.astype(np.int32), n, n_padded


# ---------------------------------------------------------------------------------------------------
# Implementations: fn(input, ctx); ctx holds the indices (and N) in the framework's arrays.


def prev_permute(x, c):
    return torch.vstack((x, x.new_zeros((1, x.shape[1]))))[c.idx64]


def prev_unpermute(y, c):
    out = y.new_zeros((c.n + 1, y.shape[1]))
    out[c.idx64] = y  # padding slots (-1) all land in the extra last row, dropped below
    return out[:-1]


def index_select_unpermute(y, c):
    return y.index_select(0, c.inv64)


def torch_impls(tp) -> dict:
    """op -> {name: fn or 'skipped: why'}."""
    xk_perm = tp if isinstance(tp, str) else (lambda x, c: tp.permute_rows(x, c.idx))
    xk_unperm = tp if isinstance(tp, str) else (lambda y, c: tp.unpermute_rows(y, c.idx, c.n))
    return {"permute_rows": {"xkern (torch)": xk_perm, "previous (vstack + index)": prev_permute},
            "unpermute_rows": {"xkern (torch)": xk_unperm, "previous (zeros + index_put)": prev_unpermute,
                               "index_select": index_select_unpermute}}


def jax_impls(jp) -> dict:
    import jax.numpy as jnp

    def take_permute(x, c):
        rows = jnp.take(x, jnp.maximum(c.idx, 0), axis=0, mode="clip")
        return jnp.where((c.idx >= 0)[:, None], rows, jnp.zeros((), x.dtype))

    def take_unpermute(y, c):
        return jnp.take(y, c.inv, axis=0, mode="clip")

    xk_perm = jp if isinstance(jp, str) else (lambda x, c: jp.permute_rows(x, c.idx))
    xk_unperm = jp if isinstance(jp, str) else (lambda y, c: jp.unpermute_rows(y, c.idx, c.n))
    return {"permute_rows": {"xkern (jax)": xk_perm, "jnp.take + mask": take_permute},
            "unpermute_rows": {"xkern (jax)": xk_unperm, "jnp.take": take_unpermute}}


# ---------------------------------------------------------------------------------------------------
# Timed passes


def torch_make_calls(fn, pass_, inp, cot, c):
    def make():
        if pass_ == "fwd":
            return [functools.partial(fn, inp, c)]
        leaf = inp.detach().requires_grad_()
        out = fn(leaf, c)
        return [functools.partial(torch.autograd.grad, out, (leaf,), cot, retain_graph=True)]
    return make


def jax_step(fn, pass_, n):
    """state (input, last output) -> (input with its row 0 replaced by the output's, output): the next
    iteration depends on this one at the cost of one row. consts: index arrays (fwd) or the vjp (bwd)."""
    def step(consts, state):
        inp, _ = state
        if pass_ == "fwd":
            out = fn(inp, SimpleNamespace(idx=consts[0], inv=consts[1], n=n))
        else:
            (out,) = consts[0](inp)
        return inp.at[0].set(out[0]), out
    return step


def jax_consts_state(fn, pass_, inp, cot, c):
    import jax
    import jax.numpy as jnp

    if pass_ == "fwd":
        consts, first = (c.idx, c.inv), inp
        out_shape = jax.eval_shape(lambda a: fn(a, c), inp)
    else:
        _, vjp = jax.vjp(lambda a: fn(a, c), inp)
        consts, first = (vjp,), cot
        out_shape = inp
    return consts, (jnp.copy(first), jnp.zeros(out_shape.shape, out_shape.dtype))


def _row(op, pass_, impl, t, h, n, n_pad, ceiling, **fields):
    nbytes = (n + n_pad) * h * 2
    row = {"op": op, "pass": pass_, "impl": impl, "shape": [t, h], "dtype": DTYPE, "rows": n,
           "rows_padded": n_pad, "bytes": nbytes, "us": None, "gbps": None, "frac": None, "status": "ok"}
    row.update(fields)
    if row["us"]:
        row["gbps"] = nbytes / row["us"] / 1e3
        row["frac"] = row["gbps"] / ceiling
    return row


def _to_jax(t):
    """A torch CUDA tensor as a JAX array (DLPack; a host round trip if that fails)."""
    import jax

    try:
        return jax.dlpack.from_dlpack(t)
    except Exception:  # noqa: BLE001
        return jax.device_put(to_numpy(t))


def _equal(a, b) -> bool:
    """Bit for bit; torch tensors compared on the device, anything else through host copies."""
    if isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        try:
            b = torch.from_dlpack(b)
        except Exception:  # noqa: BLE001
            return same_bits(a, b)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _exact(got, want: np.ndarray) -> bool:
    got = to_numpy(got)
    return got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got.view(np.uint8),
                                                                                   want.view(np.uint8))


def run_shape(t: int, h: int, ceiling: float, log) -> list[dict]:
    import jax
    import jax.numpy as jnp

    tp, jp = load("torch_api"), load("jax_api")
    counts, n, n_pad = routing(t, np.random.default_rng(t + h))
    gen = torch.Generator(device=DEVICE).manual_seed(t * 7 + h)
    a = torch.randn(n, h, generator=gen, device=DEVICE, dtype=torch.bfloat16)      # permute input / unpermute grad
    b = torch.randn(n_pad, h, generator=gen, device=DEVICE, dtype=torch.bfloat16)  # unpermute input / permute grad
    idx_ref = R.generate_permute_indices(counts, EXPERTS_PER_RANK, NUM_RANKS, n_pad, ALIGNMENT)[0]
    idx64 = torch.from_numpy(idx_ref.astype(np.int64)).to(DEVICE)
    valid = idx64 >= 0
    inv64 = torch.empty(n, dtype=torch.int64, device=DEVICE)
    inv64[idx64[valid]] = torch.arange(n_pad, device=DEVICE)[valid]
    out = []

    # the truth of each op and pass, by torch's index ops
    truth = {("permute_rows", "fwd"): prev_permute(a, SimpleNamespace(idx64=idx64)),
             ("permute_rows", "bwd"): b.index_select(0, inv64),
             ("unpermute_rows", "fwd"): b.index_select(0, inv64),
             ("unpermute_rows", "bwd"): prev_permute(a, SimpleNamespace(idx64=idx64))}
    inputs = {"permute_rows": (a, b), "unpermute_rows": (b, a)}  # (input, cotangent)

    def result(fn, pass_, inp, cot, c):
        if pass_ == "fwd":
            return fn(inp, c)
        leaf = inp.detach().requires_grad_()
        return torch.autograd.grad(fn(leaf, c), (leaf,), cot)[0]

    # torch
    ctx_t = SimpleNamespace(n=n, idx64=idx64, inv64=inv64, idx=None)
    checks = {}
    if isinstance(tp, str):
        log(f"permute {t}x{h}: torch front end {tp}")
    else:
        counts_t = torch.from_numpy(counts).to(DEVICE)
        idx_t = tp.generate_permute_indices(counts_t, EXPERTS_PER_RANK, NUM_RANKS, n_pad, ALIGNMENT)[0]
        ctx_t.idx = idx_t
        if not np.array_equal(to_numpy(idx_t), idx_ref):
            checks = {key: "fail: generate_permute_indices differs from the reference" for key in OPS}
    for op, impls in torch_impls(tp).items():
        for name, fn in impls.items():
            for pass_ in ("fwd", "bwd"):
                inp, cot = inputs[op]
                fields = {}
                if isinstance(fn, str):
                    out.append(_row(op, pass_, name, t, h, n, n_pad, ceiling, status=fn))
                    continue
                try:
                    if name.startswith("xkern"):
                        chk = checks.get((op, pass_))
                        if chk is None:
                            got = result(fn, pass_, inp, cot, ctx_t)
                            chk = "pass" if _equal(got, truth[(op, pass_)]) else "fail: differs from torch index ops"
                            checks[(op, pass_)] = chk
                            del got
                        fields["check"] = chk
                        if chk != "pass":
                            out.append(_row(op, pass_, name, t, h, n, n_pad, ceiling,
                                            status="wrong answer: not timed", **fields))
                            continue
                    fields["us"], fields["timing"] = timing.torch_device_us(
                        torch_make_calls(fn, pass_, inp, cot, ctx_t))
                except Exception as err:  # noqa: BLE001
                    fields.update(us=None, status=_err(err))
                out.append(_row(op, pass_, name, t, h, n, n_pad, ceiling, **fields))
            torch.cuda.empty_cache()

    # JAX
    a_j, b_j = _to_jax(a), _to_jax(b)
    idx_j = jnp.asarray(idx_ref)
    inv_j = jnp.asarray(to_numpy(inv64).astype(np.int32))
    ctx_j = SimpleNamespace(n=n, idx=idx_j, inv=inv_j)
    inputs_j = {"permute_rows": (a_j, b_j), "unpermute_rows": (b_j, a_j)}
    if not isinstance(jp, str):
        idx_jx = jp.generate_permute_indices(jnp.asarray(counts), EXPERTS_PER_RANK, NUM_RANKS, n_pad, ALIGNMENT)[0]
        if not np.array_equal(np.asarray(idx_jx), idx_ref):
            log(f"permute {t}x{h}: jax generate_permute_indices differs from the reference")
            ctx_j.idx = None
    for op, impls in jax_impls(jp).items():
        for name, fn in impls.items():
            for pass_ in ("fwd", "bwd"):
                inp, cot = inputs_j[op]
                fields = {}
                if isinstance(fn, str):
                    out.append(_row(op, pass_, name, t, h, n, n_pad, ceiling, status=fn))
                    continue
                try:
                    if name.startswith("xkern"):
                        if ctx_j.idx is None:
                            chk = "fail: generate_permute_indices differs from the reference"
                        else:
                            if pass_ == "fwd":
                                got = fn(inp, ctx_j)
                            else:
                                got = jax.vjp(lambda x, fn=fn: fn(x, ctx_j), inp)[1](cot)[0]
                            chk = "pass" if _equal(truth[(op, pass_)], got) else "fail: differs from torch"
                            del got
                        fields["check"] = chk
                        if chk != "pass":
                            out.append(_row(op, pass_, name, t, h, n, n_pad, ceiling,
                                            status="wrong answer: not timed", **fields))
                            continue
                    consts, state = jax_consts_state(fn, pass_, inp, cot, ctx_j)
                    est = max(5.0, (n + n_pad) * h * 2 / (0.5 * ceiling * 1e3))
                    fields["us"], fields["timing"] = timing.jax_device_us(jax_step(fn, pass_, n), consts, state, est)
                except Exception as err:  # noqa: BLE001
                    fields.update(us=None, status=_err(err))
                out.append(_row(op, pass_, name, t, h, n, n_pad, ceiling, **fields))
    bad = [f"{r['impl']} {r['op']} {r['pass']}" for r in out if r.get("check", "pass") != "pass"]
    log(f"permute {t}x{h} (N {n}, N_padded {n_pad}): xkern checks {'pass' if not bad else 'FAIL: ' + ', '.join(bad)}")
    del a, b, a_j, b_j, truth
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------------
# CPU: interpreter-mode validation of both front ends


def _perm_j(jp, idx, x):
    return jp.permute_rows(x, idx)


def _unperm_j(jp, idx, n, y):
    return jp.unpermute_rows(y, idx, n)


def validate_cpu(log) -> bool | None:
    """Both front ends under the interpreter against `xkern.reference` (exact), torch == JAX bit for bit.
    None when the permute modules are not there yet."""
    import jax
    import jax.numpy as jnp

    tp, jp = load("torch_api"), load("jax_api")
    for mod in (tp, jp):
        if isinstance(mod, str):
            log(f"  permute: {mod}")
            return None
    rng = np.random.default_rng(1)
    ok = True
    for t, h in ((64, 96), (40, 33)):
        counts, n, n_pad = routing(t, rng)
        idx = R.generate_permute_indices(counts, EXPERTS_PER_RANK, NUM_RANKS, n_pad, ALIGNMENT)[0]
        x, dy = rand(rng, (n, h), DTYPE), rand(rng, (n_pad, h), DTYPE)
        want = {"idx": idx, "permute": R.permute_rows(x, idx), "permute_bwd": R.unpermute_rows(dy, idx, n),
                "unpermute": R.unpermute_rows(dy, idx, n), "unpermute_bwd": R.permute_rows(x, idx)}
        idx_t = tp.generate_permute_indices(to_torch(counts), EXPERTS_PER_RANK, NUM_RANKS, n_pad, ALIGNMENT)[0]
        xt, dyt = to_torch(x).requires_grad_(), to_torch(dy).requires_grad_()
        yt = tp.permute_rows(xt, idx_t)
        ut = tp.unpermute_rows(dyt, idx_t, n)
        got_t = {"idx": idx_t, "permute": yt, "permute_bwd": torch.autograd.grad(yt, xt, to_torch(dy))[0],
                 "unpermute": ut, "unpermute_bwd": torch.autograd.grad(ut, dyt, to_torch(x))[0]}
        idx_j = jp.generate_permute_indices(jnp.asarray(counts), EXPERTS_PER_RANK, NUM_RANKS, n_pad, ALIGNMENT)[0]
        yj, vjp_p = jax.vjp(functools.partial(_perm_j, jp, idx_j), jnp.asarray(x))
        uj, vjp_u = jax.vjp(functools.partial(_unperm_j, jp, idx_j, n), jnp.asarray(dy))
        got_j = {"idx": idx_j, "permute": yj, "permute_bwd": vjp_p(jnp.asarray(dy))[0],
                 "unpermute": uj, "unpermute_bwd": vjp_u(jnp.asarray(x))[0]}
        bad = [k for k in want if not _exact(got_t[k], want[k]) or not same_bits(got_t[k], got_j[k])]
        log(f"  permute T={t} (N {n}, N_padded {n_pad}) H={h} {DTYPE}: indices, permute, unpermute and both "
            f"backwards exact vs reference and torch == jax bitwise: {'pass' if not bad else 'FAIL ' + str(bad)}")
        ok = ok and not bad
    return ok
