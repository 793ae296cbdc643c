"""Test setup: no GPU means Triton's interpreter, which must be switched on before triton is imported."""

import os
import shutil
import subprocess

import pytest


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


GPU = _has_gpu()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU in one process
collect_ignore = [] if GPU else ["test_gpu_large.py", "test_gpu_graphs.py"]
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests marked `sm90_static` check the sm_90 build without a GPU (every plan variant compiled, the two
# launchers' PTX, CUDA exports): the same answer on any machine with these packages, so CPU CI runs them,
# and a GPU run, which launches the kernels themselves, skips them unless XKERN_GPU_STATIC=1. They are
# single tests of hundreds of compiles each (compile_check: 1323 variants, ~0.3 s each), the longest of
# a GPU suite spread over pytest-xdist processes.
RUN_STATIC = not GPU or os.environ.get("XKERN_GPU_STATIC") == "1"
# Tests marked `host_devices` run JAX on 4 or 8 host CPU devices under the interpreter in a child process
# (the sharded cells of the transformation matrix, the sharding checks): the same answer on any machine, so
# CPU CI runs them, and a GPU run skips them unless XKERN_GPU_HOST_DEVICES=1 (their multi-GPU twins run
# where 2 or more GPUs are). Each pytest-xdist process that draws one computes its whole child report: a
# minute or more of interpreter per process, most of a GPU suite's tail.
RUN_HOST_DEVICES = not GPU or os.environ.get("XKERN_GPU_HOST_DEVICES") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "sm90_static: a check of the sm_90 build made on the CPU (skipped on a GPU "
                                       "unless XKERN_GPU_STATIC=1)")
    config.addinivalue_line("markers", "host_devices: JAX on host CPU devices in a child process (skipped on a GPU "
                                       "unless XKERN_GPU_HOST_DEVICES=1)")


# On a GPU, tests of many compiles (or subprocesses) go first, so that pytest-xdist does not start one of
# them last, with the other processes idle (the suite's logs list its 25 slowest tests: keep this in step).
SLOW_FIRST = ("test_rms_norm_properties.py", "test_scalars.py::test_odd", "test_hf.py::test_torch_compile",
              "test_ecosystem.py", "test_gpu_graphs.py", "test_ep.py", "test_sharding.py", "test_torch_sharding.py")


def pytest_collection_modifyitems(config, items):
    if GPU:
        items.sort(key=lambda item: not any(slow in item.nodeid for slow in SLOW_FIRST))  # stable
    skips = {"sm90_static": None if RUN_STATIC else "sm_90 build checked on CPU (CI); XKERN_GPU_STATIC=1 runs it here",
             "host_devices": None if RUN_HOST_DEVICES else
             "host CPU devices under the interpreter: CPU CI runs it; XKERN_GPU_HOST_DEVICES=1 runs it here"}
    for item in items:
        for marker, reason in skips.items():
            if reason and item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter):
    """Lines a test records with `record_property("summary", line)` (coverage counts, say) go into the log,
    passed or failed, with or without pytest-xdist."""
    for key in ("passed", "failed"):
        for report in terminalreporter.stats.get(key, []):
            for name, value in getattr(report, "user_properties", ()):
                if name == "summary":
                    terminalreporter.write_line(f"{report.nodeid}: {value}")
