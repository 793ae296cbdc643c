"""Sharding in types, and the grouped GEMM's Megatron rules, on 4 CPU devices (jax_api/sharding.py).

Explicit meshes (`jax.make_mesh`'s default axis types, `jax.set_mesh`): each jax_api op, eager and under jit,
gives its outputs and gradients the type (shape, dtype, sharding) the equivalent jnp expression gets, its
compiled program has no collective kind the jnp expression's lacks, and its values are one device's (bit for
bit, or within the contract where a sum runs over a sharded width). Flax NNX with `nnx.with_partitioning`.

grouped_mm under jit, auto and explicit meshes, 1-D and 2-D: an output-column (N) sharded weight, a K-sharded
(row-parallel) weight and an expert-sharded weight. The compiled forward and training step never all-gather a
weight (no rank-3 all-gather), the forward has at most one reduction, the weight gradient is sharded like the
weight, and the values are one device's bit for bit, or within the FP32 contract (`reference.check_sum`) where
the contracted dim is split.

One child process (XLA_FLAGS must be set before jax initialises) checks every case and reports a line per case.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
N_DEVICES = 4
NORM_CASES = ["rms_norm rows", "rms_norm rows and width", "add_rms_norm rows and width", "permute and combine",
              "variants, vmap, remat and the index ops", "nnx with_partitioning"]
# grouped_mm cases: (mesh shape, axis names, x's spec over [slots 32, K 16], w's spec over [experts 4, K 16, N 24])
GEMM_CASES = {
    "columns 1d": ((4,), ("d",), (None, None), (None, None, "d")),
    "contracted 1d": ((4,), ("d",), (None, "d"), (None, "d", None)),
    "experts 1d": ((4,), ("d",), (None, None), ("d", None, None)),
    "data x model, row parallel": ((2, 2), ("data", "model"), ("data", "model"), (None, "model", None)),
    "data x model, column parallel": ((2, 2), ("data", "model"), ("data", None), (None, None, "model")),
    "data x expert": ((2, 2), ("data", "expert"), ("data", None), ("expert", None, None)),
}
CASES = NORM_CASES + [f"gemm {mode} {name}" for mode in ("explicit", "auto") for name in GEMM_CASES]
# The default tier: one case of each kind (about 30 s on a 2-core machine); CI's slow tier runs the rest.
DEFAULT = {"rms_norm rows and width", "permute and combine", "gemm explicit data x expert",
           "gemm auto data x model, row parallel"}


@functools.cache
def _report(gpus: bool = False) -> dict:
    """4 CPU devices (the interpreter), or with `gpus` the first 4 GPUs (compiled kernels, jax-triton)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if gpus:
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "JAX_PLATFORMS")}
        env.update(PYTHONPATH=path, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    else:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={N_DEVICES}", JAX_PLATFORMS="cpu",
                   TRITON_INTERPRET="1", PYTHONPATH=path)
    run = subprocess.run([sys.executable, __file__, *_selected], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


_selected: list[str] = []  # the cases this session's tests ask for (one child runs them all)


@pytest.mark.host_devices
@pytest.mark.parametrize("case", [c if c in DEFAULT else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_explicit_sharding(case, request):
    if not _selected:  # every case collected in this session, so that one child runs them together
        _selected.extend(item.callspec.params["case"] for item in request.session.items
                         if item.originalname == "test_explicit_sharding")
    assert _report()[case] == "ok"


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.skipif("_gpu_count() < 4", reason="needs 4 or more GPUs")
@pytest.mark.parametrize("case", CASES)
def test_explicit_sharding_gpus(case):
    _selected[:] = CASES
    assert _report(gpus=True)[case] == "ok"


@pytest.mark.sm90_static  # conftest.py: CPU CI runs it, a GPU run skips it
def test_row_parallel_partials_compile_for_sm90():
    """A split contracted dim stores the grouped GEMM's FP32 accumulator unrounded (16-bit inputs, an FP32 Y):
    a variant xkern.compile_check's list does not hold. Compiled for sm_90 here (no GPU needed): each 16-bit
    dtype, both weight layouts (forward and dx), both sides of the inner dim's stage switch."""
    code = """
import triton
from xkern.compile_check import TARGET, source
from xkern.grouped_mm import plan_grouped_mm
for dtype, ptr in (("bfloat16", "*bf16"), ("float16", "*fp16")):
    for n_inner, n_cols in ((256, 512), (8192, 512)):
        for strides in ((n_inner * n_cols, n_cols, 1), (n_inner * n_cols, 1, n_inner)):
            plan = plan_grouped_mm(8192, n_inner, n_cols, 8, dtype, n_inner, strides)
            kernel = triton.compile(source(plan, {"X": ptr, "W": ptr, "OFFS": "*i32", "Y": "*fp32"}), target=TARGET,
                                    options={"num_warps": plan.num_warps, "num_stages": plan.num_stages})
            assert "cubin" in kernel.asm
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-2000:] + run.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------
# The child


def _check(cases: list[str]) -> dict:
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_api
    from xkern import reference as R

    devices = jax.devices()[:N_DEVICES]  # CPU: exactly these; GPU: the first 4
    assert len(devices) == N_DEVICES, jax.devices()
    rng = np.random.default_rng(7)
    report = {}
    eps = 1e-6
    kinds = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter|collective-broadcast"

    def case(name, fn):
        if name not in cases:
            return
        try:
            fn()
            report[name] = "ok"
        except Exception as e:  # one line per failing case, the others still run
            report[name] = f"{type(e).__name__}: {e}"[:2000]

    def compiled(f, *args):
        """(f compiled for args, the (kind, result type without layout) of each collective in it); asserts no
        value was placed on one device."""
        lowered = f.lower(*args)
        assert "maximal" not in lowered.as_text(), "a value placed on one device ({maximal ...} sharding)"
        program = lowered.compile()
        hlo = program.as_text()
        ops = re.findall(rf"= (\([^)]*\)|\S+) ({kinds})(?:-start)?\(", hlo)
        assert len(ops) == len(re.findall(rf"\b(?:{kinds})(?:-start)?\(", hlo)), "a collective not parsed"
        return program, [(kind, re.sub(r"\{[^}]*\}", "", shape)) for shape, kind in ops]

    def collectives(f, *args) -> list[tuple[str, str]]:
        return compiled(f, *args)[1]

    def no_new_collectives(ours, theirs, what):
        extra = {k for k, _ in ours} - {k for k, _ in theirs}
        assert not extra, f"{what}: {sorted(extra)} where the jnp expression has {sorted({k for k, _ in theirs})}"

    def same(a, b, what):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{what} differs"

    def same_types(ours, theirs, what):
        ours, theirs = (jax.tree.map(lambda a: str(jax.typeof(a)), t) for t in (ours, theirs))
        assert ours == theirs, f"{what}: {ours}, the jnp expression's {theirs}"

    def rms_ref(x, w):  # Llama's RMSNorm in jnp
        x32 = x.astype(jnp.float32)
        return w * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)

    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=devices)  # Explicit axes: the default
    assert set(mesh.axis_types) == {AxisType.Explicit}, mesh.axis_types

    def norm_case(x_spec, w_spec):
        """rms_norm eager and jitted, `norm @ k`, and the gradients: jnp's types, no collective kind beyond
        jnp's, values one device's (bitwise; within the contract with the hidden dim split)."""
        x0 = rng.standard_normal((8, 64)).astype(R.BF16)
        w0 = (1 + 0.5 * rng.standard_normal(64)).astype(R.BF16)
        k0 = rng.standard_normal((64, 32)).astype(R.BF16)
        width = w_spec[0] is not None
        with jax.set_mesh(mesh):
            x, w = jax.device_put(x0, P(*x_spec)), jax.device_put(w0, P(*w_spec))
            k = jax.device_put(k0, P(None, "model"))
            ours, theirs = (lambda a, b: jax_api.rms_norm(a, b, eps)), rms_ref
            same_types(ours(x, w), theirs(x, w), "eager")
            fo, ours_ops = compiled(jax.jit(lambda a, b, c: ours(a, b) @ c), x, w, k)
            ft, theirs_ops = compiled(jax.jit(lambda a, b, c: theirs(a, b) @ c), x, w, k)
            same_types(fo(x, w, k), ft(x, w, k), "jit(norm @ k)")
            no_new_collectives(ours_ops, theirs_ops, "jit(norm @ k)")

            def loss(norm, a, b):
                return jnp.sum(norm(a, b).astype(jnp.float32) ** 2)

            go, ours_ops = compiled(jax.jit(jax.grad(functools.partial(loss, ours), argnums=(0, 1))), x, w)
            gt, theirs_ops = compiled(jax.jit(jax.grad(functools.partial(loss, theirs), argnums=(0, 1))), x, w)
            got = go(x, w)
            same_types(got, gt(x, w), "grad")
            no_new_collectives(ours_ops, theirs_ops, "grad")
            y = jax.jit(ours)(x, w)
        one = jax.jit(ours)(jnp.asarray(x0), jnp.asarray(w0))
        rdx, rdw, dw_tol = R.rms_norm_bwd(x0, w0, 2 * np.asarray(one, np.float64), eps)
        if width:  # row sums over a split width: the contract
            R.check(np.asarray(y), R.rms_norm_fwd(x0, w0, eps), "fwd", R.rms_norm_fwd_tol(x0, w0, eps))
        else:
            same(y, one, "y")
            same(got[0], jax.grad(functools.partial(loss, ours))(jnp.asarray(x0), jnp.asarray(w0)), "dx")
        assert np.isfinite(np.asarray(got[1], np.float64)).all(), "dw"

    case("rms_norm rows", lambda: norm_case(("data", None), (None,)))
    case("rms_norm rows and width", lambda: norm_case(("data", "model"), ("model",)))

    def add_case():
        x0, r0 = (rng.standard_normal((8, 64)).astype(R.BF16) for _ in range(2))
        w0 = (1 + 0.5 * rng.standard_normal(64)).astype(R.BF16)

        def theirs(a, r, b):
            s = a + r
            return rms_ref(s, b), s

        def loss(f, a, r, b):
            y, s = f(a, r, b)
            return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(s.astype(jnp.float32))

        with jax.set_mesh(mesh):
            x, r = (jax.device_put(a, P("data", "model")) for a in (x0, r0))
            w = jax.device_put(w0, P("model"))
            ours = lambda a, r, b: jax_api.add_rms_norm(a, r, b, eps)  # noqa: E731
            same_types(ours(x, r, w), theirs(x, r, w), "eager")
            go = jax.jit(jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2)))
            gt = jax.jit(jax.grad(functools.partial(loss, theirs), argnums=(0, 1, 2)))
            same_types(go(x, r, w), gt(x, r, w), "grad")
            no_new_collectives(collectives(go, x, r, w), collectives(gt, x, r, w), "grad")
            y, s = jax.jit(ours)(x, r, w)
        y64, s64 = R.add_rms_norm_fwd(x0, r0, w0, eps)
        R.check(np.asarray(y), y64, "fwd")
        same(s, jax.jit(ours)(jnp.asarray(x0), jnp.asarray(r0), jnp.asarray(w0))[1], "residual_out")

    case("add_rms_norm rows and width", add_case)

    def moe_case():
        """top-2 dispatch and weighted combine (and their gradients), tokens and hidden split: the types the
        sharding rules give (jnp's gathers have none under explicit axes), values bitwise one device's."""
        x0 = rng.standard_normal((8, 32)).astype(R.BF16)
        probs0 = rng.random((8, 2)).astype(np.float32)
        ids = jnp.asarray(rng.integers(0, 4, (8, 2)), jnp.int32)
        idx, _, _ = jax_api.topk_permute_indices(ids, 4)

        def layer(x, p, idx):
            y = jax_api.permute_rows(x, idx, top_k=2)
            return jax_api.unpermute_rows(y * 2, idx, 16, top_k=2, probs=p)

        def loss(x, p, idx):
            return jnp.sum(layer(x, p, idx).astype(jnp.float32) ** 2)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        want = step(jnp.asarray(x0), jnp.asarray(probs0), idx)
        with jax.set_mesh(mesh):
            x, p = jax.device_put(x0, P("data", "model")), jax.device_put(probs0, P("data", None))
            idx = jax.device_put(idx, P())
            out = layer(x, p, idx)
            assert str(jax.typeof(out)) == "bfloat16[8@data,32@model]", jax.typeof(out)
            got = step(x, p, idx)
            same_types(got[1], (x, p), "grads")
            collectives(step, x, p, idx)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)  # jnp.sum over shards: another order
        same(got[1][0], want[1][0], "dx")
        # dprobs sums over the split hidden dim: the FP32 contract
        np.testing.assert_allclose(np.asarray(got[1][1]), np.asarray(want[1][1]), rtol=1e-5, atol=1e-5)

    case("permute and combine", moe_case)

    def more_case():
        """The rest, typed as jnp's or as their rules say: the variants (Gemma, no weight) on a sharded width
        (their width-sharded kernels: no collective jnp has not), vmap and remat of the gradients, the index
        ops, plain unpermute."""
        x0 = rng.standard_normal((2, 8, 64)).astype(np.float32)
        w0 = (1 + 0.5 * rng.standard_normal(64)).astype(np.float32)

        def loss(f, a, b):
            return jnp.sum(f(a, b) ** 2)

        with jax.set_mesh(mesh):
            x, w = jax.device_put(x0, P(None, "data", "model")), jax.device_put(w0, P("model"))
            gemma = lambda a, b: jax_api.rms_norm(a, b, eps, variant="gemma")  # noqa: E731
            gemma_ref = lambda a, b: (rms_ref(a, jnp.ones_like(b)) * (1 + b))  # noqa: E731
            same_types(jax.jit(gemma)(x, w), gemma_ref(x, w), "gemma")
            same_types(jax_api.rms_norm(x, None), rms_ref(x, 1.0), "no weight")
            def grad_collectives(f):
                return collectives(jax.jit(jax.grad(functools.partial(loss, f), argnums=(0, 1))), x, w)

            no_new_collectives(grad_collectives(gemma), grad_collectives(gemma_ref), "gemma, grad")
            unweighted = lambda a, b: jax_api.rms_norm(a, None, eps) * b  # noqa: E731
            unweighted_ref = lambda a, b: rms_ref(a, 1.0) * b  # noqa: E731
            no_new_collectives(grad_collectives(unweighted), grad_collectives(unweighted_ref), "no weight, grad")
            for name, t in (("vmap", lambda g: jax.vmap(g, in_axes=(0, None))), ("remat", jax.checkpoint)):
                ours = jax.jit(t(jax.grad(functools.partial(loss, jax_api.rms_norm), argnums=(0, 1))))
                theirs = jax.jit(t(jax.grad(functools.partial(loss, rms_ref), argnums=(0, 1))))
                same_types(ours(x, w), theirs(x, w), name)
            ids = jax.device_put(jnp.asarray(rng.integers(0, 4, (8, 2)), jnp.int32), P("data", None))
            idx, sizes, offs = jax_api.topk_permute_indices(ids, 4)
            assert [str(jax.typeof(a)) for a in (idx, sizes, offs)] == ["int32[20]", "int32[4]", "int32[4]"]
            perm = jax.device_put(jnp.asarray(rng.permutation(8), jnp.int32), P("data"))
            assert str(jax.typeof(jax_api.inverse_permutation(perm, 8))) == "int32[8]"
            y = jax.device_put(x0[0], P("data", "model"))
            out = jax.jit(lambda y, i: jax_api.unpermute_rows(y, i, 8))(y, perm)
            assert str(jax.typeof(out)) == "float32[8,64@model]", jax.typeof(out)
        want = R.rms_norm_fwd(x0, w0, eps, "gemma")
        R.check(np.asarray(jax.jit(gemma)(x, w)), want, "gemma", R.rms_norm_fwd_tol(x0, w0, eps, "gemma"))
        same(idx, jax_api.topk_permute_indices(jnp.asarray(ids), 4)[0], "topk_permute_indices")
        np.testing.assert_array_equal(np.asarray(out)[np.asarray(perm)], x0[0])

    case("variants, vmap, remat and the index ops", more_case)

    def nnx_case():
        from flax import nnx

        import jax_api.nnx as xnnx

        x0 = rng.standard_normal((8, 64)).astype(np.float32)
        results = {}
        with jax.set_mesh(mesh):
            x = jax.device_put(x0, P("data", "model"))
            for name, cls in (("flax", nnx.RMSNorm), ("xkern", xnnx.RMSNorm)):
                m = cls(64, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("model",)), rngs=nnx.Rngs(0))

                @nnx.jit
                def step(m, x):
                    return nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(m)

                loss, grads = step(m, x)
                results[name] = (m(x), grads.scale[...], loss)
        same_types(results["xkern"][:2], results["flax"][:2], "nnx")
        np.testing.assert_allclose(results["xkern"][2], results["flax"][2], rtol=1e-5)

    case("nnx with_partitioning", nnx_case)

    def gemm_case(mode, mesh_shape, names, x_spec, w_spec):
        """grouped_mm's forward and training step (y, dx, dw): no weight all-gathered, one reduction at most in
        the forward, dw sharded like w, values one device's (bitwise, or the FP32 contract where K or N is the
        contracted dim and split)."""
        types = (AxisType.Explicit if mode == "explicit" else AxisType.Auto,) * len(names)
        gmesh = jax.make_mesh(mesh_shape, names, axis_types=types, devices=devices)
        offs0 = np.cumsum([9, 0, 14, 5]).astype(np.int32)  # an empty expert; slots 28..31 the zero tail
        x0, dy0 = rng.standard_normal((32, 16)).astype(R.BF16), rng.standard_normal((32, 24)).astype(R.BF16)
        w0 = (rng.standard_normal((4, 16, 24)) / 4).astype(R.BF16)

        def step(x, w, offs, dy):
            y, vjp = jax.vjp(lambda x, w: jax_api.grouped_mm(x, w, offs), x, w)
            return (y, *vjp(dy))

        fwd = jax.jit(lambda x, w, offs: jax_api.grouped_mm(x, w, offs))
        want = jax.jit(step)(*(jnp.asarray(a) for a in (x0, w0, offs0, dy0)))
        with jax.set_mesh(gmesh):
            x_sh, w_sh = NamedSharding(gmesh, P(*x_spec)), NamedSharding(gmesh, P(*w_spec))
            y_spec = P(x_spec[0], w_spec[2])
            args = (jax.device_put(x0, x_sh), jax.device_put(w0, w_sh), jax.device_put(offs0, P()),
                    jax.device_put(dy0, NamedSharding(gmesh, y_spec)))
            # Auto axes: a training framework pins the gradients to the parameters' shardings.
            f = jax.jit(step, out_shardings=None if mode == "explicit" else (None, x_sh, w_sh))
            (f, step_ops), (fwd, fwd_ops) = compiled(f, *args), compiled(fwd, *args[:3])
            got, y = f(*args), fwd(*args[:3])
            if mode == "explicit":  # eager: typed as under jit, the same bits
                eager = jax_api.grouped_mm(*args[:3])
                assert str(jax.typeof(eager)) == str(jax.typeof(y)), (jax.typeof(eager), jax.typeof(y))
                same(eager, y, "y (eager)")
        weight_gathers = [c for c in fwd_ops + step_ops if c[0] == "all-gather" and c[1].count(",") >= 2]
        assert not weight_gathers, f"a weight all-gathered: {weight_gathers}"
        assert not [c for c in fwd_ops if c[0] == "all-gather" and not c[1].startswith("s32")], fwd_ops
        assert len([c for c in fwd_ops if c[0] != "all-gather"]) <= 1, f"forward: {fwd_ops}"
        assert got[2].sharding.is_equivalent_to(w_sh, 3), f"dw: {got[2].sharding} instead of {w_sh}"
        if mode == "explicit":
            assert str(jax.typeof(got[2])) == str(jax.typeof(args[1])), (jax.typeof(got[2]), jax.typeof(args[1]))
            assert jax.typeof(got[1]).sharding.spec == jax.typeof(args[0]).sharding.spec, jax.typeof(got[1])
        assert y.sharding.is_equivalent_to(NamedSharding(gmesh, y_spec), 2), f"y: {y.sharding}"
        ry = R.grouped_mm(x0, w0, offs0)
        rdx, _ = R.grouped_mm_bwd(x0, w0, dy0, offs0)
        mag_y = R.grouped_mm(np.abs(x0.astype(np.float64)), np.abs(w0.astype(np.float64)), offs0)
        mag_dx, _ = R.grouped_mm_bwd(x0, np.abs(w0.astype(np.float64)), np.abs(dy0.astype(np.float64)), offs0)
        # The sum of |terms| for dx: |dy| @ |w|.T (the oracle's x argument only shapes the result).
        for what, a, b, ref64, mag, n_terms, split in (
                ("y", got[0], want[0], ry, mag_y, 16, w_spec[1]), ("y (forward alone)", y, want[0], ry, mag_y, 16,
                                                                      w_spec[1]),
                ("dx", got[1], want[1], rdx, mag_dx, 24, w_spec[2]), ("dw", got[2], want[2], None, None, 0, None)):
            if split:
                R.check_sum(np.asarray(a), ref64, mag, n_terms, "bfloat16", what)
            else:
                same(a, b, what)

    for mode in ("explicit", "auto"):
        for name, params in GEMM_CASES.items():
            case(f"gemm {mode} {name}", functools.partial(gemm_case, mode, *params))
    return report


if __name__ == "__main__":
    print(json.dumps(_check(sys.argv[1:] or CASES)))
