"""Run as a script, `python tests/scalars_fresh.py torch|jax` (tests/test_scalars.py does): each scalar argument
as an odd type (numpy integers and floats, an int eps), then the plain Python value equal to it, in one
process whose caches have never seen that call. np.int64(5) == 5 and hashes alike, so a plan cached for the
numpy call is reused by the plain one: both must be right whichever comes first.

Every case uses shapes and values no earlier case used, so every cache keyed on them (executors, recipes,
jit traces) is as fresh as in a new process; the one process saves the imports. Each result is checked
against the FP64 oracle, and the odd call's bit for bit against the plain call's. Prints `ok <case>` per
case; a failure prints its traceback and exits 1.
"""

from __future__ import annotations

import sys
import traceback

import numpy as np

from xkern import reference as R

ODD_INTS = (np.int64, np.int32)
ODD_EPS = ((np.float32(0.25), 0.25), (1, 1.0), (np.int64(2), 2.0))


def _index(rng, n_slots: int, num_rows: int) -> np.ndarray:
    """Slots naming rows 0..num_rows-1 once each, -1 elsewhere, shuffled."""
    idx = np.full(n_slots, -1, np.int32)
    idx[rng.permutation(n_slots)[:num_rows]] = np.arange(num_rows, dtype=np.int32)
    return idx


def _close(got, want, tol: float = 1e-5) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.allclose(got, want, rtol=tol, atol=tol), np.abs(got - want).max()


def _same(a, b) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _int_case(api, to, back, permute_grad, odd, k: int, rng) -> None:
    """unpermute_rows, permute_rows' backward, inverse_permutation and generate_permute_indices with every
    integer argument of type `odd`, then as plain ints; shapes and values the k-th case's own."""
    rows, slots, h = 5 + k, 6 + 2 * k, 16  # one width: the same binaries (fewer compiles on a GPU)
    idx = _index(rng, slots, rows)
    y = rng.standard_normal((slots, h)).astype(np.float32)
    want = R.unpermute_rows(y, idx, rows)
    first = api.unpermute_rows(to(y), to(idx), odd(rows))
    _same(back(api.unpermute_rows(to(y), to(idx), rows)), want)
    _same(back(first), want)
    # permute_rows' backward is unpermute_rows on x's row count (torch: the same executor)
    g = rng.standard_normal((slots, h)).astype(np.float32)
    _same(permute_grad(rng.standard_normal((rows, h)).astype(np.float32), idx, g), R.unpermute_rows(g, idx, rows))
    inv_rows = rows + 20
    inv_idx = _index(rng, slots + 20, inv_rows)
    want = R.inverse_permutation(inv_idx, inv_rows)
    first = api.inverse_permutation(to(inv_idx), odd(inv_rows))
    _same(back(api.inverse_permutation(to(inv_idx), inv_rows)), want)
    _same(back(first), want)
    layout = (2 + k, 2, 64 + 8 * k, 4 + k)  # experts_per_rank, num_ranks, max_len, alignment
    counts = rng.integers(0, 6, layout[0] * layout[1]).astype(np.int32)
    first = api.generate_permute_indices(to(counts), *map(odd, layout))
    plain = api.generate_permute_indices(to(counts), *layout)
    for a, b, c in zip(first, plain, R.generate_permute_indices(counts, *layout)):
        _same(back(b), c)
        _same(back(a), c)


def _eps_case(fwd_bwd, odd, plain, k: int, rng) -> None:
    """rms_norm forward and backward (`fwd_bwd(x, w, dy, eps)` -> numpy y, dx, dw) with eps `odd`, then
    `plain`: the plain call against the FP64 oracle, the odd call bit for bit against it."""
    rows, h = 3 + k, 16 + 16 * k
    x = rng.standard_normal((rows, h)).astype(np.float32)
    w = rng.standard_normal(h).astype(np.float32)
    dy = rng.standard_normal((rows, h)).astype(np.float32)
    first, second = fwd_bwd(x, w, dy, odd), fwd_bwd(x, w, dy, plain)
    dx_ref, dw_ref, _ = R.rms_norm_bwd(x, w, dy, plain)
    for got, want in zip(second, (R.rms_norm_fwd(x, w, plain), dx_ref, dw_ref)):
        _close(got, want)
    for a, b in zip(first, second):
        _same(a, b)


def _cases(name: str, api, to, back, permute_grad, fwd_bwd, rng):
    for k, odd in enumerate(ODD_INTS):
        yield (f"{name} {odd.__name__} num_rows, experts_per_rank, num_ranks, max_len, alignment",
               lambda odd=odd, k=k: _int_case(api, to, back, permute_grad, odd, k, rng))
    for k, (odd, plain) in enumerate(ODD_EPS):
        yield f"{name} eps {type(odd).__name__} then {plain!r}", lambda odd=odd, plain=plain, k=k: _eps_case(
            fwd_bwd, odd, plain, k, rng)


def cases_torch(rng):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import torch_api as api

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    back = lambda a: a.detach().cpu().numpy()  # noqa: E731

    def permute_grad(x, idx, g):
        x = to(x).requires_grad_()
        api.permute_rows(x, to(idx)).backward(to(g))
        return back(x.grad)

    def fwd_bwd(x, w, dy, eps):
        x, w = to(x).requires_grad_(), to(w).requires_grad_()
        y = api.rms_norm(x, w, eps)
        y.backward(to(dy))
        return back(y), back(x.grad), back(w.grad)

    yield from _cases("torch", api, to, back, permute_grad, fwd_bwd, rng)

    class Passthrough(TorchDispatchMode):  # any mode takes the registered ops' path (run_recipe)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def under_mode():
        rows, slots, h = 11, 13, 40
        idx = _index(rng, slots, rows)
        y = rng.standard_normal((slots, h)).astype(np.float32)
        with Passthrough():
            first = api.unpermute_rows(to(y), to(idx), np.int64(rows))
            _same(back(api.unpermute_rows(to(y), to(idx), rows)), R.unpermute_rows(y, idx, rows))
        _same(back(first), R.unpermute_rows(y, idx, rows))

    yield "torch np.int64 num_rows through the registered op (a dispatch mode)", under_mode


def cases_jax(rng):
    import jax
    import jax.numpy as jnp

    import jax_api as api

    def permute_grad(x, idx, g):
        return jax.grad(lambda a: (api.permute_rows(a, jnp.asarray(idx)) * g).sum())(jnp.asarray(x))

    def fwd_bwd(x, w, dy, eps):
        y, vjp = jax.vjp(lambda a, b: api.rms_norm(a, b, eps), jnp.asarray(x), jnp.asarray(w))
        return (y, *vjp(jnp.asarray(dy)))

    yield from _cases("jax", api, jnp.asarray, np.asarray, permute_grad, fwd_bwd, rng)


def main(front_end: str) -> int:
    rng = np.random.default_rng(32)
    failed = 0
    for name, case in {"torch": cases_torch, "jax": cases_jax}[front_end](rng):
        try:
            case()
            print(f"ok {name}", flush=True)
        except Exception:
            failed += 1
            print(f"FAILED {name}", flush=True)
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
