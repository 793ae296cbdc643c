"""Fitting the ecosystems: torch.compile and opcheck on the torch ops, JAX transformations and shard_map on
`jax_api.rms_norm`, and the README's examples (run as written). CPU: Triton's interpreter, tiny shapes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import DEVICE, rand, same_bits, to_numpy, to_torch

import jax_api
import torch_api
from xkern import reference as R

ROOT = Path(__file__).resolve().parent.parent
EPS = 1e-6


def _readme_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = re.search(r"<!-- section: ecosystem -->(.*?)<!-- /section: ecosystem -->", text, re.S).group(1)
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_runs_every_python_block_and_stays_short():
    """Every Python block of the README is one the tests below run (those of its ecosystem section), and the
    README stays a user's entry point (details live in docs/): about 100 lines of tables and figures for the two
    GPU kinds' results, the rest prose and the examples."""
    text = (ROOT / "README.md").read_text()
    assert re.findall(r"```python\n(.*?)```", text, re.S) == _readme_blocks()
    assert len(text.splitlines()) <= 350  # a front page: ops, first calls per framework, results; details live in docs/


# ---------------------------------------------------------------------------------------------------
# PyTorch: the README block, torch.compile(fullgraph), opcheck


def test_readme_torch_block_compiles_fullgraph_and_matches_eager():
    ns: dict = {}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    exec(_readme_blocks()[1], ns)  # runs the example: compiled forward + backward at three lengths
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph for every length
    block, xs = ns["block"], ns["xs"]
    grads = [p.grad.clone() for p in block.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    block.zero_grad()
    for x in xs:
        block(x).square().mean().backward()
    want_grads = [p.grad.clone() for p in block.parameters()]
    x = xs[0].clone().requires_grad_()

    def run(f):
        block.zero_grad()
        x.grad = None
        y = f(x)
        y.square().mean().backward()
        return [y, x.grad] + [p.grad for p in block.parameters()]

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")  # raises on a graph break
    got, want = run(compiled), run(block)
    assert all(same_bits(a, b) for a, b in zip(got, want))  # bitwise: same kernels, same order
    # The README's step: on a GPU it compiles with Inductor, whose fusions of the other ops (linear layers,
    # attention, SiLU) round differently from eager: close, not bitwise
    for got_grad, want_grad in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)


def test_readme_first_call_and_moe_gathers():
    """The README's first call (torch and JAX: the same bits, the oracle's values) and its MoE block."""
    ns: dict = {}
    exec(_readme_blocks()[0], ns)
    x, w, y = (to_numpy(ns[k].detach()) for k in ("x", "w", "y"))
    assert np.array_equal(y.view(np.uint16), np.asarray(ns["y_jax"]).view(np.uint16))
    R.check(y, R.rms_norm_fwd(x, w, EPS), "fwd")
    want_dx, want_dw, dw_tol = R.rms_norm_bwd(x, w, np.ones_like(y), EPS)
    R.check(to_numpy(ns["x"].grad), want_dx, "dx")
    R.check(to_numpy(ns["w"].grad), want_dw, "dw", abs_ok=dw_tol)
    r = ns["x"].detach() * 3  # 3x rounded once, as x + 2x is (2x is exact)
    assert torch.equal(ns["r"], ns["x"] + 2 * ns["x"]) and torch.equal(ns["h"], torch_api.rms_norm(r, ns["w"], EPS))
    ns = {}
    exec(_readme_blocks()[3], ns)
    assert ns["m_sizes"].tolist() == [4, 8] and ns["m_offsets"].tolist() == [4, 12]
    idx = ns["idx"].tolist()
    assert sorted(i for i in idx if i >= 0) == list(range(6)) and idx.count(-1) == 10
    assert torch.equal(ns["y"], 2 * ns["x"])
    tokens, probs, w_e, ids, out = ns["tokens"], ns["probs"], ns["w_e"], ns["topk_ids"], ns["out"]
    want = sum(probs[:, j, None].double() * torch.einsum("th,thn->tn", tokens.double(), w_e[ids[:, j]].double())
               for j in range(2))  # each copy through its expert's weight, weighted by its prob
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    tk_idx = ns["tk_idx"].tolist()  # experts 0, 1, 3 get two copies each, in copy order; expert 2 none
    assert ns["tk_sizes"].tolist() == [4, 4, 4, 4] and tk_idx[:8] == [0, 4, -1, -1, 3, 5, -1, -1]
    assert tk_idx[8:] == [-1] * 4 + [1, 2, -1, -1] + [-1] * 6
    assert not ns["xp"][torch.tensor(tk_idx) < 0].any()


def _rms_inputs(shape=(3, 8), dtype="float32"):
    rng = np.random.default_rng(5)
    return to_torch(rand(rng, shape, dtype)), to_torch(rand(rng, shape[-1:], dtype, 0.5, 1.0)), \
        to_torch(rand(rng, shape, dtype))


def test_opcheck_rms_norm_ops():
    x, w, dy = _rms_inputs((4, 8))
    torch.library.opcheck(torch.ops.xkern.rms_norm_fwd.default, (x.requires_grad_(), w.requires_grad_(), EPS))
    torch.library.opcheck(torch.ops.xkern.rms_norm_bwd.default, (dy, x.detach(), w.detach(), EPS))
    # x and dy as transposed views (q/k norms after .transpose(1, 2)): the fake must give the real layouts
    xt = x.detach().reshape(2, -1, x.shape[-1]).transpose(0, 1)
    dyt = dy.reshape(2, -1, dy.shape[-1]).transpose(0, 1)
    torch.library.opcheck(torch.ops.xkern.rms_norm_fwd.default, (xt, w.detach(), EPS))
    torch.library.opcheck(torch.ops.xkern.rms_norm_bwd.default, (dyt, xt, w.detach(), EPS))
    # the variants: another math, and no weight (an Optional tensor; dw is then an empty placeholder)
    torch.library.opcheck(torch.ops.xkern.rms_norm_fwd.default, (x, w.detach(), EPS, "gemma"))
    torch.library.opcheck(torch.ops.xkern.rms_norm_bwd.default, (dy, x.detach(), w.detach(), EPS, "olmo2"))
    torch.library.opcheck(torch.ops.xkern.rms_norm_fwd.default, (x, None, EPS, "none"))
    torch.library.opcheck(torch.ops.xkern.rms_norm_bwd.default, (dy, x.detach(), None, EPS, "none"))


def test_opcheck_permute_ops():
    counts = torch.tensor([2, 1, 0, 2], dtype=torch.int32, device=DEVICE)
    idx, _, _ = torch.ops.xkern.generate_permute_indices(counts, 2, 2, 16, 4)
    x = to_torch(rand(np.random.default_rng(6), (5, 8), "float32")).requires_grad_()
    torch.library.opcheck(torch.ops.xkern.generate_permute_indices.default, (counts, 2, 2, 16, 4))
    torch.library.opcheck(torch.ops.xkern.permute_rows.default, (x, idx))
    torch.library.opcheck(torch.ops.xkern.inverse_permutation.default, (idx, 5))
    y = to_torch(rand(np.random.default_rng(7), (16, 8), "float32")).requires_grad_()
    torch.library.opcheck(torch.ops.xkern.unpermute_rows.default, (y, idx, 5))
    ids = torch.tensor([[1, 0], [2, 1], [1, 1]], dtype=torch.int64, device=DEVICE)
    torch.library.opcheck(torch.ops.xkern.topk_permute_indices.default, (ids, 3, 12, 2))


# ---------------------------------------------------------------------------------------------------
# JAX: remat, value_and_grad, vmap with in_axes, shard_map


def _jax_inputs(shape=(4, 8), seed=1):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rand(rng, shape, "float32")), jnp.asarray(rand(rng, shape[-1:], "float32", 0.5, 1.0))


def _loss(x, w):
    return jnp.sum(jnp.sin(jax_api.rms_norm(x, w, EPS)))


def test_jax_checkpoint_and_value_and_grad():
    x, w = _jax_inputs()
    want_v = jax.jit(_loss)(x, w)  # jitted like v: XLA's CPU sum may round differently op by op
    want_g = jax.grad(_loss, argnums=(0, 1))(x, w)
    v, g = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1)))(x, w)
    assert same_bits(v.reshape(1), want_v.reshape(1)) and all(same_bits(a, b) for a, b in zip(g, want_g))
    for policy in (None, jax.checkpoint_policies.nothing_saveable):
        g = jax.jit(jax.grad(jax.checkpoint(_loss, policy=policy), argnums=(0, 1)))(x, w)
        assert all(same_bits(a, b) for a, b in zip(g, want_g))
    # Remat inside a larger function: the norm's forward is recomputed in the backward.
    f = jax.checkpoint(lambda x, w: jax_api.rms_norm(x, w, EPS) * 2.0)
    g = jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(jnp.sin(jax_api.rms_norm(x, w, EPS) * 2.0)), argnums=(0, 1))(x, w)
    assert all(same_bits(a, b) for a, b in zip(g, want))


@pytest.mark.parametrize("in_axes", [(0, None), (1, None), (2, None), (0, 0), (None, 0), (-1, 0)])
def test_jax_vmap_in_axes(in_axes):
    n, (xa, wa) = 3, in_axes
    x, w = _jax_inputs((n, 2, 8), seed=2)  # n examples of [2, 8]
    x = x[0] if xa is None else jnp.moveaxis(x, 0, xa)
    w = jnp.stack([w * (1 + 0.1 * i) for i in range(n)]) if wa == 0 else w
    f = jax.grad(_loss, argnums=(0, 1))
    got_y = jax.vmap(lambda x, w: jax_api.rms_norm(x, w, EPS), in_axes=in_axes)(x, w)
    got_g = jax.vmap(f, in_axes=in_axes)(x, w)
    assert got_y.shape == (n, 2, 8)
    for i in range(n):
        xi = x if xa is None else jnp.take(x, i, axis=xa)
        wi = w if wa is None else w[i]
        R.check(to_numpy(got_y[i]), R.rms_norm_fwd(to_numpy(xi), to_numpy(wi), EPS), "fwd")
        for a, b in zip((got_g[0][i], got_g[1][i]), f(xi, wi)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_jax_nested_vmap():
    x, w = _jax_inputs((2, 3, 4, 8), seed=3)
    f = lambda x: jax_api.rms_norm(x, w, EPS)  # noqa: E731
    got = jax.vmap(jax.vmap(f, in_axes=1), in_axes=0)(x)  # [2, 4, 3, 8]
    R.check(to_numpy(jnp.swapaxes(got, 1, 2)), R.rms_norm_fwd(to_numpy(x), to_numpy(w), EPS), "fwd")


_SHARD_MAP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import jax_api
    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("rows",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    w = jnp.asarray(1 + 0.5 * rng.standard_normal(16), jnp.float32)
    norm = jax.shard_map(lambda x, w: jax_api.rms_norm(x, w), mesh=mesh, in_specs=(P("rows"), P()),
                         out_specs=P("rows"))
    loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w))))
    y = jax.jit(norm)(x, w)
    assert np.array_equal(np.asarray(y), np.asarray(jax_api.rms_norm(x, w))), "forward"
    dx, dw = jax.jit(jax.grad(loss(norm), argnums=(0, 1)))(x, w)
    rx, rw = jax.grad(loss(jax_api.rms_norm), argnums=(0, 1))(x, w)
    assert np.array_equal(np.asarray(dx), np.asarray(rx)), "dx"
    np.testing.assert_allclose(np.asarray(dw), np.asarray(rw), rtol=1e-5, atol=1e-6)  # psum of 4 partials
    print("ok")
""")


def test_jax_shard_map_row_sharded():
    # 4 CPU devices need XLA_FLAGS before jax initialises: a fresh interpreter.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = subprocess.run([sys.executable, "-c", _SHARD_MAP], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------
# The README's JAX training step


def test_readme_jax_training_step():
    ns: dict = {}
    exec(_readme_blocks()[2], ns)
    params, x, y = ns["params"], ns["x"], ns["y"]
    assert np.isfinite(float(ns["value"]))
    # One more step by hand, with the reference RMSNorm in place of xkern's: same loss, same update.
    ref = lambda p, x, y: jnp.mean((_ref_norm(x, p["norm"]) @ p["w"] - y) ** 2)  # noqa: E731
    v_ref, g_ref = jax.value_and_grad(ref)(params, x, y)
    new, v = ns["step"](params, x, y)
    np.testing.assert_allclose(float(v), float(v_ref), rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(np.asarray(new[k]), np.asarray(params[k] - 1e-2 * g_ref[k]), rtol=1e-5,
                                   atol=1e-6)
    # its second derivatives (forward mode over the kernels' backward): the reference norm's
    h_ref = jax.hessian(lambda w: ref({**params, "norm": w}, x, y))(params["norm"])
    np.testing.assert_allclose(np.asarray(ns["curvature"]), np.asarray(h_ref), rtol=1e-4, atol=1e-6)
    hvp_ref = jax.jvp(jax.grad(ref), (params, x, y), (params, x, y))[1]
    for k in params:
        np.testing.assert_allclose(np.asarray(ns["hvp"][k]), np.asarray(hvp_ref[k]), rtol=1e-4, atol=1e-6)


def _ref_norm(x, w):
    return w * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS))
