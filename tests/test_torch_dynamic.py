"""One compiled graph for every row count: torch.compile(dynamic=True), mark_dynamic and torch.export with a
dynamic dim keep the row count symbolic (the ops' fake implementations read no plan; plans are chosen per
call at run time), with the eager result bit for bit; and the eager executor cache stays bounded.

aot_eager on CPU: Dynamo, AOT autograd and the fake ops are traced, the ops run in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE

import torch_api
from torch_api import _launch

ROWS = (2, 3, 5, 7, 12, 17)  # 0 and 1 are specialized by torch itself


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.reshape(-1).view(torch.uint8))


def _counter():
    """aot_eager, with Dynamo's counters cleared: `_graphs()` then counts the graphs made (a restart of one
    frame's analysis, which turns a float attribute into a constant, is no second graph)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return "aot_eager"


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _x(rows: int, width: int = 16, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + rows)
    return torch.randn(rows, width, generator=gen).to(DEVICE, dtype)


def test_rms_norm_module_one_graph_for_every_row_count():
    """The module forward and backward, fullgraph, over six row counts: one graph, eager's bits."""
    torch.manual_seed(0)
    norm = torch_api.RMSNorm(16, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    counter = _counter()
    compiled = torch.compile(norm, backend=counter, dynamic=True, fullgraph=True)
    for rows in ROWS:
        x = _x(rows).requires_grad_()
        y = compiled(x)
        dy = torch.randn_like(y)
        dx, dw = torch.autograd.grad(y, (x, norm.weight), dy)
        x_ref = x.detach().requires_grad_()
        y_ref = norm(x_ref)
        dx_ref, dw_ref = torch.autograd.grad(y_ref, (x_ref, norm.weight), dy)
        assert _same(y, y_ref) and _same(dx, dx_ref) and _same(dw, dw_ref), rows
    assert _graphs() == 1


def test_add_rms_norm_one_graph_for_every_row_count():
    w = _x(1, seed=5)[0]
    counter = _counter()
    compiled = torch.compile(lambda x, r: torch_api.add_rms_norm(x, r, w), backend=counter, dynamic=True,
                             fullgraph=True)
    for rows in ROWS[:4]:
        x, r = _x(rows, seed=1).requires_grad_(), _x(rows, seed=2).requires_grad_()
        y, res = compiled(x, r)
        grads = torch.autograd.grad((y, res), (x, r), (torch.ones_like(y), torch.ones_like(res)))
        y_ref, res_ref = torch_api.add_rms_norm(x, r, w)
        grads_ref = torch.autograd.grad((y_ref, res_ref), (x, r), (torch.ones_like(y), torch.ones_like(res)))
        assert _same(y, y_ref) and _same(res, res_ref) and all(map(_same, grads, grads_ref)), rows
    assert _graphs() == 1


def test_mark_dynamic_keeps_rows_symbolic():
    w = _x(1, seed=5)[0]
    counter = _counter()
    compiled = torch.compile(lambda x: torch_api.rms_norm(x, w), backend=counter, fullgraph=True)
    for rows in (4, 9, 6):
        x = _x(rows)
        torch._dynamo.mark_dynamic(x, 0)
        assert _same(compiled(x), torch_api.rms_norm(x, w)), rows
    assert _graphs() == 1


def test_export_with_a_dynamic_row_dim():
    torch.manual_seed(0)
    norm = torch_api.RMSNorm(16, device=DEVICE, dtype=torch.bfloat16)
    rows = torch.export.Dim("rows", min=2)
    program = torch.export.export(norm, (_x(4),), dynamic_shapes={"x": {0: rows}})
    for n in (3, 8):
        x = _x(n)
        assert _same(program.module()(x), norm(x)), n


def test_index_ops_one_graph_for_every_slot_count():
    """permute_rows and its backward (unpermute_rows) under dynamic=True over three slot counts."""
    counter = _counter()
    compiled = torch.compile(torch_api.permute_rows, backend=counter, dynamic=True, fullgraph=True)
    for n in (4, 6, 9):
        x = _x(n).requires_grad_()
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(n)).to(DEVICE, torch.int32)
        out = compiled(x, idx)
        (dx,) = torch.autograd.grad(out, x, torch.ones_like(out))
        assert _same(out, x.detach()[idx.long()]) and _same(dx, torch.ones_like(x)), n
    assert _graphs() == 1


def test_executor_cache_is_bounded(monkeypatch):
    """Row counts beyond MAX_EXECUTORS evict the oldest executors; results stay right."""
    monkeypatch.setattr(_launch, "MAX_EXECUTORS", 4)
    w = _x(1, seed=5)[0]
    with _launch.executor_cache() as cache:
        for rows in range(2, 12):
            x = _x(rows)
            y = torch_api.rms_norm(x, w)
            assert len(cache) <= 4
        assert _same(y, torch_api.rms_norm(x, w))
        assert ("rms_norm_fwd", _launch.signature(x), _launch.signature(w), 1e-6, "llama") in cache


@pytest.mark.parametrize("fullgraph", [True, False])
def test_dynamic_graph_after_a_static_one(fullgraph):
    """Automatic dynamic shapes (the default): a static graph, then one dynamic graph for every other count."""
    w = _x(1, seed=5)[0]
    counter = _counter()
    compiled = torch.compile(lambda x: torch_api.rms_norm(x, w), backend=counter, fullgraph=fullgraph)
    for rows in ROWS:
        x = _x(rows)
        assert _same(compiled(x), torch_api.rms_norm(x, w)), rows
    assert _graphs() <= 2


_GPU_TRACE = """
import torch
from torch._dynamo.backends.common import aot_autograd

import torch_api  # noqa: F401  (registers the ops as triton_ops: no TRITON_INTERPRET in this process)

graphs = {}


def keep(key):
    def compiler(gm, _):
        graphs[key] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        raise SystemExit(0)  # traced: the CPU cannot launch the GPU kernels
    return compiler


OPS = {"rms_norm_fwd": lambda x, w: torch.ops.xkern.rms_norm_fwd(x, w, 1e-6, "llama"),
       "rms_norm_bwd": lambda x, w: torch.ops.xkern.rms_norm_bwd(x, x, w, 1e-6, "llama"),
       "add_rms_norm_fwd": lambda x, w: torch.ops.xkern.add_rms_norm_fwd(x, x, w, 1e-6, "llama", "bfloat16"),
       "add_rms_norm_bwd": lambda x, w: torch.ops.xkern.add_rms_norm_bwd(x, x, x, w, 1e-6, "llama", "bfloat16"),
       "permute_rows": lambda x, w: torch.ops.xkern.permute_rows(x, torch.arange(x.shape[0], dtype=torch.int32))}
for rows, width in ((6, 16), (1024, 4096)):
    x, w = torch.randn(rows, width, dtype=torch.bfloat16), torch.randn(width, dtype=torch.bfloat16)
    for name, f in OPS.items():
        torch._dynamo.reset()
        try:
            torch.compile(f, dynamic=True, backend=aot_autograd(fw_compiler=keep((name, rows))))(x, w)
        except SystemExit:
            pass
print(repr(graphs))
"""


def test_gpu_registration_traces_a_symbolic_row_count():
    """The GPU's registration (triton_op), traced on the CPU by AOT autograd with a symbolic row count: past
    the plan's saturation row count (`rows_recipe`: 1024 rows of 4096) each op decomposes into its kernel
    launches (Inductor launches them from its code), below it (6 rows of 16) into its opaque twin
    (`*_any`), not into launches specialized on a shape. A gather, whose plan reads sizes as ints, takes its
    twin at every row count."""
    import ast
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _GPU_TRACE], capture_output=True, text=True, env=env, cwd=root,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    graphs = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    for name in ("rms_norm_fwd", "rms_norm_bwd", "add_rms_norm_fwd", "add_rms_norm_bwd"):
        assert graphs[(name, 6)][0] == f"xkern.{name}_any.default", graphs
        assert "triton_kernel_wrapper_functional" in graphs[(name, 1024)], graphs
        assert not any(t.endswith("_any.default") for t in graphs[(name, 1024)]), graphs
    for rows in (6, 1024):
        assert "xkern.permute_rows_any.default" in graphs[("permute_rows", rows)], graphs


@pytest.mark.parametrize("width", [1, 64, 128, 576, 4096, 20000, 70000])
def test_saturated_recipes_are_the_concrete_ones(width):
    """`rows_recipe`'s symbolic recipe (forms read off two large row counts) is, at every row count from its
    threshold on, the recipe a concrete call of that row count gets: the compiled graph launches the eager
    call's plan. Row counts at, just past and far past the threshold, and powers of two."""
    from xkern.add_rms_norm import add_rms_norm_bwd_recipe, add_rms_norm_fwd_recipe
    from xkern.rms_norm import rms_norm_bwd_recipe, rms_norm_fwd_recipe

    for dt in ("bfloat16", "float32"):
        for make, args, kwargs in (
                (rms_norm_fwd_recipe, (width, 1e-6, dt, dt, width, "llama"), {}),
                (rms_norm_bwd_recipe, (width, 1e-6, dt, dt, width, width), {"variant": "gemma"}),
                (rms_norm_bwd_recipe, (width, 1e-6, dt, None, width, width), {"variant": "none"}),
                (add_rms_norm_fwd_recipe, (width, 1e-6, dt, dt, dt, "float32", width, width, "llama"), {}),
                (add_rms_norm_bwd_recipe, (width, 1e-6, dt, dt, "float32", True, width, width, width), {})):
            found = _launch._saturated(make, args, tuple(kwargs.items()))
            assert found is not None, (make.__name__, width, dt)
            forms, threshold = found
            for rows in (threshold, threshold + 1, 3 * threshold + 7, 1 << 20, (1 << 20) + 13):
                assert _launch._at(forms, rows) == make(rows, *args, **kwargs), (make.__name__, width, dt, rows)
            if threshold > 1:  # the smallest power of two: the one below gets another plan
                assert _launch._at(forms, threshold // 2) != make(threshold // 2, *args, **kwargs)


@pytest.mark.skipif(DEVICE == "cpu", reason="Inductor launching the kernels: a GPU")
@pytest.mark.parametrize("fused", [False, True])
def test_inductor_dynamic_rows_launch_the_eager_plan(fused):
    """On the GPU, Inductor with dynamic=True: row counts past the plans' saturation (512 at width 4096) share
    one graph whose kernels Inductor launches, those below it a second (the twin); y, dx and dw (and the fused
    add's residual_out and d(residual)) bit for bit the eager calls'."""
    width = 4096
    norm = torch_api.RMSNorm(width, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=torch.Generator().manual_seed(1)).to(DEVICE))

    def step(module, x, r, dy):
        x, r = x.detach().requires_grad_(), r.detach().requires_grad_()
        out = module(x, r) if fused else module(x)
        out = torch.cat([o.float() for o in out], -1) if fused else out.float()
        grads = torch.autograd.grad(out, (x, r, module.weight) if fused else (x, module.weight), dy)
        return (out, *grads)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(norm, dynamic=True)
    for rows in (512, 600, 1024, 3000, 2, 5):
        x, r = _x(rows, width, seed=1), _x(rows, width, seed=2)
        dy = _x(rows, 2 * width if fused else width, seed=3).float()
        got, want = step(compiled, x, r, dy), step(norm, x, r, dy)
        assert all(_same(a, b) for a, b in zip(got, want)), rows
    assert _graphs() <= 2
