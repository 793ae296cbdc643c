"""torch.func over every op's backward: per-sample gradients (vmap of grad), jacrev, hessian, and
autograd.grad(is_grads_batched=True), each against the same derivatives taken one example at a time (or,
for rms_norm, against the eager expression's in FP64)."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE

import torch_api
from torch_api.rms_norm import reference_math

B, N, H = 3, 6, 8


def _randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _loop(f, *batched):
    """f's results one example at a time, stacked: what vmap must equal."""
    outs = [f(*args) for args in zip(*batched)]
    return tuple(torch.stack(o) for o in zip(*outs)) if isinstance(outs[0], tuple) else torch.stack(outs)


def _close(a, b, tol=1e-5):
    if isinstance(a, tuple):
        return all(_close(x, y, tol) for x, y in zip(a, b, strict=True))
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)


def test_rms_norm_per_sample_grads_jacrev_hessian():
    x, w, c = _randn(B, N, H, seed=1), _randn(H, seed=2) + 1, _randn(N, H, seed=3)

    def loss(x, w):
        return (torch_api.rms_norm(x, w, 1e-5) * c).square().sum()

    def oracle(x, w):
        return (reference_math(x.double(), w.double(), 1e-5) * c.double()).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(0, None))(x, w)
    expected = _loop(torch.func.grad(oracle, argnums=(0, 1)), x, [w] * B)
    assert _close(per_sample, expected)
    jac = torch.func.jacrev(lambda x: torch_api.rms_norm(x, w, 1e-5))(x[0, :2])
    assert _close(jac, torch.func.jacrev(lambda x: reference_math(x, w.double(), 1e-5))(x[0, :2].double()))
    hess = torch.func.hessian(lambda x: loss(x, w))(x[0])
    assert _close(hess, torch.func.hessian(lambda x: oracle(x, w))(x[0].double()), 1e-4)


def test_rms_norm_batched_grads():
    x, w = _randn(N, H, seed=1).requires_grad_(), (_randn(H, seed=2) + 1).requires_grad_()
    dys = _randn(B, N, H, seed=4)
    y = torch_api.rms_norm(x, w)
    got = torch.autograd.grad(y, (x, w), dys, is_grads_batched=True, retain_graph=True)
    assert _close(got, _loop(lambda dy: torch.autograd.grad(y, (x, w), dy, retain_graph=True), dys))


def test_add_rms_norm_per_sample_grads():
    x, r, w = _randn(B, N, H, seed=1), _randn(B, N, H, seed=5), _randn(H, seed=2) + 1

    def loss(x, r):
        y, s = torch_api.add_rms_norm(x, r, w)
        return y.square().sum() + s.sum()

    got = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)))(x, r)
    assert _close(got, _loop(torch.func.grad(loss, argnums=(0, 1)), x, r))


def _routing(n_tokens: int, top_k: int, seed: int) -> torch.Tensor:
    return torch.randperm(n_tokens * top_k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, torch.int32)


@pytest.mark.parametrize("top_k", [1, 2])
def test_permute_and_combine_per_sample_grads(top_k):
    """permute_rows' backward is unpermute_rows, the combine's its own kernel: vmap(grad) through both."""
    idx = _routing(N, top_k, 7)
    x, probs = _randn(B, N, H, seed=1), _randn(B, N, top_k, seed=6).softmax(-1)

    def loss(x, probs):
        y = torch_api.permute_rows(x, idx, top_k=top_k) * 1.5
        out = torch_api.unpermute_rows(y, idx, N * top_k, top_k=top_k, probs=probs if top_k > 1 else None)
        return out.square().sum() + (probs.sum() if top_k > 1 else 0)

    grad = torch.func.grad(loss, argnums=(0, 1))
    assert _close(torch.func.vmap(grad)(x, probs), _loop(grad, x, probs))


def test_permute_batched_grads_and_jacrev():
    idx = _routing(N, 1, 8)
    x = _randn(N, H, seed=1).requires_grad_()
    out = torch_api.permute_rows(x, idx)
    dys = _randn(B, N, H, seed=2)
    (got,) = torch.autograd.grad(out, x, dys, is_grads_batched=True, retain_graph=True)
    assert _close(got, _loop(lambda dy: torch.autograd.grad(out, x, dy, retain_graph=True)[0], dys))
    jac = torch.func.jacrev(lambda x: torch_api.permute_rows(x, idx))(x.detach()[:, :2].contiguous())
    assert _close(jac, torch.func.jacrev(lambda x: x[idx.long()])(x.detach()[:, :2].contiguous()))


def test_grouped_mm_per_sample_grads():
    x, w = _randn(B, N, H, seed=1), _randn(2, H, 4, seed=2)
    offs = torch.tensor([2, N], dtype=torch.int32, device=DEVICE)

    def loss(x, w):
        return torch_api.grouped_mm(x, w, offs).square().sum()

    grad = torch.func.grad(loss, argnums=(0, 1))
    assert _close(torch.func.vmap(grad, in_dims=(0, None))(x, w), _loop(grad, x, [w] * B))
