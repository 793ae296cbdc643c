"""The one benchmark runner. Each op module declares an `Op`: its cases (shapes and dtypes per mode), input
maker, minimum bytes, oracle check and implementations; `run_case` does the rest, the same for every op:

1. make the inputs (a few rotated sets when they would fit in L2) and the op's reference;
2. run every implementation once (forward, then the gradients of its differentiable inputs) and check the
   result against the reference: xkern must pass to be timed, and its JAX front end must equal its torch
   front end bit for bit (or pass the check on its own); peers' checks are reported only;
3. time each pass of each implementation (`timing`): torch in CUDA graphs (`us`); xkern (torch) also, and
   every JAX implementation only, by the profiler's device time of one call per input set
   (`timing.profile_device_us`, `profile_us`; JAX: one jitted call per set, so XLA cannot carry work from
   one call into the next). The JAX / torch ratio compares the two `profile_us`.

Passes: `fwd` is the forward; `bwd` is `torch.autograd.grad` (JAX: the vjp) on a forward made beforehand;
`fwd+bwd` is both (a training step; in JAX its cotangent waits for this step's y, as the layers after the op
make it wait in a model: `jax_calls`). Implementations take `(*args, *consts)`: `args` are differentiable
(x, weight), `consts` are not (indices), and each framework gets its own consts.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
from typing import Any, Callable

import numpy as np

from benchmarks import timing
from benchmarks.timing import error_status
from xkern.testing import to_numpy, to_torch


@dataclasses.dataclass
class Case:
    op: str
    shape: tuple[int, ...]
    dtype: str
    passes: tuple[str, ...]
    info: dict = dataclasses.field(default_factory=dict)  # fields copied into every result row

    @property
    def label(self) -> str:
        return f"{self.op} {'x'.join(map(str, self.shape))} {self.dtype}"


@dataclasses.dataclass
class Inputs:
    """One case's inputs on the torch device: `sets` of (args, cotangent); `consts` shared by the sets."""

    sets: list[tuple[list, Any]]
    consts: tuple = ()
    jax_consts: Callable[[], tuple] = tuple  # made only when the JAX implementations run
    ref: Any = None                          # the op's reference for `check`, from the first set


@dataclasses.dataclass
class Op:
    """What an op declares to the runner.

    - `cases(mode)`: the cases of a mode ("main", "validate", "smoke", "sweep").
    - `make(case, device, n_sets)`: `Inputs` with its reference.
    - `check(case, ref, got)`: (stats, failure or None); `got` maps "y" and one name per differentiable
      input (`grad_names`) to torch tensors.
    - `min_bytes(case, pass_)`: each input read once, each output written once.
    - `torch_impls(case)` / `jax_impls(case)`: name -> fn(*args, *consts), or a "skipped: why" string.
    """

    name: str
    cases: Callable[[str], list[Case]]
    make: Callable[[Case, str, int], Inputs]
    check: Callable[[Case, Any, dict], tuple[dict, str | None]]
    min_bytes: Callable[[Case, str], int]
    torch_impls: Callable[[Case], dict]
    jax_impls: Callable[[Case], dict]
    grad_names: tuple[str, ...]


def pass_keys(op: Op, pass_: str) -> tuple[str, ...]:
    """The checked outputs a pass produces (its row's ULP statistics)."""
    return {"fwd": ("y",), "bwd": op.grad_names, "fwd+bwd": ("y", *op.grad_names)}[pass_]


# ---------------------------------------------------------------------------------------------------
# Running each implementation once, for the check


def torch_outputs(op: Op, fn, args, cot, consts) -> dict:
    import torch

    leaves = [a.detach().requires_grad_() for a in args]
    y = fn(*leaves, *consts)
    grads = torch.autograd.grad(y, leaves, cot.clone())  # a clone: Liger writes dx into it
    return {"y": y.detach(), **dict(zip(op.grad_names, grads, strict=True))}


def jax_outputs(op: Op, fn, args, cot, consts) -> dict:
    import jax

    y, vjp = jax.vjp(lambda *a: fn(*a, *consts), *args)
    return {"y": y, **dict(zip(op.grad_names, vjp(cot), strict=True))}


def as_torch(a, device: str):
    """A JAX array as a torch tensor on `device` (DLPack, else a host copy)."""
    import torch

    try:
        return torch.from_dlpack(a).to(device)
    except Exception:  # noqa: BLE001 - DLPack between the two is best effort
        return to_torch(to_numpy(a), device)


def same_bits_torch(a, b) -> bool:
    """Two torch tensors, bit for bit, compared where they are."""
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def to_jax(t):
    """A torch tensor as a JAX array (DLPack, else a host copy)."""
    import jax

    try:
        return jax.dlpack.from_dlpack(t.contiguous())
    except Exception:  # noqa: BLE001
        return jax.device_put(to_numpy(t))


# ---------------------------------------------------------------------------------------------------
# Timed passes


def _train_step(fn, leaves, consts, cot):
    import torch

    return torch.autograd.grad(fn(*leaves, *consts), leaves, cot)


def torch_make_calls(fn, pass_: str, inputs: Inputs):
    """For `timing.torch_device_us`: one call per input set (made on the capture stream, so that autograd
    replays a forward made there on that stream). Each call gets its own cotangent (Liger writes dx into
    it)."""
    import torch

    def make():
        calls = []
        for args, cot in inputs.sets:
            if pass_ == "fwd":
                calls.append(functools.partial(fn, *args, *inputs.consts))
                continue
            leaves = [a.detach().requires_grad_() for a in args]
            if pass_ == "bwd":
                y = fn(*leaves, *inputs.consts)
                calls.append(functools.partial(torch.autograd.grad, y, leaves, cot.clone(), retain_graph=True))
            else:
                calls.append(functools.partial(_train_step, fn, leaves, inputs.consts, cot.clone()))
        return calls
    return make


def jax_calls(fn, pass_: str, sets, consts) -> list:
    """For `timing.profile_device_us`: one call per input set, each a jitted program of its own (XLA cannot
    fuse one call's outputs into the next call's inputs), returning every output (nothing can be elided).
    Backward: the vjp of a forward made beforehand. Forward + backward: the cotangent waits for this call's
    y (an optimization barrier over both), as in a model, where it comes from the layers after this one:
    given from the start, XLA may fuse the forward and backward into one pass over x, which no model step
    allows and torch's autograd never does."""
    import jax

    if pass_ == "fwd":
        f = jax.jit(lambda args, c: fn(*args, *c))
        return [functools.partial(f, args, consts) for args, _ in sets]
    if pass_ == "bwd":
        g = jax.jit(lambda vjp, cot: vjp(cot))
        return [functools.partial(g, jax.vjp(lambda *a: fn(*a, *consts), *args)[1], cot) for args, cot in sets]

    def step(args, cot, c):
        y, vjp = jax.vjp(lambda *a: fn(*a, *c), *args)
        y, cot = jax.lax.optimization_barrier((y, cot))
        return y, vjp(cot)
    f = jax.jit(step)
    return [functools.partial(f, args, cot, consts) for args, cot in sets]


def profile_fields(calls, sync) -> dict:
    """A row's profiler fields: `profile_us` (device µs per call), `profile_timing`, `kernels` per call."""
    us, method, kernels = timing.profile_device_us(calls, sync)
    return {"profile_us": us, "profile_timing": method, "kernels": kernels}


# ---------------------------------------------------------------------------------------------------
# One case


def _row(op: Op, case: Case, pass_: str, impl: str, ceiling: float, **fields) -> dict:
    nbytes = op.min_bytes(case, pass_)
    row = {"op": case.op, "pass": pass_, "impl": impl, "shape": list(case.shape), "dtype": case.dtype,
           "bytes": nbytes, "us": None, "gbps": None, "frac": None, "status": "ok", **case.info}
    row.update(fields)
    if row["us"]:
        row["gbps"] = nbytes / row["us"] / 1e3
        row["frac"] = row["gbps"] / ceiling
    return invalid_if_above_ceiling(row)


MAX_FRAC = 1.05  # above the copy ceiling over the minimum bytes: the timing measured less than the op


def invalid_if_above_ceiling(row: dict) -> dict:
    """A row faster than the copy ceiling allows is a timing artifact (work optimized away), not a result:
    kept in the JSON with its figure, shown as not measured."""
    if row["frac"] is not None and not timing.smoke() and row["frac"] > MAX_FRAC:
        row.update(status=f"invalid: {row['frac']:.2f} of the copy ceiling (timed less than the op)",
                   us_invalid=row["us"], us=None, gbps=None, frac=None)
    return row


def _ulp(stats: dict, keys) -> dict:
    return {k: stats[k] for k in keys if k in stats}


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_case(op: Op, case: Case, device: str, ceiling: float, log, timed: bool = True) -> list[dict]:
    """Every implementation of `case`, checked then timed (`timed=False`: checked only): a result row per
    implementation and pass."""
    import torch

    inputs = op.make(case, device, timing.n_sets(op.min_bytes(case, "fwd")))
    args0, cot0 = inputs.sets[0]
    rows: list[dict] = []
    info = {"input_sets": len(inputs.sets)}

    def check(got_torch):
        try:
            return op.check(case, inputs.ref, got_torch)
        except Exception as err:  # noqa: BLE001 - a check that cannot run is a failure
            return {}, error_status(err)

    # xkern's torch front end first: the results the JAX front end must equal bit for bit
    torch_impls, jax_impls = op.torch_impls(case), op.jax_impls(case)
    xk_torch = None
    if callable(torch_impls.get("xkern (torch)")):
        xk_torch = torch_outputs(op, torch_impls["xkern (torch)"], args0, cot0, inputs.consts)

    def run_impls(impls, framework):
        nonlocal rows
        jsets = jconsts = None
        if framework == "jax":
            jsets = [([to_jax(a) for a in args], to_jax(cot)) for args, cot in inputs.sets]
            jconsts = inputs.jax_consts()
        torch._dynamo.reset()
        graphs_before = _compiled_graphs()
        for name, fn in impls.items():
            if isinstance(fn, str):
                rows += [_row(op, case, p, name, ceiling, status=fn) for p in case.passes]
                continue
            xkern = name.startswith("xkern")
            fields = dict(info)
            start = time.perf_counter()  # each row's cost to the run (check_s, time_s): what a sweep spends where
            try:
                if framework == "torch":
                    got = xk_torch if name == "xkern (torch)" else torch_outputs(op, fn, args0, cot0, inputs.consts)
                else:
                    got = {key: as_torch(v, device) for key, v in
                           jax_outputs(op, fn, jsets[0][0], jsets[0][1], jconsts).items()}
                bitwise = None
                if name == "xkern (jax)" and xk_torch is not None:
                    bitwise = all(same_bits_torch(got[key], xk_torch[key]) for key in got)
                    fields["bitwise_equal_torch"] = bitwise
                stats, fail = check(got)
                del got
                fields["check_s"] = round(time.perf_counter() - start, 2)
            except Exception as err:  # noqa: BLE001
                rows += [_row(op, case, p, name, ceiling, status=error_status(err)) for p in case.passes]
                continue
            if xkern:
                log(f"{case.label}: {name} check {'FAIL ' + fail if fail else 'pass'}"
                    + ("" if bitwise is None else f", bitwise = torch: {bitwise}"))
            for pass_ in case.passes:
                f = dict(fields, ulp=_ulp(stats, pass_keys(op, pass_)))
                f["check"] = f"fail: {fail}" if fail else "pass"
                if not xkern:
                    f["check"] = "reported only: " + f["check"]
                if (xkern and fail) or not timed:
                    status = "wrong answer: not timed" if xkern and fail else "ok"
                    rows.append(_row(op, case, pass_, name, ceiling, status=status, **f))
                    continue
                start = time.perf_counter()
                try:
                    if framework == "torch":
                        f["us"], f["timing"] = timing.torch_device_us(torch_make_calls(fn, pass_, inputs))
                        if name == "torch.compile":
                            f["compiled_graphs"] = _compiled_graphs() - graphs_before
                            if f["compiled_graphs"] < 1:
                                raise RuntimeError("torch.compile compiled no graph: would be eager, not reported")
                        if xkern:  # the same method as the JAX rows, for the JAX / torch ratio
                            f.update(profile_fields(torch_make_calls(fn, pass_, inputs)(), timing.torch_sync))
                    else:
                        f.update(profile_fields(jax_calls(fn, pass_, jsets, jconsts), timing.jax_sync))
                        f.update(us=f["profile_us"], timing=f["profile_timing"])
                except Exception as err:  # noqa: BLE001
                    f.update(us=None, status=error_status(err))
                f["time_s"] = round(time.perf_counter() - start, 2)
                rows.append(_row(op, case, pass_, name, ceiling, **f))
            if device == "cuda":  # graphs left in reference cycles keep their private pools until collected
                gc.collect()
                torch.cuda.empty_cache()
        del jsets

    run_impls(torch_impls, "torch")
    run_impls(jax_impls, "jax")
    return rows


def sample_rows(m: int, elems: int, n: int) -> np.ndarray:
    """Evenly spaced row indices adding up to about `elems` elements of width `n` (all rows if fewer)."""
    return np.unique(np.linspace(0, m - 1, min(m, max(1, elems // n))).round().astype(np.int64))
