"""Fused residual add + RMSNorm (`add_rms_norm`): the op alone against its peers, forward and forward +
backward, as a table of its own (`add_rms_norm_table`, run by `benchmarks.main --only add_rms_norm`).

The runner's `Op` takes one output and one cotangent; this op has two of each (y and residual_out, whose
gradient a decoder layer always has), so it is timed here with the runner's timing functions: torch in CUDA
graphs (`timing.torch_device_us`, L2 flushed); xkern (torch) also, and every JAX implementation only, by the
profiler's device time (`timing.profile_device_us`) of one call per input set, each JAX call a jitted
program of its own (XLA cannot fuse one call's outputs into the next call, as a loop carrying them let it:
its forward once timed at the copy ceiling). Minimum bytes (one 16-bit dtype): forward reads x, residual, w and writes
y, residual_out; backward reads dy, d(residual_out), residual_out, w and writes d(sum) (serving as dx and
dresidual) and dw; forward + backward is the sum. Checks before timing: xkern's y, residual_out, dx on
sampled rows against the FP64 oracle, and its JAX front end bit for bit its torch front end.
"""

from __future__ import annotations

import functools

import numpy as np

from benchmarks import timing
from benchmarks.report import table
from benchmarks.rms_norm import EPS, hf_rms_norm
from benchmarks.runner import as_torch, invalid_if_above_ceiling, profile_fields, same_bits_torch, to_jax
from benchmarks.timing import error_status
from xkern import reference as R
from xkern.testing import same_bits, to_numpy, torch_dtype

WIDTHS = [128, 2048, 4096, 5120, 7168, 8192]
ELEMS = 2**25  # per tensor: 64 MB in bf16, above the H100's and H200's L2
SMOKE = [(9, 128)]
PASSES = ("fwd", "fwd+bwd")
CHECK_ROWS = 64


def shapes(smoke: bool) -> list[tuple[int, int]]:
    return SMOKE if smoke else [(ELEMS // n, n) for n in WIDTHS]


def min_bytes(m: int, n: int, size: int, pass_: str) -> int:
    fwd = 4 * m * n * size + n * size
    bwd = 4 * m * n * size + 2 * n * size
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}[pass_]


# ---------------------------------------------------------------------------------------------------
# Implementations: fn(x, residual, w) -> (y, residual_out)


def eager(x, r, w):
    """Hugging Face's decoder layer: the add, then the Llama norm of the sum."""
    s = x + r
    return hf_rms_norm(s, w), s


def xkern_torch(x, r, w):
    import torch_api

    return torch_api.add_rms_norm(x, r, w, EPS)


def xkern_jax(x, r, w):
    import jax_api

    return jax_api.add_rms_norm(x, r, w, EPS)


def jnp_add_norm(x, r, w):
    """The same pair in jax.numpy (XLA fuses it under jit)."""
    from benchmarks.rms_norm import xla_rms_norm

    s = x + r
    return xla_rms_norm(s, w), s


@functools.cache
def liger():
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except Exception as err:  # noqa: BLE001 - optional peer
        return f"skipped: liger-kernel's fused add not importable ({type(err).__name__}: {err})"
    # (hidden_states, residual, W, eps, offset, casting_mode, in_place): Llama casting, out of place
    return lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", False)


@functools.cache
def quack():
    try:
        from quack.rmsnorm import rmsnorm
    except Exception as err:  # noqa: BLE001 - optional peer
        return f"skipped: quack not importable ({type(err).__name__}: {err})"
    return lambda x, r, w: rmsnorm(x, w, residual=r, eps=EPS, prenorm=True)


def compiled_eager():
    import torch

    backend = "inductor" if torch.cuda.is_available() else "aot_eager"
    return torch.compile(eager, dynamic=False, fullgraph=True, backend=backend)


def compiled_xkern_fusion():
    """torch.compile of `rms_norm(x + r)` with xkern's norm and `enable_compile_fusion`'s pass (installed for
    this function's compilation only): the compile path to the fused kernels."""
    import torch
    import torch._inductor.config as config

    import torch_api
    from torch_api import compile_fusion

    def pair(x, r, w):
        s = x + r
        return torch_api.rms_norm(s, w, EPS), s

    backend = "inductor" if torch.cuda.is_available() else "aot_eager"
    compiled = torch.compile(pair, dynamic=False, fullgraph=True, backend=backend)
    with config.patch(pre_grad_custom_pass=None):
        compile_fusion.enable_compile_fusion()
        fusion = config.pre_grad_custom_pass

    def call(x, r, w):
        with config.patch(pre_grad_custom_pass=fusion):
            return compiled(x, r, w)

    return call


def torch_impls() -> dict:
    return {"xkern (torch)": xkern_torch, "HF eager": eager, "torch.compile": compiled_eager(),
            "torch.compile (xkern norm, fusion pass)": compiled_xkern_fusion(), "Liger": liger(), "quack": quack()}


def jax_impls() -> dict:
    return {"xkern (jax)": xkern_jax, "jax.jit (XLA)": jnp_add_norm}


# ---------------------------------------------------------------------------------------------------
# Running


def _train_step(fn, leaves, cots):
    import torch

    return torch.autograd.grad(fn(*leaves), leaves, cots)


def torch_calls(fn, pass_, sets):
    """For timing.torch_device_us: a maker of one call per input set ((x, residual, w), (dy, d(residual_out))),
    the forward, or the forward and its gradients (fresh leaves each make)."""

    def make():
        calls = []
        for args, cots in sets:
            if pass_ == "fwd":
                calls.append(functools.partial(fn, *args))
            else:
                leaves = [a.detach().requires_grad_() for a in args]
                calls.append(functools.partial(_train_step, fn, leaves, tuple(c.clone() for c in cots)))
        return calls
    return make


def _jax_calls(fn, pass_, sets):
    """For timing.profile_device_us: one jitted call per input set, every distinct output returned; in fwd+bwd
    the cotangents wait for this call's outputs (an optimization barrier), as in a model. x and residual get
    one gradient, d(x + residual): torch hands back one tensor for both and a model uses both inside its
    jit, so the step returns it once (two jit outputs of one value would cost a copy that neither makes)."""
    import jax

    if pass_ == "fwd":
        f = jax.jit(fn)
        return [functools.partial(f, *args) for args, _ in sets]

    def step(args, cots):
        (y, s), vjp = jax.vjp(fn, *args)
        (y, s), cots = jax.lax.optimization_barrier(((y, s), tuple(cots)))
        dx, _, dw = vjp(cots)
        return (y, s), (dx, dw)
    f = jax.jit(step)
    return [functools.partial(f, tuple(args), tuple(cots)) for args, cots in sets]


def _check_xkern(x, r, w, dy, ds, got) -> str | None:
    rows = np.unique(np.linspace(0, x.shape[0] - 1, min(x.shape[0], CHECK_ROWS)).round().astype(np.int64))
    xs, rs, ws = to_numpy(x[rows]), to_numpy(r[rows]), to_numpy(w)
    y64, s_ref = R.add_rms_norm_fwd(xs, rs, ws, EPS)
    dys = to_numpy(dy[rows])
    dsum64, _, _ = R.add_rms_norm_bwd(s_ref, ws, dys, to_numpy(ds[rows]), EPS, x_dtype=xs.dtype)
    tol = R.add_rms_norm_dsum_tol(s_ref, ws, dys, EPS, x_dtype=xs.dtype)
    try:
        assert same_bits(to_numpy(got["s"][rows]), s_ref), "residual_out is not (x + r) rounded once"
        R.check(to_numpy(got["y"][rows]), y64, "fwd")
        R.check(to_numpy(got["dx"][rows]), dsum64.astype(s_ref.dtype).astype(np.float64), "dx", tol)
    except AssertionError as err:
        return str(err)
    return None


def add_rms_norm_table(device: str, ceiling: float, log, dtype: str = "bfloat16") -> list[dict]:
    """Rows {op, pass, impl, shape, dtype, bytes, us, gbps, frac, status, ...} for every width and peer."""
    import torch

    rows = []
    for m, n in shapes(timing.smoke()):
        dt = torch_dtype(dtype)
        size = torch.empty((), dtype=dt).element_size()
        gen = torch.Generator(device=device).manual_seed(n)
        w = torch.randn(n, generator=gen, device=device, dtype=dt)
        n_sets = timing.n_sets(min_bytes(m, n, size, "fwd"))
        sets = [([torch.randn(m, n, generator=gen, device=device, dtype=dt) for _ in range(2)] + [w],
                 [torch.randn(m, n, generator=gen, device=device, dtype=dt) for _ in range(2)]) for _ in range(n_sets)]
        (x, r, _), (dy, ds) = sets[0]
        reference = None
        for framework, impls in (("torch", torch_impls()), ("jax", jax_impls())):
            torch._dynamo.reset()
            jsets = None
            if framework == "jax":
                jsets = [([to_jax(a) for a in args], [to_jax(c) for c in cots]) for args, cots in sets]
            for name, fn in impls.items():
                base = {"op": "add_rms_norm", "impl": name, "shape": [m, n], "dtype": dtype, "input_sets": n_sets}
                if isinstance(fn, str):
                    rows += [dict(base, **{"pass": p, "status": fn}) for p in PASSES]
                    continue
                fields = {}
                try:  # one run, checked (xkern) or reported
                    if framework == "torch":
                        leaves = [a.detach().requires_grad_() for a in (x, r, w)]
                        y, s = fn(*leaves)
                        dx, dr, dw = torch.autograd.grad((y, s), leaves, (dy.clone(), ds.clone()))
                    else:
                        import jax

                        (y, s), vjp = jax.vjp(fn, *jsets[0][0])
                        dx, dr, dw = (as_torch(g, device) for g in vjp(tuple(jsets[0][1])))
                        y, s = as_torch(y, device), as_torch(s, device)
                    got = {"y": y.detach(), "s": s.detach(), "dx": dx, "dr": dr, "dw": dw}
                    fail = _check_xkern(x, r, w, dy, ds, got)
                    fields["check"] = ("fail: " + fail if fail else "pass") if name.startswith("xkern") else \
                        "reported only: " + ("fail: " + fail if fail else "pass")
                    if name == "xkern (torch)":
                        reference = got
                    elif name == "xkern (jax)" and reference is not None:
                        fields["bitwise_equal_torch"] = all(same_bits_torch(got[k], reference[k]) for k in got)
                    del got
                except Exception as err:  # noqa: BLE001
                    rows += [dict(base, **{"pass": p, "status": error_status(err)}) for p in PASSES]
                    continue
                if name.startswith("xkern"):
                    log(f"add_rms_norm {m}x{n}: {name} check {fields['check']}"
                        + (f", bitwise = torch: {fields['bitwise_equal_torch']}" if "bitwise_equal_torch" in fields
                           else ""))
                for pass_ in PASSES:
                    nbytes = min_bytes(m, n, size, pass_)
                    row = dict(base, **fields, **{"pass": pass_, "bytes": nbytes, "us": None, "gbps": None,
                                                 "frac": None, "status": "ok"})
                    if name.startswith("xkern") and fields["check"].startswith("fail"):
                        row["status"] = "wrong answer: not timed"
                        rows.append(row)
                        continue
                    try:
                        if framework == "torch":
                            row["us"], row["timing"] = timing.torch_device_us(torch_calls(fn, pass_, sets))
                            if name.startswith("xkern"):  # the JAX rows' method, for the JAX / torch ratio
                                row.update(profile_fields(torch_calls(fn, pass_, sets)(), timing.torch_sync))
                        else:
                            row.update(profile_fields(_jax_calls(fn, pass_, jsets), timing.jax_sync))
                            row.update(us=row["profile_us"], timing=row["profile_timing"])
                    except Exception as err:  # noqa: BLE001
                        row["status"] = error_status(err)
                    if row["us"]:
                        row["gbps"] = nbytes / row["us"] / 1e3
                        row["frac"] = row["gbps"] / ceiling
                    rows.append(invalid_if_above_ceiling(row))
                    frac = f"{row['frac']:.2f} of the copy" if row["frac"] else row["status"]
                    log(f"add_rms_norm {m}x{n} {pass_} {name}: {frac}")
            del jsets
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    """The table: one line per width and pass, each implementation's fraction of the copy ceiling."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    keys = list(dict.fromkeys((tuple(r["shape"]), r["pass"]) for r in rows))
    lines = []
    for shape, pass_ in keys:
        cells = []
        for impl in impls:
            r = next((r for r in rows if r["impl"] == impl and tuple(r["shape"]) == shape and r["pass"] == pass_), None)
            cells.append("" if r is None else f"{r['frac']:.2f} ({r['us']:.1f} µs)" if r.get("frac") else
                         r.get("status", "")[:40])
        lines.append(["x".join(map(str, shape)), pass_, *cells])
    return "\n".join(["### add_rms_norm (fused residual add + RMSNorm), fraction of the copy ceiling", ""]
                     + table(["shape", "pass", *impls], lines))
