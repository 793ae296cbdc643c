"""Scalar arguments of any numeric type. numpy integers and floats (and an int eps) give the same results as
the plain Python value, whichever comes first in a process (np.int64(5) == 5 and hashes alike: a plan cached
for one is found for the other). Bools, floats where an int is wanted, and 0-d tensors or arrays are refused
with a TypeError naming the argument, before anything is cached (eps: test_hostile.py's
test_eps_of_wrong_type_raises_type_error_naming_eps)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import DEVICE

import jax_api
import torch_api

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("front_end", ["torch", "jax"])
def test_odd_scalar_first_then_plain_in_a_fresh_process(front_end):
    """tests/scalars_fresh.py: each odd type, then the plain value, in a process that has not seen the call."""
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))  # a GPU run's wheels too
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "scalars_fresh.py"), front_end], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=600)
    ok = [line for line in run.stdout.splitlines() if line.startswith("ok ")]
    assert run.returncode == 0 and len(ok) >= 5 and "FAILED" not in run.stdout, run.stdout + run.stderr[-4000:]


def _torch_args():
    y = torch.ones(3, 8, device=DEVICE)
    idx = torch.tensor([0, -1, 1], dtype=torch.int32, device=DEVICE)
    return y, idx


INT_REFUSED = [np.float64(2.0), 2.0, True, np.bool_(True), np.array(2), "2"]


@pytest.mark.parametrize("bad", INT_REFUSED + [torch.tensor(2)], ids=repr)
def test_torch_refuses_non_integer_counts(bad):
    y, idx = _torch_args()
    counts = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="num_rows"):
        torch_api.unpermute_rows(y, idx, bad)
    with pytest.raises(TypeError, match="num_rows"):
        torch_api.inverse_permutation(idx, bad)
    with pytest.raises(TypeError, match="alignment"):
        torch_api.generate_permute_indices(counts, 2, 1, 16, bad)
    with pytest.raises(TypeError, match="num_experts"):
        torch_api.topk_permute_indices(counts, bad)
    torch_api.unpermute_rows(y, idx, 2)  # the refused call cached nothing


@pytest.mark.parametrize("bad", INT_REFUSED + [jnp.array(2)], ids=repr)
def test_jax_refuses_non_integer_counts(bad):
    y, idx = jnp.ones((3, 8)), jnp.array([0, -1, 1], jnp.int32)
    with pytest.raises(TypeError, match="num_rows"):
        jax_api.unpermute_rows(y, idx, bad)
    with pytest.raises(TypeError, match="num_rows"):
        jax_api.inverse_permutation(idx, bad)
    with pytest.raises(TypeError, match="alignment"):
        jax_api.generate_permute_indices(jnp.array([1, 2], jnp.int32), 2, 1, 16, bad)
    with pytest.raises(TypeError, match="num_experts"):
        jax_api.topk_permute_indices(jnp.array([1, 2], jnp.int32), bad)

