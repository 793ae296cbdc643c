"""RMSNorm benchmark: xkern's torch and JAX front ends against their peers, forward, backward alone and
forward + backward (a training step), bf16 and a few fp16 shapes.

Minimum bytes (w in x's dtype): forward reads x and w and writes y; backward reads x, dy and w and writes
dx and dw; forward + backward is the sum of the two (a training step runs them at different times, so x is
read twice). Every xkern result is checked against the FP64 oracle (`xkern.reference.check`) before it is
timed: a wrong answer gets no speed. Peers' forward outputs get the same ULP statistics, reported only.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from benchmarks import timing
from benchmarks._helpers import TORCH_DTYPES, rand, same_bits, to_numpy, to_torch
from benchmarks.timing import error_status as _err
from xkern import reference as R

DEVICE = "cuda"  # the benchmark runs on the GPU; CPU only in dry runs of this code
EPS = 1e-6
SHAPES = [(262144, 128), (32768, 128), (262144, 64), (65536, 256), (8192, 2048), (32768, 4096), (8192, 8192),
          (4096, 16384), (2048, 32768), (1024, 65536)]
SHAPES_FP16 = [(262144, 128), (8192, 2048), (4096, 16384)]
QUICK_SHAPES = [(32768, 128), (8192, 2048), (1024, 65536)]
HOST_SHAPE = (1024, 128)
PASSES = ("fwd", "bwd", "fwd+bwd")
SAMPLE_ELEMS = 2**21  # y and dx are checked on evenly spaced rows adding up to about this; dw on every row
CHUNK_ELEMS = 2**18   # rows per oracle task (threads; small chunks stay in the CPU caches)
CPU_SHAPES = [((64, 128), "bfloat16"), ((37, 1000), "bfloat16"), ((4, 9000), "bfloat16"), ((5, 16500), "bfloat16"),
              ((48, 256), "float16")]


def min_bytes(pass_: str, m: int, n: int, itemsize: int) -> int:
    fwd = 2 * m * n * itemsize + n * itemsize
    bwd = 3 * m * n * itemsize + 2 * n * itemsize
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[pass_]


# ---------------------------------------------------------------------------------------------------
# Implementations


def hf_rms_norm(x, w, eps: float = EPS):
    """The Hugging Face Llama expression, as eager PyTorch runs it."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def xla_rms_norm(x, w, eps: float = EPS):
    """The same expression in jax.numpy (XLA fuses it under jit)."""
    import jax
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    return w * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _xkern_torch(x, w):
    import torch_api

    return torch_api.rms_norm(x, w, EPS)


def _xkern_jax(x, w):
    import jax_api

    return jax_api.rms_norm(x, w, EPS)


def _f_rms_norm(x, w):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, EPS)


@functools.cache
def _liger():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception as err:  # noqa: BLE001 - optional peer
        return f"skipped: liger-kernel not importable ({type(err).__name__}: {err})"
    # Llama casting mode; in_place=True (its default) writes dx into dy: each call gets its own dy clone.
    return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", True)


@functools.cache
def _quack():
    try:
        from quack.rmsnorm import rmsnorm
    except Exception as err:  # noqa: BLE001 - optional peer
        return f"skipped: quack not importable ({type(err).__name__}: {err}); see benchmarks/carry_quack.md"
    return lambda x, w: rmsnorm(x, w, eps=EPS)


def _configure_dynamo():
    import torch._dynamo.config as cfg

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 4096)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True  # a fallback to eager raises instead of running eager


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def torch_impls() -> dict:
    """name -> fn(x, w), or a 'skipped: why' string. torch.compile is made per shape by `run_shape`."""
    return {"xkern (torch)": _xkern_torch, "HF eager": hf_rms_norm, "F.rms_norm": _f_rms_norm,
            "torch.compile": None, "Liger": _liger(), "quack": _quack()}


JAX_IMPLS = {"xkern (jax)": _xkern_jax, "jax.jit (XLA)": xla_rms_norm}


# ---------------------------------------------------------------------------------------------------
# Oracle and checks


def sample_rows(m: int, n: int) -> np.ndarray:
    return np.unique(np.linspace(0, m - 1, min(m, max(1, SAMPLE_ELEMS // n))).round().astype(np.int64))


def oracle(x: np.ndarray, w: np.ndarray, dy: np.ndarray, rows: np.ndarray) -> dict:
    """FP64 truth: y and dx at `rows`, dw and its tolerance over every row (row chunks in threads)."""
    step = max(1, CHUNK_ELEMS // x.shape[1])

    def chunk(start):
        stop = min(start + step, x.shape[0])
        dx, dw, tol = R.rms_norm_bwd(x[start:stop], w, dy[start:stop], EPS)
        return dx[rows[(rows >= start) & (rows < stop)] - start], dw, tol

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        parts = list(pool.map(chunk, range(0, x.shape[0], step)))
    return {"fwd": R.rms_norm_fwd(x[rows], w, EPS), "dx": np.concatenate([p[0] for p in parts]),
            "dw": sum(p[1] for p in parts), "dw_tol": sum(p[2] for p in parts)}


def check(out: dict, ref: dict) -> tuple[dict, str | None]:
    """`R.check` of each output in `out` ('fwd', 'dx', 'dw'): (stats, None) or (stats so far, failure)."""
    stats = {}
    for kind, got in out.items():
        try:
            stats[kind] = R.check(got, ref[kind], kind, abs_ok=ref["dw_tol"] if kind == "dw" else None)
        except AssertionError as err:
            return stats, f"{err}"
    return stats, None


# ---------------------------------------------------------------------------------------------------
# Timed passes


def _train_step(fn, x, w, dy):
    return torch.autograd.grad(fn(x, w), (x, w), dy)


def torch_make_calls(fn, pass_: str, sets, w, xkern: bool):
    """For `timing.torch_device_us`: one call per input set. Backward alone: xkern's op directly (both
    kernels, dw reduction included); peers through autograd on a forward made beforehand."""
    def make():
        calls = []
        for x, dy in sets:
            if pass_ == "fwd":
                calls.append(functools.partial(fn, x, w))
            elif pass_ == "bwd" and xkern:
                calls.append(functools.partial(torch.ops.xkern.rms_norm_bwd, dy, x, w, EPS))
            else:
                xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
                if pass_ == "bwd":
                    y = fn(xg, wg)
                    calls.append(functools.partial(torch.autograd.grad, y, (xg, wg), dy.clone(), retain_graph=True))
                else:
                    calls.append(functools.partial(_train_step, fn, xg, wg, dy.clone()))
        return calls
    return make


def jax_step(fn, pass_: str):
    """`step(consts, state) -> state` for `timing.jax_device_us`; each output feeds the next input."""
    import jax

    if pass_ == "fwd":
        def step(consts, xs):
            return tuple(fn(x, consts[0]) for x in xs)
    elif pass_ == "bwd":
        def step(vjps, state):  # state: ((dy, dw), ...); consts: the vjp functions of a forward made before
            return tuple(tuple(vjp(dy)) for vjp, (dy, _) in zip(vjps, state, strict=True))
    else:
        def step(consts, state):  # state: ((x, dy, dw), ...): x <- dx, dy <- y
            out = []
            for x, dy, _ in state:
                y, vjp = jax.vjp(fn, x, consts[0])
                dx, dw = vjp(dy)
                out.append((dx, y, dw))
            return tuple(out)
    return step


def jax_consts_state(fn, pass_: str, xs, dys, w):
    import jax
    import jax.numpy as jnp

    zeros = [jnp.zeros(w.shape, w.dtype) for _ in xs]
    if pass_ == "fwd":
        return (w,), tuple(jnp.copy(x) for x in xs)
    if pass_ == "bwd":
        vjps = tuple(jax.vjp(fn, x, w)[1] for x in xs)
        return vjps, tuple((jnp.copy(dy), z) for dy, z in zip(dys, zeros, strict=True))
    return (w,), tuple((jnp.copy(x), jnp.copy(dy), z) for x, dy, z in zip(xs, dys, zeros, strict=True))


def _row(pass_, impl, m, n, dtype, ceiling, **fields) -> dict:
    nbytes = min_bytes(pass_, m, n, np.dtype(R.np_dtype(dtype)).itemsize)
    row = {"op": "rms_norm", "pass": pass_, "impl": impl, "shape": [m, n], "dtype": dtype, "bytes": nbytes,
           "us": None, "gbps": None, "frac": None, "status": "ok"}
    row.update(fields)
    if row["us"]:
        row["gbps"] = nbytes / row["us"] / 1e3
        row["frac"] = row["gbps"] / ceiling
    return row


def _same_bits_gpu(t, j) -> bool:
    """torch tensor vs jax array, bit for bit, on the device (host copies if DLPack fails)."""
    try:
        jt = torch.from_dlpack(j)
        return t.shape == jt.shape and t.dtype == jt.dtype and torch.equal(t.view(torch.int16), jt.view(torch.int16))
    except Exception:  # noqa: BLE001
        return same_bits(t, j)


def run_shape(m: int, n: int, dtype: str, ceiling: float, log) -> list[dict]:
    import jax

    tdt = TORCH_DTYPES[dtype]
    gen = torch.Generator(device=DEVICE).manual_seed(m * 131 + n)
    k = timing.n_sets(min_bytes("fwd", m, n, tdt.itemsize))
    sets = [(torch.randn(m, n, generator=gen, device=DEVICE, dtype=tdt),
             torch.randn(m, n, generator=gen, device=DEVICE, dtype=tdt)) for _ in range(k)]
    w = torch.randn(n, generator=gen, device=DEVICE, dtype=tdt)
    x_np, dy_np, w_np = to_numpy(sets[0][0]), to_numpy(sets[0][1]), to_numpy(w)
    rows_np = sample_rows(m, n)
    rows = torch.from_numpy(rows_np).to(DEVICE)
    ref = oracle(x_np, w_np, dy_np, rows_np)
    info = {"input_sets": k, "checked_rows": len(rows_np)}
    out = []

    # xkern, torch front end: checked first, on fresh outputs
    x0, dy0 = sets[0]
    y_t = _xkern_torch(x0, w)
    dx_t, dw_t = torch.ops.xkern.rms_norm_bwd(dy0, x0, w, EPS)
    got = {"fwd": to_numpy(y_t[rows]), "dx": to_numpy(dx_t[rows]), "dw": to_numpy(dw_t)}
    xk_stats, xk_fail = check(got, ref)

    # xkern, JAX front end: bit-identical to torch, or checked on its own
    xs = [jax.device_put(to_numpy(x)) for x, _ in sets]
    dys = [jax.device_put(to_numpy(dy)) for _, dy in sets]
    wj = jax.device_put(w_np)
    y_j, vjp = jax.vjp(_xkern_jax, xs[0], wj)
    dx_j, dw_j = vjp(dys[0])
    bitwise = all(_same_bits_gpu(a, b) for a, b in ((y_t, y_j), (dx_t, dx_j), (dw_t, dw_j)))
    if bitwise:
        jx_stats, jx_fail = xk_stats, xk_fail
    else:
        rows_j = jax.device_put(rows_np)
        jx_stats, jx_fail = check({"fwd": np.asarray(y_j[rows_j]), "dx": np.asarray(dx_j[rows_j]),
                                   "dw": np.asarray(dw_j)}, ref)
    del y_t, dx_t, dw_t, y_j, dx_j, dw_j, vjp
    log(f"rms_norm {m}x{n} {dtype}: xkern check {'FAIL ' + xk_fail if xk_fail else 'pass'}, "
        f"jax {'bitwise = torch' if bitwise else 'DIFFERS from torch'}"
        f"{', FAIL ' + jx_fail if jx_fail and not bitwise else ''}")

    def ulp_for(stats, pass_):
        keys = {"fwd": ("fwd",), "bwd": ("dx", "dw"), "fwd+bwd": ("fwd", "dx", "dw")}[pass_]
        return {key: stats[key] for key in keys if key in stats}

    # torch implementations
    torch._dynamo.reset()
    graphs_before = _compiled_graphs()
    for name, fn in torch_impls().items():
        if name == "torch.compile":
            fn = torch.compile(hf_rms_norm, dynamic=False, fullgraph=True)
        if isinstance(fn, str):
            out += [_row(p, name, m, n, dtype, ceiling, status=fn) for p in PASSES]
            continue
        xkern = name.startswith("xkern")
        peer_stats = None
        if not xkern:
            try:
                peer_stats = {"fwd": R.error_stats(to_numpy(fn(x0, w)[rows]), ref["fwd"])}
            except Exception as err:  # noqa: BLE001
                out += [_row(p, name, m, n, dtype, ceiling, status=_err(err)) for p in PASSES]
                continue
        for pass_ in PASSES:
            fields = dict(info)
            if xkern:
                fields.update(ulp=ulp_for(xk_stats, pass_), check=f"fail: {xk_fail}" if xk_fail else "pass")
                if xk_fail:
                    out.append(_row(pass_, name, m, n, dtype, ceiling, status="wrong answer: not timed", **fields))
                    continue
            elif pass_ == "fwd":
                fields.update(ulp=peer_stats, check="reported only")
            try:
                make = torch_make_calls(fn, pass_, sets, w, xkern)
                fields["us"], fields["timing"] = timing.torch_device_us(make)
                if pass_ == "fwd+bwd":
                    fields["us_eager"] = timing.torch_eager_us(make())
                if name == "torch.compile":
                    fields["compiled_graphs"] = _compiled_graphs() - graphs_before
                    if fields["compiled_graphs"] < 1:
                        raise RuntimeError("torch.compile compiled no graph: would be eager, not reported")
            except Exception as err:  # noqa: BLE001
                fields.update(us=None, status=_err(err))
            out.append(_row(pass_, name, m, n, dtype, ceiling, **fields))
        torch.cuda.empty_cache()

    # JAX implementations
    for name, fn in JAX_IMPLS.items():
        xkern = name.startswith("xkern")
        peer_stats = None
        if not xkern:
            try:
                peer_stats = {"fwd": R.error_stats(np.asarray(jax.jit(fn)(xs[0], wj)[rows_np]), ref["fwd"])}
            except Exception as err:  # noqa: BLE001
                out += [_row(p, name, m, n, dtype, ceiling, status=_err(err)) for p in PASSES]
                continue
        for pass_ in PASSES:
            fields = dict(info)
            if xkern:
                fields.update(ulp=ulp_for(jx_stats, pass_), check=f"fail: {jx_fail}" if jx_fail else "pass",
                              bitwise_equal_torch=bitwise)
                if jx_fail:
                    out.append(_row(pass_, name, m, n, dtype, ceiling, status="wrong answer: not timed", **fields))
                    continue
            elif pass_ == "fwd":
                fields.update(ulp=peer_stats, check="reported only")
            try:
                consts, state = jax_consts_state(fn, pass_, xs, dys, wj)
                est = len(xs) * max(5.0, min_bytes(pass_, m, n, tdt.itemsize) / (0.5 * ceiling * 1e3))
                us, method = timing.jax_device_us(jax_step(fn, pass_), consts, state, est)
                fields.update(us=us / len(xs), timing=method + f", {len(xs)} input set(s) per iteration")
            except Exception as err:  # noqa: BLE001
                fields.update(us=None, status=_err(err))
            out.append(_row(pass_, name, m, n, dtype, ceiling, **fields))
    del sets, xs, dys
    torch.cuda.empty_cache()
    return out


def host_overhead(ceiling: float) -> list[dict]:
    """Per-call host cost of each front end at a small shape: tight-loop wall time minus device time."""
    import jax

    import jax_api
    import torch_api

    m, n = HOST_SHAPE
    dtype = "bfloat16"
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    x = torch.randn(m, n, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(n, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    xj, dyj, wj = (jax.device_put(to_numpy(t)) for t in (x, dy, w))
    k = timing.n_sets(min_bytes("fwd", m, n, 2))
    out = []

    def sync_torch(_):
        torch.cuda.synchronize()

    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    torch_calls = {"fwd": lambda: torch_api.rms_norm(x, w, EPS),
                   "fwd+bwd": lambda: _train_step(_xkern_torch, xg, wg, dy)}
    fwd_j = jax.jit(lambda x, w: jax_api.rms_norm(x, w, EPS))
    step_j = jax.jit(lambda x, w, dy: jax.vjp(_xkern_jax, x, w)[1](dy))
    jax_calls = {"fwd": lambda: fwd_j(xj, wj), "fwd+bwd": lambda: step_j(xj, wj, dyj)}
    for pass_ in ("fwd", "fwd+bwd"):
        try:
            sets = [(torch.randn_like(x), torch.randn_like(x)) for _ in range(k)]
            device_us, _ = timing.torch_device_us(torch_make_calls(_xkern_torch, pass_, sets, w, True))
            wall = timing.host_us_per_call(torch_calls[pass_], sync_torch)
            out.append({"impl": "xkern (torch)", "pass": pass_, "shape": [m, n], "dtype": dtype, "wall_us": wall,
                        "device_us": device_us, "host_us": wall - device_us})
        except Exception as err:  # noqa: BLE001
            out.append({"impl": "xkern (torch)", "pass": pass_, "shape": [m, n], "status": _err(err)})
        try:
            xs = [jax.device_put(to_numpy(torch.randn_like(x))) for _ in range(k)]
            dys = [jax.device_put(to_numpy(torch.randn_like(x))) for _ in range(k)]
            consts, state = jax_consts_state(_xkern_jax, pass_, xs, dys, wj)
            device_us, _ = timing.jax_device_us(jax_step(_xkern_jax, pass_), consts, state, 10.0 * k)
            device_us /= k
            wall = timing.host_us_per_call(jax_calls[pass_], jax.block_until_ready)
            out.append({"impl": "xkern (jax)", "pass": pass_, "shape": [m, n], "dtype": dtype, "wall_us": wall,
                        "device_us": device_us, "host_us": wall - device_us})
        except Exception as err:  # noqa: BLE001
            out.append({"impl": "xkern (jax)", "pass": pass_, "shape": [m, n], "status": _err(err)})
    return out


# ---------------------------------------------------------------------------------------------------
# CPU: interpreter-mode validation of both front ends


def validate_cpu(log) -> bool:
    """Both front ends under Triton's interpreter: forward and backward against the FP64 oracle (every
    row), and torch == JAX bit for bit. True when everything passes."""
    import jax
    import jax.numpy as jnp

    ok = True
    rng = np.random.default_rng(0)
    for (m, n), dtype in CPU_SHAPES:
        x, w, dy = rand(rng, (m, n), dtype), rand(rng, (n,), dtype), rand(rng, (m, n), dtype)
        ref = oracle(x, w, dy, np.arange(m))
        xt, wt = to_torch(x).requires_grad_(), to_torch(w).requires_grad_()
        y_t = _xkern_torch(xt, wt)
        dx_t, dw_t = torch.autograd.grad(y_t, (xt, wt), to_torch(dy))
        y_j, vjp = jax.vjp(_xkern_jax, jnp.asarray(x), jnp.asarray(w))
        dx_j, dw_j = vjp(jnp.asarray(dy))
        stats, fail = check({"fwd": to_numpy(y_t), "dx": to_numpy(dx_t), "dw": to_numpy(dw_t)}, ref)
        bitwise = all(same_bits(a, b) for a, b in ((y_t, y_j), (dx_t, dx_j), (dw_t, dw_j)))
        worst = ", ".join(f"{k} {s['max_ulp']} ULP" for k, s in stats.items())
        log(f"  rms_norm {m}x{n} {dtype}: oracle {'FAIL ' + fail if fail else 'pass'} ({worst}); "
            f"torch == jax bitwise: {bitwise}")
        ok = ok and not fail and bitwise
    return ok
