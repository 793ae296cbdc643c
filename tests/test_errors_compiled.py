"""Errors raised inside torch.compile / jax.jit still name the argument and the expectation."""

import jax
import jax.numpy as jnp
import pytest
import torch
from helpers import DEVICE

import jax_api
import torch_api


def test_torch_compile_fullgraph_errors_name_the_argument():
    f = torch.compile(lambda x, w: torch_api.rms_norm(x, w), fullgraph=True, backend="aot_eager")
    x, w = torch.ones(4, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    # Under fullgraph, dynamo reports a Python exception as `Unsupported` whose text carries ours.
    with pytest.raises(Exception, match="x must be float16, bfloat16 or float32"):
        f(x.to(torch.int32), w)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"weight must have shape \[8\]"):
        f(x, torch.ones(7, device=DEVICE))
    torch._dynamo.reset()
    g = torch.compile(lambda x, w: torch_api.rms_norm(x, w, eps=-1.0), backend="aot_eager")
    with pytest.raises(ValueError, match="eps must be >= 0"):  # without fullgraph: the original exception
        g(x, w)
    torch._dynamo.reset()


def test_jax_jit_errors_name_the_argument():
    f = jax.jit(jax_api.rms_norm)
    with pytest.raises(TypeError, match="x must be float16, bfloat16 or float32, got int32"):
        f(jnp.ones((4, 8), jnp.int32), jnp.ones(8))
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        f(jnp.ones((4, 8)), jnp.ones(7))
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        jax.jit(jax.grad(lambda x, w: jax_api.rms_norm(x, w).sum()))(jnp.ones((4, 8)), jnp.ones(3))
