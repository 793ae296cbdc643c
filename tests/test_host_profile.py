"""`tools/host_profile.py`: the eager calls' host profile with launches stubbed, and the eager path's reads of
misaligned inputs on a cached call signature (its per-call check)."""

from __future__ import annotations

import numpy as np
import torch

import torch_api
from tests.helpers import DEVICE, rand, same_bits, to_torch
from tools import host_profile as hp


def test_table_has_every_path_with_its_floor_and_peer(capsys):
    """The CLI prints one row per op and path with xkern's, the floor's and torch's µs, rms_norm's steps and a
    profile."""
    hp.main(["--device", DEVICE, "--loop", "4", "--rounds", "1", "--parts", "--profile", "rms_norm fwd", "--top", "5"])
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [(r[0].strip("| "), r[1]) for r in rows] == [
        (op, path) for op in ("rms_norm", "add_rms_norm", "permute_rows") for path in ("fwd", "fwd+bwd", "bwd")]
    for row in rows:
        ours, floor, peer = (float(row[i].split(" (")[0]) for i in (2, 3, 6))
        assert ours > 0 and floor > 0 and peer > 0, row
    assert "cProfile, xkern rms_norm fwd" in out and "rms_norm.py" in out
    steps = [line for line in out.split("taken apart")[1].split("cProfile")[0].splitlines() if "  " in line]
    assert len(steps) == 10 and all(float(line.split()[0]) > 0 for line in steps), steps


def test_stubbed_calls_launch_nothing_and_allocate_every_output():
    """Inside the stub the eager calls go through xkern's launcher (every kernel of the recipes named, in
    order) but run none: outputs come back allocated in their shapes and dtypes. The floor allocates the
    same outputs. After the block the real launcher is back."""
    from benchmarks.host import rms_inputs
    from torch_api._launch import _Launcher
    from xkern.rms_norm import rms_norm_bwd_recipe, rms_norm_fwd_recipe

    real = _Launcher.__call__
    x, w, dy, xg, wg = rms_inputs(DEVICE)
    m, n = x.shape
    recipes = (rms_norm_fwd_recipe(m, n, 1e-6, "bfloat16", "bfloat16", n, "llama"),
               rms_norm_bwd_recipe(m, n, 1e-6, "bfloat16", "bfloat16", n, n, variant="llama"))
    launched = []
    with hp.stubbed_launches(launched):
        y = torch_api.rms_norm(xg, wg, 1e-6)
        dx, dw = torch.autograd.grad(y, (xg, wg), dy)
        floor = hp.entries(DEVICE)[("rms_norm", "fwd+bwd")]["floor"]()
    assert _Launcher.__call__ is real
    assert launched == [s.launch.kernel.fn.__name__ for r in recipes for s in r.steps if s.launch is not None]
    assert len(launched) == 3  # the forward's kernel, the backward's joint kernel and its dw reduce
    for got, like in ((y, x), (dx, x), (dw, w), (floor[0], x), (floor[1], w)):
        assert (got.shape, got.dtype, got.device) == (like.shape, like.dtype, like.device)


def test_misaligned_inputs_on_a_cached_signature_are_read_aligned(monkeypatch):
    """A call whose tensors match a cached signature but sit at an address that is not 16-byte aligned (an
    offset view of one storage) is copied to an aligned buffer first: every kernel gets aligned pointers (a
    misaligned one would compile another binary on the GPU), and the results are the aligned call's bits,
    for rms_norm's forward and backward and add_rms_norm's forward."""
    from torch_api import _launch

    real, offsets = _launch._Launcher.__call__, set()

    def launch(self, arrays, device):
        offsets.update(a.data_ptr() % 16 for a in arrays if a.numel())
        return real(self, arrays, device)

    monkeypatch.setattr(_launch._Launcher, "__call__", launch)
    rng = np.random.default_rng(5)
    n = 64
    flat = to_torch(rand(rng, (3 * n + 1,), "bfloat16"))
    w = to_torch(rand(rng, (n,), "bfloat16"))
    dy = to_torch(rand(rng, (3, n), "bfloat16"))
    aligned = flat[:3 * n].view(3, n).clone()
    shifted = flat[1:].view(3, n)  # two bytes past a 16-byte boundary, contiguous: the same signature
    shifted.copy_(aligned)
    assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 == 2
    got = []
    for x in (aligned, shifted):  # the first call builds the executors, the second hits them
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = torch_api.rms_norm(xg, wg, 1e-6)
        got.append((y, *torch.autograd.grad(y, (xg, wg), dy), *torch_api.add_rms_norm(x, dy, w, 1e-6)))
    assert offsets == {0}
    for a, b in zip(*got, strict=True):
        assert same_bits(a, b)
