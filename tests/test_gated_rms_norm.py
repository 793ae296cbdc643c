"""Gated RMSNorm (`gated_rms_norm`), both front ends: the FP64 oracle on NaN-poisoned outputs for the four
Hugging Face families (groups, sigmoid, every kernel the plans take), Hugging Face's own classes bit for bit,
torch == JAX bitwise, strided rows read in place, torch.compile (fullgraph, dynamic shapes), forward-mode AD,
the Flax NNX module, and bad arguments.

Widths: 128 (narrow multi-row tiles), 96 in groups of 32 and 300 in groups of 100 (groups, masked lanes),
8200 (backward: statistics + column split; also as 2 groups) and 16392 (forward: column chunks).
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import DEVICE, GPU, TORCH_DTYPES, rand, same_bits, to_numpy, to_torch

import torch_api._launch as tl_launch
from jax_api.gated_rms_norm import gated_rms_norm as jax_gated
from torch_api.gated_rms_norm import GatedRMSNorm, gated_rms_norm
from xkern import reference as R
from xkern.gated_rms_norm import (
    FAMILIES,
    MAX_BWD_BLOCK,
    MAX_FWD_BLOCK,
    gated_rms_norm_bwd_recipe,
    gated_rms_norm_fwd_recipe,
    plans,
)

EPS = 1e-6


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _options(family, activation=None, group_size=None):
    norm_before_gate, act, rounding = FAMILIES[family]
    return dict(group_size=group_size, norm_before_gate=norm_before_gate, activation=activation or act,
                rounding=rounding)


def _inputs(key, shape, x_dtype="bfloat16", w_dtype="bfloat16"):
    rng = _rng(*key)
    return (rand(rng, shape, x_dtype), rand(rng, shape, x_dtype, scale=2.0),
            rand(rng, shape[-1:], w_dtype, scale=0.3, offset=1.0), rng)


def _y_dtype(x_dtype, w_dtype, opts):
    return R.promote(x_dtype, w_dtype).name if not opts["norm_before_gate"] and opts["rounding"] == "llama" \
        else x_dtype


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the eager executors allocate starts as NaN: an element no kernel writes shows."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    tl_launch.clear_executors()  # executors built from here on allocate through nan_empty
    yield
    tl_launch.clear_executors()


CASES = [(family, 5, 128, None, "bfloat16", "bfloat16") for family in FAMILIES]
CASES += [(family, 3, 96, 32, "bfloat16", "bfloat16") for family in FAMILIES]
CASES += [("gate-then-group-norm", 2, 300, 100, "float16", "float32"), ("norm-llama-then-gate", 4, 64, None,
                                                                        "float32", "float32"),
          ("norm-llama-then-gate", 3, 128, None, "bfloat16", "float32"),
          pytest.param("norm-fp32-then-gate", 2, 2 * (MAX_BWD_BLOCK + 8), MAX_BWD_BLOCK + 8, "bfloat16", "bfloat16",
                       marks=pytest.mark.slow),
          pytest.param("gate-then-group-norm", 2, MAX_BWD_BLOCK + 8, None, "bfloat16", "bfloat16",
                       marks=pytest.mark.slow),
          pytest.param("norm-llama-then-gate", 1, MAX_FWD_BLOCK + 8, None, "bfloat16", "bfloat16",
                       marks=pytest.mark.slow)]


@pytest.mark.parametrize("family,rows,width,group_size,x_dtype,w_dtype", CASES)
def test_oracle(poisoned, family, rows, width, group_size, x_dtype, w_dtype):
    _oracle_case(family, rows, width, group_size, x_dtype, w_dtype)


def _oracle_case(family, rows, width, group_size, x_dtype, w_dtype):
    opts = _options(family, group_size=group_size)
    x, z, w, rng = _inputs((family, rows, width, group_size, x_dtype, w_dtype), (rows, width), x_dtype, w_dtype)
    dy = rand(rng, (rows, width), _y_dtype(x_dtype, w_dtype, opts))
    xt, zt, wt = (to_torch(a).requires_grad_() for a in (x, z, w))
    y = gated_rms_norm(xt, zt, wt, EPS, **opts)
    assert y.dtype == TORCH_DTYPES[_y_dtype(x_dtype, w_dtype, opts)]
    tol = R.gated_rms_norm_fwd_tol(x, z, w, EPS, **opts)
    R.check(to_numpy(y), R.gated_rms_norm_fwd(x, z, w, EPS, **opts), "fwd", tol)
    y.backward(to_torch(dy))
    dx, dz, dw, dw_tol = R.gated_rms_norm_bwd(x, z, w, dy, EPS, **opts)
    R.check(to_numpy(xt.grad), dx, "dx")
    R.check(to_numpy(zt.grad), dz, "dx")
    R.check(to_numpy(wt.grad), dw, "dw", dw_tol)


@pytest.fixture
def small_blocks(monkeypatch):
    """The plans' wide-group kernels (forward in column chunks; backward statistics + column split) at small
    widths: the register limits and chunks shrunk to 64 and 32 columns, so that the default tier runs them
    cheaply (the slow tier runs them at their real widths)."""
    for name, value in (("MAX_FWD_BLOCK", 64), ("MAX_BWD_BLOCK", 64), ("FWD_CHUNK", 32), ("STATS_CHUNK", 32),
                        ("COLS_TILE", (4, 32, 1))):
        monkeypatch.setattr(plans, name, value)
    for recipe in (gated_rms_norm_fwd_recipe, gated_rms_norm_bwd_recipe):
        recipe.cache_clear()
    tl_launch.clear_executors()
    yield
    for recipe in (gated_rms_norm_fwd_recipe, gated_rms_norm_bwd_recipe):
        recipe.cache_clear()
    tl_launch.clear_executors()


@pytest.mark.parametrize("family,width,group_size", [("norm-fp32-then-gate", 200, 100),
                                                     ("gate-then-group-norm", 80, None),
                                                     ("norm-llama-then-gate", 72, None)])
def test_oracle_wide_kernels(poisoned, small_blocks, family, width, group_size):
    assert plans.plan_gated_rms_norm_bwd(3, width, group_size or width, EPS).stats is not None
    _oracle_case(family, 3, width, group_size, "bfloat16", "bfloat16")


def test_sigmoid_and_eps(poisoned):
    """Kimi Linear's sigmoid gate, a larger eps (it moves every output)."""
    opts = _options("norm-fp32-then-gate", activation="sigmoid")
    x, z, w, rng = _inputs(("sigmoid",), (6, 64))
    dy = rand(rng, (6, 64), "bfloat16")
    xt, zt, wt = (to_torch(a).requires_grad_() for a in (x, z, w))
    y = gated_rms_norm(xt, zt, wt, 0.5, **opts)
    R.check(to_numpy(y), R.gated_rms_norm_fwd(x, z, w, 0.5, **opts), "fwd")
    y.backward(to_torch(dy))
    dx, dz, dw, dw_tol = R.gated_rms_norm_bwd(x, z, w, dy, 0.5, **opts)
    R.check(to_numpy(xt.grad), dx, "dx")
    R.check(to_numpy(zt.grad), dz, "dx")
    R.check(to_numpy(wt.grad), dw, "dw", dw_tol)


def test_head_major_rows_in_place():
    """Qwen3-Next's layout: [tokens, heads, 2 * head_dim] with x and the gate the two halves of each head's
    row (strided rows), read in place: the same bits as contiguous copies."""
    rng = _rng("strided")
    both = to_torch(rand(rng, (3, 4, 256), "bfloat16"))
    x, z = both[..., :128], both[..., 128:]
    w = to_torch(rand(rng, (128,), "bfloat16", scale=0.3, offset=1.0))
    assert not x.is_contiguous() and tl_launch.rows_layout(x) == (False, 256)
    for family in FAMILIES:
        opts = _options(family)
        assert same_bits(gated_rms_norm(x, z, w, EPS, **opts),
                         gated_rms_norm(x.contiguous(), z.contiguous(), w, EPS, **opts))


def _hf_gated_class(model: str, *names: str) -> type:
    """The first of `names` that `transformers.models.<model>` defines: Mamba2's class is `Mamba2RMSNormGated`
    (hidden_size, group_size, eps) in transformers 5.25, `MambaRMSNormGated` (hidden_size, eps: the whole row,
    no groups) in 5.17."""
    import importlib

    module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    for name in names:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"{module.__name__} defines none of {names}")


def _build_hf_gated(cls: type, n: int, **kwargs) -> torch.nn.Module:
    """`cls(n, ...)` with those of `kwargs` its signature takes (eps always)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    return cls(n, **{k: v for k, v in {"eps": 1e-6, **kwargs}.items() if k in params})


def _hf_group_size(module, n: int) -> int | None:
    """The group size a built HF gated norm computes with (None: the whole row)."""
    if isinstance(getattr(module, "group_size", None), int):
        return module.group_size
    groups = getattr(module, "n_groups", None)
    return n // groups if isinstance(groups, int) and groups > 1 else None


def _within_hf_contract(y: torch.Tensor, ref: torch.Tensor) -> None:
    """The contract against an HF class's own forward (docs/numerics.md): the statistic's FP32 sum runs in
    another order than torch's reduction (and on the CPU the interpreter's exp is numpy's, not torch's), which
    can move a 16-bit rounding of `normed` (or of the output): such elements differ by one ULP of that rounding
    (2^-7 relative in bf16, also in an fp32 output computed from a bf16 `normed`), and at most 1 in 1000 do;
    the rest are bit for bit."""
    assert y.dtype == ref.dtype and y.shape == ref.shape
    got, want = to_numpy(y).astype(np.float64), to_numpy(ref).astype(np.float64)
    differ = got != want
    assert differ.mean() <= 1e-3, f"{differ.sum()} of {differ.size} elements differ"
    assert np.all(np.abs(got - want) <= np.abs(want) * 2.0 ** -7), float(np.max(np.abs(got - want)))


MAMBA2_GATED = ("mamba2", ("Mamba2RMSNormGated", "MambaRMSNormGated"))
HF = [("qwen3_next", ("Qwen3NextRMSNormGated",), {}, "norm-llama-then-gate", {}),
      ("kimi_linear", ("KimiLinearRMSNormGated",), {}, "norm-fp32-then-gate", {"activation": "sigmoid"}),
      (*MAMBA2_GATED, {"group_size": 32}, "gate-then-group-norm", {}),
      ("falcon_h1", ("FalconH1RMSNormGated",), {"n_groups": 2}, "norm-fp32-then-gate", {}),
      ("falcon_h1", ("FalconH1RMSNormGated",), {"n_groups": 2, "norm_before_gate": False},
       "gate-then-fp32-group-norm", {})]


@pytest.mark.parametrize("model,names,kwargs,family,extra", HF, ids=[f"{h[1][0]}-{h[3]}" for h in HF])
@pytest.mark.parametrize("w_dtype", ["bfloat16", "float32"])
def test_hf_forward_bitwise(model, names, kwargs, family, extra, w_dtype):
    """Each family's Hugging Face class against the op with the class's settings: bit for bit but where the
    sum order (or, in the interpreter, numpy's exp) moves a rounding (`_within_hf_contract`)."""
    n = 128
    module = _build_hf_gated(_hf_gated_class(model, *names), n, **kwargs)
    x, z, w, _ = _inputs((names[0], family, w_dtype), (2, 16, n), "bfloat16", w_dtype)
    module.weight.data = to_torch(w, "cpu")
    xt, zt = to_torch(x), to_torch(z)
    module.to(xt.device)
    with torch.no_grad():
        ref = module(xt, zt)
    opts = _options(family, activation=extra.get("activation"), group_size=_hf_group_size(module, n))
    _within_hf_contract(gated_rms_norm(xt, zt, module.weight.detach(), 1e-6, **opts), ref)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_torch_jax_bitwise(family):
    opts = _options(family, group_size=32)
    x, z, w, rng = _inputs(("jax", family), (2, 3, 96), "bfloat16", "float32")
    dy = rand(rng, (2, 3, 96), _y_dtype("bfloat16", "float32", opts))
    xt, zt, wt = (to_torch(a).requires_grad_() for a in (x, z, w))
    y = gated_rms_norm(xt, zt, wt, EPS, **opts)
    y.backward(to_torch(dy))
    yj, vjp = jax.vjp(lambda a, b, c: jax_gated(a, b, c, EPS, **opts), *(jnp.asarray(a) for a in (x, z, w)))
    grads = vjp(jnp.asarray(dy))
    assert same_bits(y, np.asarray(yj))
    for t, g in zip((xt, zt, wt), grads):
        assert same_bits(t.grad, np.asarray(g))
    jitted = jax.jit(lambda a, b, c: jax_gated(a, b, c, EPS, **opts))(*(jnp.asarray(a) for a in (x, z, w)))
    assert same_bits(y, np.asarray(jitted))


def test_torch_compile_fullgraph_dynamic():
    """One graph (fullgraph) with dynamic shapes: two token counts, one compile; the same bits as eager,
    gradients included."""
    torch._dynamo.reset()
    opts = _options("norm-llama-then-gate")
    fn = torch.compile(lambda a, b, c: gated_rms_norm(a, b, c, EPS, **opts), fullgraph=True, dynamic=True)
    for tokens in (3, 5):
        x, z, w, rng = _inputs(("compile", tokens), (tokens, 2, 64))
        dy = to_torch(rand(rng, (tokens, 2, 64), "bfloat16"))
        eager = [to_torch(a).requires_grad_() for a in (x, z, w)]
        comp = [to_torch(a).requires_grad_() for a in (x, z, w)]
        y_eager, y_comp = gated_rms_norm(*eager, EPS, **opts), fn(*comp)
        assert same_bits(y_eager, y_comp)
        y_eager.backward(dy)
        y_comp.backward(dy)
        for a, b in zip(eager, comp):
            assert same_bits(a.grad, b.grad)


def test_forward_ad():
    """jvp (forward-mode AD through the Function's `jvp`) against the fp64 directional derivative."""
    for family in FAMILIES:
        opts = _options(family, group_size=32)
        x, z, w, rng = _inputs(("jvp", family), (3, 64), "float32", "float32")
        tangents = [rand(rng, a.shape, "float32") for a in (x, z, w)]
        primals = [to_torch(a) for a in (x, z, w)]
        _, ty = torch.func.jvp(functools.partial(gated_rms_norm, eps=EPS, **opts), tuple(primals),
                               tuple(to_torch(t) for t in tangents))
        h = 1e-6  # central difference of the oracle on float64 arrays (it then rounds nowhere)
        plus = R.gated_rms_norm_fwd(*(a + h * t.astype(np.float64) for a, t in zip((x, z, w), tangents)), EPS,
                                    **opts)
        minus = R.gated_rms_norm_fwd(*(a - h * t.astype(np.float64) for a, t in zip((x, z, w), tangents)), EPS,
                                     **opts)
        np.testing.assert_allclose(to_numpy(ty), (plus - minus) / (2 * h), rtol=1e-4, atol=1e-4)


def test_module_and_nnx_module():
    """GatedRMSNorm (torch) and the Flax NNX module: parameter `weight`, HF's name; the same bits."""
    nnx = pytest.importorskip("flax.nnx")
    from jax_api.gated_nnx import GatedRMSNorm as NNXGatedRMSNorm

    x, z, w, _ = _inputs(("module",), (4, 64), "bfloat16", "float32")
    torch_module = GatedRMSNorm(64, 1e-6, group_size=32, norm_before_gate=False)
    assert list(dict(torch_module.named_parameters())) == ["weight"]
    torch_module.weight.data = to_torch(w, "cpu")
    torch_module.to(to_torch(x).device)
    jax_module = NNXGatedRMSNorm(64, 1e-6, group_size=32, norm_before_gate=False, rngs=nnx.Rngs(0))
    assert set(nnx.state(jax_module, nnx.Param).keys()) == {"weight"}
    jax_module.weight[...] = jnp.asarray(w)
    assert same_bits(torch_module(to_torch(x), to_torch(z)), np.asarray(jax_module(jnp.asarray(x), jnp.asarray(z))))


BAD = [
    (dict(gate_shape=(4, 32)), ValueError, "gate must have x's shape"),
    (dict(gate_dtype="float32"), TypeError, "gate must have x's dtype"),
    (dict(group_size=24), ValueError, "group_size must divide"),
    (dict(group_size=0), ValueError, "group_size must be >= 1"),
    (dict(group_size=16.0), TypeError, "group_size must be an int"),
    (dict(activation="gelu"), ValueError, "activation must be one of"),
    (dict(rounding="bf16"), ValueError, "rounding must be one of"),
    (dict(norm_before_gate=1), TypeError, "norm_before_gate must be a bool"),
    (dict(w_shape=(32,)), ValueError, "weight must have shape"),
    (dict(eps=-1.0), ValueError, "eps must be >= 0"),
]


@pytest.mark.parametrize("bad,error,message", BAD, ids=[next(iter(b[0])) for b in BAD])
def test_bad_arguments(bad, error, message):
    bad = dict(bad)
    rng = _rng("bad")
    x = rand(rng, (4, 64), "bfloat16")
    z = rand(rng, bad.pop("gate_shape", (4, 64)), bad.pop("gate_dtype", "bfloat16"))
    w = rand(rng, bad.pop("w_shape", (64,)), "bfloat16")
    eps = bad.pop("eps", EPS)
    with pytest.raises(error, match=message):
        gated_rms_norm(to_torch(x), to_torch(z), to_torch(w), eps, **bad)
    with pytest.raises(error, match=message):
        jax_gated(jnp.asarray(x), jnp.asarray(z), jnp.asarray(w), eps, **bad)


def test_plans_cover_every_width():
    """Small and odd group widths (1, 3, 4 and 5 columns) against the oracle; eps 0.1, so that a group of one
    column has a gradient that is not all cancellation."""
    opts = _options("gate-then-group-norm")
    eps = 0.1
    for width, group_size in ((1, 1), (3, 3), (12, 4), (20, 5)):
        x, z, w, rng = _inputs(("widths", width), (3, width))
        dy = rand(rng, (3, width), "bfloat16")
        xt, zt, wt = (to_torch(a).requires_grad_() for a in (x, z, w))
        y = gated_rms_norm(xt, zt, wt, eps, **{**opts, "group_size": group_size})
        R.check(to_numpy(y), R.gated_rms_norm_fwd(x, z, w, eps, **{**opts, "group_size": group_size}), "fwd")
        y.backward(to_torch(dy))
        dx, dz, dw, dw_tol = R.gated_rms_norm_bwd(x, z, w, dy, eps, **{**opts, "group_size": group_size})
        R.check(to_numpy(xt.grad), dx, "dx")
        R.check(to_numpy(zt.grad), dz, "dx")
        R.check(to_numpy(wt.grad), dw, "dw", dw_tol)


# --- Hugging Face models ------------------------------------------------------------------------------


def test_hf_gated_classes_probed():
    """The probe takes every gated family by its math, with its settings (order, activation, rounding, groups)."""
    import transformers.models.falcon_h1.modeling_falcon_h1 as falcon
    import transformers.models.kimi_linear.modeling_kimi_linear as kimi
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next

    from torch_api.hf import GatedNormMath, gated_norm_math

    assert gated_norm_math(qwen3_next.Qwen3NextRMSNormGated) == GatedNormMath(True, "silu", "llama",
                                                                             "variance_epsilon", None, "silu")
    assert gated_norm_math(kimi.KimiLinearRMSNormGated) == GatedNormMath(True, "sigmoid", "fp32",
                                                                        "variance_epsilon", None, "sigmoid")
    mamba2 = _hf_gated_class(MAMBA2_GATED[0], *MAMBA2_GATED[1])  # groups in 5.25; the whole row in 5.17
    groups = "group_size" if hasattr(_build_hf_gated(mamba2, 64, group_size=16), "group_size") else None
    assert gated_norm_math(mamba2) == GatedNormMath(False, "silu", "llama", "variance_epsilon", groups)
    assert gated_norm_math(falcon.FalconH1RMSNormGated) == GatedNormMath(None, "silu", "fp32", "variance_epsilon",
                                                                        "n_groups")
    assert gated_norm_math(qwen3_next.Qwen3NextRMSNorm) is None  # one input: the other probe's


def _tiny_model(name):
    import transformers

    if name == "qwen3_next":
        config = transformers.Qwen3NextConfig(
            vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, linear_num_value_heads=2, linear_num_key_heads=1,
            linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=2,
            num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            layer_types=["linear_attention", "full_attention"])
        return transformers.Qwen3NextForCausalLM(config)
    config = transformers.Mamba2Config(vocab_size=64, hidden_size=64, state_size=16, num_heads=8, head_dim=16,
                                       n_groups=2, num_hidden_layers=2, expand=2, conv_kernel=4, chunk_size=8)
    return transformers.Mamba2ForCausalLM(config)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_next", "mamba2"])
def test_hf_tiny_model(monkeypatch, name):
    """A tiny random Qwen3-Next (gated norm after the linear attention) and Mamba2 (gate first; grouped in
    5.25), bf16, on the GPU where there is one (the CPU only under the interpreter: compiled kernels take CUDA
    tensors): logits with and without xkern (`replace_rms_norm`) bitwise on the CPU, and on the GPU, where
    the statistic's sum order can move a rounding that the next layers carry on, within 1 % relative L2;
    gradients within fp32 summation order; the gated norms counted through xkern.
    Eval mode: Mamba2's training forward calls mamba_ssm's fused scan + norm where it is installed, which
    bypasses the norm module."""
    import copy

    import torch_api.hf.gated as hf_gated
    from torch_api import replace_rms_norm

    calls = []
    monkeypatch.setattr(hf_gated, "gated_rms_norm", lambda *a, **k: calls.append(1) or gated_rms_norm(*a, **k))
    torch.manual_seed(0)
    model = _tiny_model(name).to(DEVICE, torch.bfloat16).eval()
    xkern_model = copy.deepcopy(model)
    assert replace_rms_norm(xkern_model) > 0
    ids = torch.randint(0, 64, (2, 12)).to(DEVICE)
    logits, xkern_logits = model(ids).logits, xkern_model(ids).logits
    assert calls
    if GPU:  # one moved rounding reaches every later logit of its token (and, through the recurrence, later
        # tokens): bounded by size, not count; a wrong norm moves them by O(1)
        rel = ((xkern_logits.float() - logits.float()).norm() / logits.float().norm()).item()
        assert rel <= 1e-2, rel
    else:
        assert same_bits(logits, xkern_logits)
    logits.float().square().mean().backward()
    xkern_logits.float().square().mean().backward()
    for (pname, p), q in zip(model.named_parameters(), xkern_model.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-2, atol=1e-6, msg=pname)


def test_cpu_tensors_without_the_interpreter_are_refused():
    """Without TRITON_INTERPRET, CPU tensors get a ValueError naming the argument (not a Triton pointer error),
    and a Hugging Face gated norm on the CPU runs its own forward (a child process without the interpreter)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    child = (
        "import pytest, torch, transformers\n"
        "from torch_api import replace_rms_norm\n"
        "from torch_api.gated_rms_norm import gated_rms_norm\n"
        "x = torch.randn(2, 64)\n"
        "with pytest.raises(ValueError, match='x must be a CUDA tensor'):\n"
        "    gated_rms_norm(x, x, torch.ones(64), 1e-6)\n"
        "from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated as C\n"
        "m = torch.nn.Sequential(C(64, 1e-6))\n"
        "ref = C.forward(m[0], x, x)\n"
        "assert replace_rms_norm(m) == 1 and torch.equal(m[0](x, x), ref)\n"
        "print('refused')\n")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}")
    run = subprocess.run([sys.executable, "-c", child], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "refused" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]


_SHARDED_CHILD = r"""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jax_api.gated_rms_norm import gated_rms_norm
mesh = jax.make_mesh((2, 2), ("data", "model"))
rng = np.random.default_rng(3)
x, z, dy = (jnp.asarray(rng.standard_normal((4, 4, 64)), jnp.bfloat16) for _ in range(3))
w = jnp.asarray(1 + 0.3 * rng.standard_normal(64), jnp.float32)
out = {}
for family, opts in (("heads", dict(group_size=None)), ("groups", dict(group_size=16, norm_before_gate=False))):
    f = lambda a, b, c: gated_rms_norm(a, b, c, 1e-6, **opts)
    step = lambda a, b, c, d: (lambda y, vjp: (y, *vjp(d)))(*jax.vjp(f, a, b, c))
    one = step(x, z, w, dy.astype(jnp.float32) if family == "groups" else dy)
    spec = NamedSharding(mesh, P("data", "model", None))  # tokens over one axis, heads over the other
    xs, zs, dys = (jax.device_put(a, spec) for a in (x, z, dy.astype(one[0].dtype)))
    got = jax.jit(step)(xs, zs, w, dys)
    same = [bool(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))) for a, b in
            zip(one[:3], got[:3])]
    dw_err = float(np.max(np.abs(np.asarray(one[3]) - np.asarray(got[3]))) / np.max(np.abs(np.asarray(one[3]))))
    out[family] = dict(bitwise=same, dw_rel=dw_err, y_spec=str(got[0].sharding.spec))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_jax_partitioned_rows_and_heads():
    """Under jit on a 2 x 2 CPU mesh, tokens and heads sharded: y, dx and dz bitwise one device's and sharded
    like x; dw (each device's fp32 sum, all-reduced) within fp32 reassociation."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", _SHARDED_CHILD], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for family, r in report.items():
        assert all(r["bitwise"]), (family, r)
        assert r["dw_rel"] <= 1e-5, (family, r)  # fp32 dw: the same terms summed in another order
        assert "data" in r["y_spec"] and "model" in r["y_spec"], (family, r)


def test_jax_forward_mode():
    """jax.jvp (the custom_jvp's tangent, the jvp of the jnp expression) against the fp64 directional
    derivative; jax.grad still runs the backward kernel (bitwise the torch op's, test_torch_jax_bitwise)."""
    for family in ("norm-llama-then-gate", "gate-then-group-norm"):
        opts = _options(family, group_size=32)
        x, z, w, rng = _inputs(("jax jvp", family), (3, 64), "float32", "float32")
        tangents = [rand(rng, a.shape, "float32") for a in (x, z, w)]
        _, ty = jax.jvp(functools.partial(jax_gated, eps=EPS, **opts), tuple(jnp.asarray(a) for a in (x, z, w)),
                        tuple(jnp.asarray(t) for t in tangents))
        h = 1e-6
        plus = R.gated_rms_norm_fwd(*(a + h * t.astype(np.float64) for a, t in zip((x, z, w), tangents)), EPS,
                                    **opts)
        minus = R.gated_rms_norm_fwd(*(a - h * t.astype(np.float64) for a, t in zip((x, z, w), tangents)), EPS,
                                     **opts)
        np.testing.assert_allclose(np.asarray(ty), (plus - minus) / (2 * h), rtol=1e-4, atol=1e-4)


_PARITY_CHILD = r"""
import sys
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp, torch
from test_launch_parity import _ptx_from_export, _torch_ptx
from jax_api._launch import gpu_lowering
from jax_api.gated_rms_norm import gated_rms_norm
from xkern.gated_rms_norm import FAMILIES, gated_rms_norm_bwd_recipe, gated_rms_norm_fwd_recipe, out_dtype_name

checks = [jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call")]
compared = 0
for rows, n, group, family, act in ((66, 128, None, "norm-llama-then-gate", "silu"),
                                    (33, 64, None, "norm-fp32-then-gate", "sigmoid"),
                                    (9, 1024, 128, "gate-then-group-norm", "silu"),
                                    (3, 9000, None, "gate-then-fp32-group-norm", "silu"),
                                    (2, 16400, None, "norm-llama-then-gate", "silu")):
    nbg, _, rnd = FAMILIES[family]
    opts = dict(norm_before_gate=nbg, activation=act, rounding=rnd)
    S = jax.ShapeDtypeStruct
    loss = lambda x, z, w: jnp.sum(gated_rms_norm(x, z, w, 1e-6, group_size=group, **opts).astype(jnp.float32))
    with gpu_lowering():
        exported = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                                     disabled_checks=checks)(S((rows, n), jnp.bfloat16), S((rows, n), jnp.bfloat16),
                                                             S((n,), jnp.float32))
    jax_ptx = _ptx_from_export(exported.mlir_module())
    y_dt = out_dtype_name("bfloat16", "float32", nbg, rnd)
    meta = lambda shape, d: torch.empty(shape, dtype=getattr(torch, d), device="meta")
    env = dict(x=meta((rows, n), "bfloat16"), z=meta((rows, n), "bfloat16"), w=meta((n,), "float32"),
               dy=meta((rows, n), y_dt))
    ours = {}
    for recipe in (gated_rms_norm_fwd_recipe(rows, n, group or n, 1e-6, "bfloat16", "float32", **opts),
                   gated_rms_norm_bwd_recipe(rows, n, group or n, 1e-6, "bfloat16", "float32", **opts)):
        for step in recipe.steps:
            outs = [meta(b.shape, b.dtype) for b in step.outputs]
            if step.launch is not None:
                ours[step.launch.kernel.fn.__name__] = _torch_ptx(step.launch, [env[k] for k in step.inputs] + outs,
                                                                  step.scalars)
            env.update(zip((b.name for b in step.outputs), outs))
    for name, ptx in ours.items():
        assert name in jax_ptx, (rows, n, name, sorted(jax_ptx))
        assert all(other == ptx for other in jax_ptx[name]), f"{rows}x{n} {family}: {name} differs"
        compared += len(jax_ptx[name])
print(f"identical PTX for {compared} gated launches")
"""


@pytest.mark.slow
@pytest.mark.sm90_static
def test_torch_and_jax_launch_identical_ptx():
    """Both front ends compile the same PTX for the gated kernels (sm_90, on CPU): every kernel the plans take."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}")
    run = subprocess.run([sys.executable, "-c", _PARITY_CHILD], cwd=root, env=env, capture_output=True, text=True,
                         timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "identical PTX for" in run.stdout


def test_hf_class_patching_and_kernels_layer():
    """patch_hf_classes takes the gated classes (and unpatch restores them); the `kernels` layer "RMSNormGated"
    computes through xkern where kernelize binds it."""
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next

    import torch_api
    from torch_api import hf

    cls = qwen3_next.Qwen3NextRMSNormGated
    original = cls.forward
    x, z, w, _ = _inputs(("patch",), (3, 64))
    module = cls(64, 1e-6)
    module.weight.data = to_torch(w, "cpu")
    module.to(to_torch(x).device)
    xt, zt = to_torch(x), to_torch(z)
    with torch.no_grad():
        ref = module(xt, zt)
        try:
            assert cls in torch_api.patch_hf_classes("qwen3_next")
            assert cls.forward is not original
            assert same_bits(module(xt, zt), gated_rms_norm(xt, zt, module.weight, 1e-6))
        finally:
            torch_api.unpatch_hf_classes()
        assert cls.forward is original and same_bits(module(xt, zt), ref)
    kernels = pytest.importorskip("kernels")
    added = "kernel_layer_name" not in cls.__dict__
    if added:  # transformers marks its classes only for the `kernels` release it pins
        kernels.replace_kernel_forward_from_hub(cls, "RMSNormGated")
    try:
        model = torch.nn.Sequential(cls(64, 1e-6)).to(xt.device)
        model[0].weight.data = module.weight.data.clone()
        with kernels.use_kernel_mapping(hf.kernel_mapping(), inherit_mapping=False):
            kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device=str(xt.device))
        assert model[0].forward.__func__ is hf.gated.XkernRMSNormGated.forward
        with torch.no_grad():
            assert same_bits(model[0](xt, zt), gated_rms_norm(xt, zt, module.weight, 1e-6))
    finally:
        if added:
            del cls.kernel_layer_name, cls.kernel_condition


@pytest.mark.slow
def test_dtensor_rows_sharded():
    """DTensors sharded on tokens or on heads (2 gloo CPU ranks): y, dx and dz bitwise one rank's, sharded like
    x; dw (each rank's, summed) within bf16 rounding of the one-rank dw."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, str(root / "tests" / "gated_dtensor_child.py")], cwd=root, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for case, r in report.items():
        assert all(r["bitwise"]), (case, r)
        assert r["dw_err"] <= 2 * r["dw_max"] * 2.0 ** -8, (case, r)  # one more bf16 rounding per rank


def test_jax_vmap_forward():
    """jax.vmap of the forward: the batch axis as more rows (bitwise the unbatched call), a batched weight one
    call per example."""
    opts = _options("gate-then-group-norm", group_size=16)
    x, z, w, _ = _inputs(("vmap",), (2, 3, 64), "bfloat16", "float32")
    xj, zj, wj = (jnp.asarray(a) for a in (x, z, w))
    f = functools.partial(jax_gated, eps=EPS, **opts)
    plain = np.asarray(f(xj, zj, wj))
    assert same_bits(np.asarray(jax.vmap(lambda a, b: f(a, b, wj))(xj, zj)), plain)
    batched = jax.vmap(f)(xj, zj, jnp.stack([wj, 2 * wj]))
    assert same_bits(np.asarray(batched[0]), plain[0])


@pytest.mark.slow
def test_benchmark_smoke(tmp_path):
    """benchmarks/gated_rms_norm.py at its smoke sizes: every implementation runs, xkern passes the oracle and
    its JAX front end equals its torch front end bit for bit; the JSON is written."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, "-m", "benchmarks.gated_rms_norm", "--smoke", "--out", str(tmp_path)],
                         cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("bitwise = torch: True") == 3
    (path,) = tmp_path.glob("*-gated_rms_norm-smoke.json")
    rows = json.loads(path.read_text())["results"]
    xkern = [r for r in rows if r["impl"].startswith("xkern")]
    assert xkern and all(r["check"] == "pass" and r["status"] == "ok" for r in xkern)


@pytest.mark.slow
def test_hf_gated_module_compiles_fullgraph():
    """A replace_rms_norm'd Qwen3-Next and Mamba2 gated norm inside a module: torch.compile(fullgraph=True,
    dynamic=True) takes it whole, the same bits as the class's own eager forward, gradients through it."""
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next

    from torch_api import replace_rms_norm

    class Block(torch.nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.norm = norm

        def forward(self, x, z):
            return self.norm(x, z)

    for make in (lambda: qwen3_next.Qwen3NextRMSNormGated(64, 1e-6),
                 lambda: _build_hf_gated(_hf_gated_class(MAMBA2_GATED[0], *MAMBA2_GATED[1]), 64, group_size=16)):
        x, z, w, _ = _inputs(("hf compile",), (5, 64))
        eager, patched = Block(make()), Block(make())
        for block in (eager, patched):
            block.norm.weight.data = to_torch(w, "cpu")
            block.to(to_torch(x).device)
        assert replace_rms_norm(patched) == 1
        torch._dynamo.reset()
        compiled = torch.compile(patched, fullgraph=True, dynamic=True)
        xt, zt = to_torch(x).requires_grad_(), to_torch(z).requires_grad_()
        y = compiled(xt, zt)
        with torch.no_grad():
            ref = eager(to_torch(x), to_torch(z))
        if GPU:
            assert same_bits(y, ref)
        else:  # the interpreter's exp is numpy's (test_hf_forward_bitwise)
            assert (to_numpy(y).astype(np.float64) != to_numpy(ref).astype(np.float64)).mean() <= 1e-2
        y.float().sum().backward()
        assert torch.isfinite(xt.grad).all() and torch.isfinite(zt.grad).all()
