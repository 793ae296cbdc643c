"""benchmarks/host_front_end.py, the front end's host-cost harness, on CPU with its launches stubbed: it counts
the launches of each public call, and at the host table's shape (16 x 4096) a training call of either norm is
two launches, the forward and one backward program that writes dw itself."""

from __future__ import annotations

import time

import pytest
import torch

import torch_api._launch as tl_launch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form (a GPU runs it with --cuda)")
def test_training_call_at_the_host_shape_is_two_launches(monkeypatch):
    from benchmarks import host_front_end as H

    monkeypatch.setattr(tl_launch._Launcher, "__call__", tl_launch._Launcher.__call__)  # restored after the test
    monkeypatch.setattr(H, "LOOP", 2)
    monkeypatch.setattr(H, "ROUNDS", 1)
    count = H._launches(stub=True)
    calls = H.entries("cpu")
    expected = {"rms_norm fwd+bwd": ["_rms_norm_fwd_row_kernel", "_rms_norm_bwd_kernel"],
                "add_rms_norm fwd+bwd": ["_add_rms_norm_fwd_row_kernel", "_add_rms_norm_bwd_kernel"]}
    for name, kernels in expected.items():
        count.clear()
        calls[name]()
        assert count == kernels, name
    times = H.measure({name: calls[name] for name in expected}, lambda: None, time.thread_time)
    assert all(us > 0 for us in times.values()), times
