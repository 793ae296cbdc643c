"""The jax_api ops under `jax.jit` with sharded inputs (jax_api/sharding.py), on 4 and 8 CPU devices.

Each device count runs in one child process (XLA_FLAGS must be set before jax initialises), which checks
every case and reports one line per case; the tests here read that report. Per case: no value placed on
one device (a `{maximal}` sharding in the lowered module), outputs sharded as docs/sharding.md says, the
compiled program's collectives no more than that table's (none where the hidden dim is sharded), and the
results equal one device's: bit for bit where rows, slots or tokens are sharded, within the contract
(xkern.reference) where a sum runs over a sharded width; the norms under grad, vmap and remat, the MoE
gathers and combines forward and backward. A second child exports a sharded step for CUDA.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MESHES = {"1d": lambda n: ((n,), ("d",)), "2d": lambda n: ((2, n // 2), ("data", "model"))}
# RMSNorm cases: (mesh, x's PartitionSpec over [batch 2, seq 8, hidden 64], x dtype, w dtype)
NORM_CASES = {
    "rows 1d": ("1d", (None, "d", None), "bfloat16", "bfloat16"),
    "width 1d": ("1d", (None, None, "d"), "bfloat16", "bfloat16"),
    "rows 2d": ("2d", ("data", "model", None), "float16", "float32"),
    "rows over 2 axes": ("2d", (None, ("data", "model"), None), "float32", "float32"),
    "rows and width 2d": ("2d", (None, "data", "model"), "bfloat16", "bfloat16"),
}
# Gather cases: (mesh, x's spec over [rows 16, hidden 64], the indices' spec, whether all-gathers are needed)
GATHER_CASES = {
    "gather hidden 1d": ("1d", (None, "d"), (None,), False),
    "gather hidden 2d": ("2d", (None, "model"), (None,), False),
    "gather rows 1d": ("1d", ("d", None), ("d",), True),
    "gather rows and hidden 2d": ("2d", ("data", "model"), ("data",), True),
}
# MoE top-k cases: (mesh, x's spec over [tokens 16, hidden 32], the slot indices' spec [40], probs' spec [16, 2])
MOE_CASES = {
    "moe hidden 1d": ("1d", (None, "d"), (None,), (None, None)),
    "moe tokens 1d": ("1d", ("d", None), ("d",), ("d", None)),
    "moe tokens and hidden 2d": ("2d", ("data", "model"), ("data",), ("data", None)),
    "moe tokens over 2 axes": ("2d", (("data", "model"), None), (("data", "model"),), (("data", "model"), None)),
}
MOE_CHECKS = ["dispatch", "combine", "copy sum", "grads"]
# grouped_mm cases: (mesh, x's spec over [slots 32, K 16], w's spec over [experts 3, K 16, N 24])
GEMM_CASES = {
    "gemm rows 1d": ("1d", ("d", None), (None, None, None)),
    "gemm columns 1d": ("1d", (None, None), (None, None, "d")),
    "gemm rows and columns 2d": ("2d", ("data", None), (None, None, "model")),
    "gemm contracted 1d": ("1d", (None, "d"), (None, "d", None)),
}
CHECKS = ["fwd", "grad", "vmap", "remat"]
CASES = [f"{c}: {k}" for c in NORM_CASES for k in CHECKS] + list(GATHER_CASES) + [
    f"{c}: {k}" for c in MOE_CASES for k in MOE_CHECKS] + [
    "variants", "index ops", "readme step", "add rows", "add width 1d", "add rows and width 2d"] + list(GEMM_CASES)


@functools.cache
def _report(n_devices: int) -> dict:
    """n_devices CPU devices (the interpreter), or with 0 every GPU (compiled kernels, jax-triton)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if n_devices:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n_devices}", JAX_PLATFORMS="cpu",
                   TRITON_INTERPRET="1", PYTHONPATH=path)
    else:
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "JAX_PLATFORMS")}
        env.update(PYTHONPATH=path, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    run = subprocess.run([sys.executable, __file__, "check", str(n_devices)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.host_devices
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("n_devices", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_sharded(n_devices, case):
    assert _report(n_devices)[case] == "ok"


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.skipif("_gpu_count() < 2", reason="needs 2 or more GPUs")
@pytest.mark.parametrize("case", CASES)
def test_sharded_gpus(case):
    assert _report(0)[case] == "ok"


def test_rms_norm_tp_checks_its_arguments():
    import jax.numpy as jnp

    import jax_api

    x, w = jnp.ones((2, 8), jnp.float32), jnp.ones((8,), jnp.float32)
    with pytest.raises(TypeError, match="axis_name"):
        jax_api.rms_norm_tp(x, w, axis_name=3)
    with pytest.raises(ValueError, match="weight"):
        jax_api.rms_norm_tp(x, jnp.ones((4,), jnp.float32), axis_name="model")
    with pytest.raises(TypeError, match="x must be"):
        jax_api.rms_norm_tp([1.0], w, axis_name="model")


@pytest.mark.sm90_static  # conftest.py: CPU CI runs it, a GPU run skips it
def test_sharded_step_exports_for_cuda():
    missing = [pkg for pkg, mod in (("jax-triton", "jax_triton"), ("jax-cuda13-plugin", "jax_cuda13_plugin"))
               if importlib.util.find_spec(mod) is None]
    assert not missing, f"not installed: {', '.join(missing)} (CI needs them for this check: scripts/setup.sh)"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, __file__, "export"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-6000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["devices"] == 4
    # forward and backward of both norms (the width-sharded one: sums, norm; sums, finish, cols, reduce; the
    # row-sharded one's 2 rows a device: one backward program, which writes dw itself)
    assert found["kernels"] == sorted([
        "_rms_norm_fwd_sums_kernel", "_rms_norm_fwd_rstd_kernel", "_rms_norm_bwd_sums_kernel",
        "_rms_norm_bwd_finish_kernel", "_rms_norm_bwd_cols_kernel", "_dw_reduce_kernel",
        "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"])
    assert found["same as torch"] == sorted([
        "_rms_norm_fwd_sums_kernel", "_rms_norm_fwd_rstd_kernel", "_rms_norm_bwd_sums_kernel",
        "_rms_norm_bwd_finish_kernel", "_rms_norm_bwd_cols_kernel", "_dw_reduce_kernel"])


# ---------------------------------------------------------------------------------------------------
# The children


def _check_all(n_devices: int) -> dict:
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_api
    from xkern import reference as R

    if n_devices == 0:  # every GPU
        n_devices = len(jax.devices())
    assert len(jax.devices()) == n_devices, jax.devices()
    meshes = {k: Mesh(np.array(jax.devices()).reshape(shape), names) for k, (shape, names) in
              ((k, f(n_devices)) for k, f in MESHES.items())}
    rng = np.random.default_rng(n_devices)
    report = {}

    def case(name, fn):
        try:
            fn()
            report[name] = "ok"
        except Exception as e:  # one line per failing case, the others still run
            report[name] = f"{type(e).__name__}: {e}"[:2000]

    def collectives(f, *args) -> list[tuple[str, str]]:
        """The compiled program's collectives as (kind, result type without layout); asserts that no value was
        given a single-device (maximal) sharding, which the compiled text no longer shows."""
        lowered = f.lower(*args)
        assert "maximal" not in lowered.as_text(), "a value placed on one device ({maximal ...} sharding)"
        hlo = lowered.compile().as_text()
        kinds = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter|collective-broadcast"
        ops = re.findall(rf"= (\([^)]*\)|\S+) ({kinds})(-start)?\(", hlo)
        assert len(ops) == len(re.findall(rf"\b(?:{kinds})(?:-start)?\(", hlo)), "a collective not parsed"
        found = []
        for shape, kind, start in ops:  # a combined collective has a tuple type; an async all-gather (GPU)
            parts = re.sub(r"\{[^}]*\}", "", shape).strip("()").split(", ")  # (operands, results)
            found += [(kind, part) for part in (parts[len(parts) // 2:] if start and kind == "all-gather" else parts)]
        return found

    def only(found, allowed, what):
        extra = [c for c in found if c not in allowed]
        assert not extra, f"{what}: {extra} beyond {sorted(allowed)}"

    def no_all_gather(f, *args):
        assert not [c for c in collectives(f, *args) if c[0] == "all-gather"], "all-gather in the compiled HLO"

    def same(a, b, what):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{what} differs"

    def sharded_like(a, sharding, what):
        assert a.sharding.is_equivalent_to(sharding, a.ndim), f"{what}: {a.sharding} instead of {sharding}"

    eps = 1e-6

    def norm_case(name, mesh_name, spec, x_dtype, w_dtype):
        mesh = meshes[mesh_name]
        width_sharded = spec[-1] is not None
        y_dtype = str(R.promote(R.np_dtype(x_dtype), R.np_dtype(w_dtype)))
        x0 = (rng.standard_normal((2, 8, 64))).astype(R.np_dtype(x_dtype))
        w0 = (1 + 0.5 * rng.standard_normal(64)).astype(R.np_dtype(w_dtype))
        dy0 = rng.standard_normal((2, 8, 64)).astype(R.np_dtype(y_dtype))
        x_sh, w_sh = NamedSharding(mesh, P(*spec)), NamedSharding(mesh, P(spec[-1]))
        x, w, dy = (jax.device_put(a, s) for a, s in ((x0, x_sh), (w0, w_sh), (dy0, x_sh)))
        one = [jnp.asarray(a) for a in (x0, w0, dy0)]  # one device

        def loss(x, w, dy):
            return jnp.sum(jax_api.rms_norm(x, w, eps).astype(jnp.float32) * dy.astype(jnp.float32))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        rdx, rdw, dw_tol = R.rms_norm_bwd(x0, w0, dy0, eps)

        def close_or_same(got, want, ref64, kind, abs_ok=None):
            if width_sharded:
                R.check(np.asarray(got), ref64, kind, abs_ok)
            else:
                same(got, want, kind)

        def fwd():
            f = jax.jit(lambda x, w: jax_api.rms_norm(x, w, eps))
            y = f(x, w)
            sharded_like(y, x_sh, "y")
            no_all_gather(f, x, w)
            close_or_same(y, f(*one[:2]), R.rms_norm_fwd(x0, w0, eps), "fwd", R.rms_norm_fwd_tol(x0, w0, eps))

        def grads():
            dx, dw = grad(x, w, dy)
            sharded_like(dx, x_sh, "dx")
            sharded_like(dw, w_sh, "dw")
            no_all_gather(grad, x, w, dy)
            close_or_same(dx, grad(*one)[0], rdx, "dx")
            R.check(np.asarray(dw), rdw, "dw", abs_ok=dw_tol)

        def vmapped():  # per-example dx and dw over the batch axis
            f = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None, 0)))
            dx, dw = f(x, w, dy)
            sharded_like(dx, x_sh, "dx")
            no_all_gather(f, x, w, dy)
            close_or_same(dx, f(*one)[0], rdx, "dx")
            for b in range(2):
                want_dx, want_dw, tol = R.rms_norm_bwd(x0[b], w0, dy0[b], eps)
                R.check(np.asarray(dw)[b], want_dw, "dw", abs_ok=tol)

        def remat():
            f = jax.jit(jax.grad(jax.checkpoint(lambda x, w, dy: loss(x, w, dy) * 2.0,
                                                policy=jax.checkpoint_policies.nothing_saveable), argnums=(0, 1)))
            dx, dw = f(x, w, dy)
            want = jax.jit(jax.grad(lambda x, w, dy: loss(x, w, dy) * 2.0, argnums=(0, 1)))(x, w, dy)
            sharded_like(dx, x_sh, "dx")
            no_all_gather(f, x, w, dy)
            same(dx, want[0], "dx")
            same(dw, want[1], "dw")

        for check, fn in zip(CHECKS, (fwd, grads, vmapped, remat)):
            case(f"{name}: {check}", fn)

    for name, params in NORM_CASES.items():
        norm_case(name, *params)

    def variants():
        """Gemma, OLMo-2 and no weight: rows sharded stay local, a sharded width too (the width-sharded
        kernels of each variant: one psum of the statistics), never an all-gather; y and dx keep x's sharding
        and equal one device's bit for bit with rows sharded, the FP64 oracle's within its contract with the
        width sharded (the statistic's FP32 sum runs per shard); dw within its oracle's contract."""
        x0 = rng.standard_normal((2, 8, 64)).astype(R.np_dtype("bfloat16"))
        w0 = (0.5 * rng.standard_normal(64)).astype(R.np_dtype("bfloat16"))
        dy0 = rng.standard_normal((2, 8, 64)).astype(R.np_dtype("bfloat16"))
        for variant, weighted in (("gemma", True), ("olmo2", True), ("llama", False)):
            def loss(x, w, dy, variant=variant, weighted=weighted):
                y = jax_api.rms_norm(x, w if weighted else None, eps, variant=variant)
                return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            (_, (want_dx, _)) = step(*(jnp.asarray(a) for a in (x0, w0, dy0)))
            for mesh_name, spec in (("2d", ("data", "model", None)), ("1d", (None, None, "d"))):
                mesh = meshes[mesh_name]
                x_sh = NamedSharding(mesh, P(*spec))
                x, dy = jax.device_put(x0, x_sh), jax.device_put(dy0, x_sh)
                w = jax.device_put(w0, NamedSharding(mesh, P(spec[-1])))
                what = f"{variant}{'' if weighted else ', no weight'}, x {spec}"
                _, (dx, dw) = step(x, w, dy)
                sharded_like(dx, x_sh, "dx " + what)
                f = jax.jit(lambda x, w, v=variant, weighted=weighted: jax_api.rms_norm(x, w if weighted else None,
                                                                                       eps, variant=v))
                y = f(x, w)
                sharded_like(y, x_sh, "y " + what)
                no_all_gather(step, x, w, dy)
                no_all_gather(f, x, w)
                if spec[-1] is None:
                    same(dx, want_dx, "dx " + what)
                    same(y, f(jnp.asarray(x0), jnp.asarray(w0)), "y " + what)
                else:
                    w_ref = w0 if weighted else None
                    R.check(np.asarray(y), R.rms_norm_fwd(x0, w_ref, eps, variant), "y " + what,
                            R.rms_norm_fwd_tol(x0, w_ref, eps, variant))
                    R.check(np.asarray(dx), R.rms_norm_bwd(x0, w_ref, dy0, eps, variant)[0], "dx " + what)
                if weighted:
                    _, want_dw, dw_tol = R.rms_norm_bwd(x0, w0, dy0, eps, variant)
                    R.check(np.asarray(dw), want_dw, "dw", abs_ok=dw_tol)

    case("variants", variants)

    counts0 = np.array([3, 1, 2, 2, 0, 4, 1, 3], np.int32)  # 2 ranks x 4 experts, 16 rows
    one_idx = jax_api.generate_permute_indices(jnp.asarray(counts0), 4, 2, 24, 4)[0]
    def gather_case(name, mesh_name, spec, idx_spec, gathers):
        mesh = meshes[mesh_name]
        x0 = rng.standard_normal((16, 64)).astype(np.float32)
        x_sh = NamedSharding(mesh, P(*spec))
        x, idx = jax.device_put(x0, x_sh), jax.device_put(one_idx, NamedSharding(mesh, P(*idx_spec)))

        def loss(x, idx):
            y = jax_api.permute_rows(x, idx)
            return jnp.sum(jnp.sin(jax_api.unpermute_rows(y * 2.0, idx, 16)))

        def gather():
            f = jax.jit(jax_api.permute_rows)
            g = jax.jit(jax.grad(loss))
            out, dx = f(x, idx), g(x, idx)
            same(out, f(jnp.asarray(x0), one_idx), "permute_rows")
            same(dx, g(jnp.asarray(x0), one_idx), "dx")
            # hidden sharded: no communication; rows: all-gathers of the rows an op reads and of the indices
            cols = 64 // math.prod(mesh.shape[a] for a in ([spec[1]] if spec[1] else []))
            reads = {("all-gather", f"f32[{n},{cols}]") for n in (16, 24)} | {("all-gather", "s32[24]")}
            only(collectives(f, x, idx), reads if gathers else set(), "permute_rows")
            only(collectives(g, x, idx), reads | {("all-reduce", "f32[]")} if gathers else set(), "grad")
            sharded_like(dx, x_sh, "dx")
            sharded_like(out, NamedSharding(mesh, P(idx_spec[0], spec[1])), "permute_rows")

        case(name, gather)

    for name, params in GATHER_CASES.items():
        gather_case(name, *params)

    def index_ops():  # replicated: the (integer) inputs all-gathered
        mesh = meshes["1d"]
        counts = jax.device_put(counts0, NamedSharding(mesh, P("d")))
        f = jax.jit(lambda c: jax_api.generate_permute_indices(c, 4, 2, 24, 4))
        for got, want in zip(f(counts), f(jnp.asarray(counts0))):
            same(got, want, "generate_permute_indices")
        only(collectives(f, counts), {("all-gather", "s32[8]")}, "generate_permute_indices")
        ids0 = np.random.default_rng(5).integers(0, 4, (16, 2)).astype(np.int32)  # 16 tokens, top 2, 4 experts
        ids = jax.device_put(ids0, NamedSharding(mesh, P("d")))  # tokens split
        route = jax.jit(lambda i: jax_api.topk_permute_indices(i, 4, 48, 4))
        for got, want in zip(route(ids), route(jnp.asarray(ids0))):
            same(got, want, "topk_permute_indices")
        only(collectives(route, ids), {("all-gather", "s32[32]")}, "topk_permute_indices")
        idx = jax.device_put(one_idx[:16], NamedSharding(mesh, P("d")))
        inv = jax.jit(lambda i: jax_api.inverse_permutation(i, 16))
        same(inv(idx), inv(one_idx[:16]), "inverse_permutation")
        only(collectives(inv, idx), {("all-gather", "s32[16]")}, "inverse_permutation")
        # its rows split like the output's users: each device finds the slots of its rows
        split = jax.jit(lambda i: jax_api.inverse_permutation(i, 16), out_shardings=NamedSharding(mesh, P("d")))
        same(split(idx), inv(one_idx[:16]), "inverse_permutation, rows split")
        sharded_like(split(idx), NamedSharding(mesh, P("d")), "inverse_permutation")
        only(collectives(split, idx), {("all-gather", "s32[16]")}, "inverse_permutation, rows split")

    case("index ops", index_ops)

    top_k, n_tokens, hidden, n_slots = 2, 16, 32, 40
    copies = rng.permutation(n_tokens * top_k)[:-1]  # one copy dropped (no slot names it)
    moe_idx = rng.permutation(np.concatenate([copies, -np.ones(n_slots - len(copies))])).astype(np.int32)

    def moe_case(name, mesh_name, spec, idx_spec, probs_spec):
        """The top-k permute and the combines (weighted, copy sum), forward and backward. Hidden sharded: no
        communication but dprobs' all-reduce; tokens or slots sharded: each device computes its share,
        all-gathering the rows it reads (and the indices, probs), bitwise one device's result."""
        mesh = meshes[mesh_name]
        x0 = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
        y0 = rng.standard_normal((n_slots, hidden)).astype(np.float32)
        p0 = rng.standard_normal((n_tokens, top_k)).astype(np.float32)
        d0 = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
        x_sh, p_sh = NamedSharding(mesh, P(*spec)), NamedSharding(mesh, P(*probs_spec))
        slot_sh = NamedSharding(mesh, P(idx_spec[0], spec[1]))
        x, d = jax.device_put(x0, x_sh), jax.device_put(d0, x_sh)
        y, idx = jax.device_put(y0, slot_sh), jax.device_put(moe_idx, NamedSharding(mesh, P(*idx_spec)))
        p = jax.device_put(p0, p_sh)
        one = {k: jnp.asarray(v) for k, v in dict(x=x0, y=y0, idx=moe_idx, p=p0, d=d0).items()}
        cols = hidden // math.prod(mesh.shape[a] for a in ([spec[1]] if spec[1] else []))
        width_only = spec[0] is None
        rows = {("all-gather", f"f32[{n},{cols}]") for n in (n_tokens, n_slots)}
        ints = {("all-gather", f"s32[{n_slots}]"), ("all-gather", f"f32[{n_tokens},{top_k}]")}
        # dprobs: one all-reduce (XLA may make it a reduce-scatter where the result is sliced like probs)
        dprobs = {("all-reduce", f"f32[{n_tokens},{top_k}]")} | {
            ("reduce-scatter", f"f32[{n_tokens // n},{top_k}]") for n in (2, 4, 8)}

        def dispatch():
            f = jax.jit(lambda x, idx: jax_api.permute_rows(x, idx, top_k=top_k))
            out = f(x, idx)
            same(out, f(one["x"], one["idx"]), "permute_rows")
            sharded_like(out, slot_sh, "permute_rows")
            only(collectives(f, x, idx), set() if width_only else rows, "permute_rows")

        def combine():
            f = jax.jit(lambda y, idx, p: jax_api.unpermute_rows(y, idx, n_tokens * top_k, top_k=top_k, probs=p))
            out = f(y, idx, p)
            same(out, f(one["y"], one["idx"], one["p"]), "combine")
            sharded_like(out, NamedSharding(mesh, P(probs_spec[0], spec[1])), "combine")
            only(collectives(f, y, idx, p), set() if width_only else rows | ints, "combine")

        def copy_sum():  # no probs: the output's users say how its tokens split (here out_shardings)
            f = jax.jit(lambda y, idx: jax_api.unpermute_rows(y, idx, n_tokens * top_k, top_k=top_k),
                        out_shardings=x_sh)
            out = f(y, idx)
            same(out, f(one["y"], one["idx"]), "copy sum")
            sharded_like(out, x_sh, "copy sum")
            only(collectives(f, y, idx), set() if width_only else rows | ints, "copy sum")

        def grads():
            def loss(x, idx, p, d):
                y = jax_api.permute_rows(x, idx, top_k=top_k) * 2.0
                return jnp.sum(jax_api.unpermute_rows(y, idx, n_tokens * top_k, top_k=top_k, probs=p) * d)

            f = jax.jit(jax.grad(loss, argnums=(0, 2)))
            dx, dp = f(x, idx, p, d)
            want_dx, want_dp = f(one["x"], one["idx"], one["p"], one["d"])
            same(dx, want_dx, "dx")
            sharded_like(dx, x_sh, "dx")
            if spec[1] is None:
                same(dp, want_dp, "dprobs")
            else:  # dprobs sums over the hidden dim: each device its columns, one fp32 all-reduce
                y64 = np.asarray(R.permute_token_rows(x0, moe_idx, top_k), np.float64) * 2.0
                ref = R.combine_rows_bwd(d0, y64, moe_idx, n_tokens * top_k, top_k, p0)[1]
                mag = R.combine_rows_bwd(np.abs(d0), np.abs(y64), moe_idx, n_tokens * top_k, top_k, p0)[1]
                err, tol = np.abs(np.asarray(dp, np.float64) - ref), R.combine_tolerance(mag, hidden, "float32")
                assert (err <= tol).all(), f"dprobs: {err.max()} beyond the tolerance"
            allowed = dprobs | {("all-reduce", "f32[]")} | (set() if width_only else rows | ints)
            only(collectives(f, x, idx, p, d), allowed, "grads")

        for check, fn in zip(MOE_CHECKS, (dispatch, combine, copy_sum, grads)):
            case(f"{name}: {check}", fn)

    for name, params in MOE_CASES.items():
        moe_case(name, *params)

    def readme_step():  # docs/sharding.md's step; its results are left pending: the process must still exit
        import re

        doc = (ROOT / "docs" / "sharding.md").read_text()
        ns: dict = {}
        exec(re.findall(r"```python\n(.*?)```", doc, re.S)[0], ns)
        sharded_like(ns["dx"], ns["x"].sharding, "dx")
        sharded_like(ns["dw"], ns["w"].sharding, "dw")

    case("readme step", readme_step)

    def add_rows():  # add_rms_norm with rows sharded: local, bitwise one device's (dw: fp32 psum, then bf16)
        mesh = meshes["1d"]
        x0, r0, dy0, ds0 = (rng.standard_normal((8, 3, 64)).astype(R.BF16) for _ in range(4))
        w0 = (1 + 0.5 * rng.standard_normal(64)).astype(R.BF16)
        x_sh = NamedSharding(mesh, P("d"))

        def f(x, r, w, dy, ds):
            out, vjp = jax.vjp(lambda x, r, w: jax_api.add_rms_norm(x, r, w, eps), x, r, w)
            return (*out, *vjp((dy, ds)))

        f = jax.jit(f)
        args = [jax.device_put(a, x_sh) for a in (x0, r0)] + [jax.device_put(w0, NamedSharding(mesh, P()))] + \
            [jax.device_put(a, x_sh) for a in (dy0, ds0)]
        got, want = f(*args), f(*(jnp.asarray(a) for a in (x0, r0, w0, dy0, ds0)))
        no_all_gather(f, *args)
        for name, a, b in zip(("y", "residual_out", "dx", "dresidual"), got, want):
            sharded_like(a, x_sh, name)
            same(a, b, name)
        s64 = R.add_rms_norm_fwd(x0, r0, w0, eps)[1]
        _, rdw, dw_tol = R.add_rms_norm_bwd(s64, w0, dy0, ds0, eps)
        R.check(np.asarray(got[4]), rdw, "dw", abs_ok=dw_tol)

    case("add rows", add_rows)

    def add_width(mesh, spec):  # the hidden dim sharded: local sums, the width-sharded norm, never gathered
        x0, r0, dy0, ds0 = (rng.standard_normal((2, 8, 64)).astype(R.BF16) for _ in range(4))
        w0 = (1 + 0.5 * rng.standard_normal(64)).astype(R.BF16)
        x_sh, w_sh = NamedSharding(mesh, P(*spec)), NamedSharding(mesh, P(spec[-1]))

        def f(x, r, w, dy, ds):
            out, vjp = jax.vjp(lambda x, r, w: jax_api.add_rms_norm(x, r, w, eps), x, r, w)
            return (*out, *vjp((dy, ds)))

        f = jax.jit(f)
        args = [jax.device_put(a, s) for a, s in ((x0, x_sh), (r0, x_sh), (w0, w_sh), (dy0, x_sh), (ds0, x_sh))]
        got, one = f(*args), f(*(jnp.asarray(a) for a in (x0, r0, w0, dy0, ds0)))
        no_all_gather(f, *args)
        for name, a in zip(("y", "residual_out", "dx", "dresidual"), got):
            sharded_like(a, x_sh, name)
        sharded_like(got[4], w_sh, "dw")
        same(got[1], one[1], "residual_out")  # the sum: the fused kernel's bits
        y64, s64 = R.add_rms_norm_fwd(x0, r0, w0, eps)
        R.check(np.asarray(got[0]), y64, "fwd")
        dsum, rdw, dw_tol = R.add_rms_norm_bwd(s64, w0, dy0, ds0, eps)
        R.check(np.asarray(got[2]), dsum, "dx")
        same(got[2], got[3], "dx and dresidual (one gradient, both bf16)")
        R.check(np.asarray(got[4]), rdw, "dw", abs_ok=dw_tol)

    case("add width 1d", lambda: add_width(meshes["1d"], (None, None, "d")))
    case("add rows and width 2d", lambda: add_width(meshes["2d"], (None, "data", "model")))

    def gemm_case(mesh_name, x_spec, w_spec):
        """grouped_mm forward and both gradients: no value on one device, y sharded like x's rows and w's columns,
        the forward free of collectives where K is whole (one psum where it is split), results bitwise one
        device's (y within the FP32 contract where K is split). More rules: tests/test_explicit_sharding.py."""
        mesh = meshes[mesh_name]
        sizes = [9, 0, 14]  # an empty expert; slots 23..31 the zero tail
        offs0 = np.cumsum(sizes).astype(np.int32)
        x0, dy0 = rng.standard_normal((32, 16)).astype(R.BF16), rng.standard_normal((32, 24)).astype(R.BF16)
        w0 = (rng.standard_normal((3, 16, 24)) / 4).astype(R.BF16)
        x_sh, w_sh = NamedSharding(mesh, P(*x_spec)), NamedSharding(mesh, P(*w_spec))
        y_sh = NamedSharding(mesh, P(x_spec[0], w_spec[2]))
        rep = NamedSharding(mesh, P())

        def step(x, w, offs, dy):
            y, vjp = jax.vjp(lambda x, w: jax_api.grouped_mm(x, w, offs), x, w)
            return (y, *vjp(dy))

        fwd = jax.jit(lambda x, w, offs: jax_api.grouped_mm(x, w, offs))
        f = jax.jit(step)
        args = (jax.device_put(x0, x_sh), jax.device_put(w0, w_sh), jax.device_put(offs0, rep),
                jax.device_put(dy0, y_sh))
        got, one = f(*args), f(*(jnp.asarray(a) for a in (x0, w0, offs0, dy0)))
        y = fwd(*args[:3])
        ry = R.grouped_mm(x0, w0, offs0)
        mag = R.grouped_mm(np.abs(x0.astype(np.float64)), np.abs(w0.astype(np.float64)), offs0)
        for name, a, b in zip(("y", "dx", "dw", "y (forward alone)"), (*got, y), (*one, one[0])):
            if name.startswith("y") and x_spec[1] is not None:  # K split: FP32 partials summed in another order
                R.check_sum(np.asarray(a), ry, mag, 16, "bfloat16", name)
            else:
                same(a, b, name)
        sharded_like(y, y_sh, "y")
        ops = collectives(fwd, *args[:3])
        if x_spec[1] is None:  # K whole: each device its rows on its columns, nothing moved
            assert not ops, "collectives in the forward"
        else:  # row parallel: one FP32 psum of the partial products, the weight never gathered
            assert [kind for kind, _ in ops] == ["all-reduce"], ops
        collectives(f, *args)
        assert np.allclose(np.asarray(y).astype(np.float64), ry, rtol=1e-2, atol=1e-2 * np.abs(ry).max()), "y"

    for name, (mesh_name, x_spec, w_spec) in GEMM_CASES.items():
        case(name, functools.partial(gemm_case, mesh_name, x_spec, w_spec))
    return report


def _export() -> dict:
    """A training step over a 2 x 2 mesh, in shard_map (custom_partitioning cannot be serialized: jax.export
    refuses its keepalive), exported for CUDA: a tensor-parallel norm and a row-sharded one."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_api
    from jax_api._launch import gpu_lowering

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    specs = (P("data", "model"), P("model"), P(("data", "model")), P())

    def local(x, w, xr, w2):
        a = jnp.sum(jax_api.rms_norm_tp(x, w, axis_name="model").astype(jnp.float32) ** 2)
        b = jnp.sum(jax_api.rms_norm(xr, w2).astype(jnp.float32) ** 2)
        return jax.lax.psum(a + b, ("data", "model"))

    loss = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())
    shardings = [NamedSharding(mesh, s) for s in specs]
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)), in_shardings=shardings, out_shardings=tuple(shardings))
    S = jax.ShapeDtypeStruct
    args = [S((8, 64), jnp.bfloat16), S((64,), jnp.bfloat16), S((8, 64), jnp.bfloat16), S((64,), jnp.bfloat16)]
    checks = [jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call")]
    with gpu_lowering():
        exported = jax.export.export(step, platforms=["cuda"], disabled_checks=checks)(*args)
    from test_export_cuda import _kernels  # this file's directory is on sys.path: run as a script

    return {"devices": exported.nr_devices, "kernels": _kernels(exported.mlir_module()),
            "same as torch": _torch_parity(exported.mlir_module())}


def _torch_parity(module_text: str) -> list[str]:
    """The width-sharded kernels whose PTX torch_api's DTensor path (torch_api/sharding.py) compiles for the
    same shard (4 x 32 bf16, the whole width 64) as the exported JAX step holds: bitwise-equal results."""
    import torch
    from test_launch_parity import _ptx_from_export, _torch_ptx

    from xkern.rms_norm import plan_rms_norm_bwd_width_sharded, plan_rms_norm_fwd_width_sharded

    jax_ptx = _ptx_from_export(module_text)
    meta = lambda shape, dtype=torch.float32: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
    x, w, sum_sq, sums = meta((4, 32), torch.bfloat16), meta((32,), torch.bfloat16), meta((4,)), meta((4, 2))
    fwd_sums, norm = plan_rms_norm_fwd_width_sharded(4, 32, 1e-6, (32, 32))
    bwd = plan_rms_norm_bwd_width_sharded(4, 32, 1e-6, (32, 32, 32))
    partial = meta((bwd.n_partials, 32))
    scalars = dict(n_rows=4, n_cols=32, n_total=64, x_row_stride=32, y_row_stride=32, dy_row_stride=32,
                   dx_row_stride=32, n_partials=bwd.n_partials)
    launches = [(fwd_sums, [x, sum_sq]), (norm, [x, w, sum_sq, x]), (bwd.sums, [x, w, x, sums]),
                (bwd.finish, [sums, sums]), (bwd.bwd, [x, w, x, sums, x, partial]), (bwd.reduce, [partial, meta(32)])]
    return sorted(plan.kernel.fn.__name__ for plan, arrays in launches
                  if _torch_ptx(plan, arrays, scalars) in jax_ptx.get(plan.kernel.fn.__name__, []))


if __name__ == "__main__":
    print(json.dumps(_check_all(int(sys.argv[2])) if sys.argv[1] == "check" else _export()))
