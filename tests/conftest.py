"""Test setup: no GPU means Triton's interpreter, which must be switched on before triton is imported."""

import os
import shutil
import subprocess


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


def pytest_terminal_summary(terminalreporter):
    """Lines a test records with `record_property("summary", line)` (coverage counts, say) go into the log,
    passed or failed, with or without pytest-xdist."""
    for key in ("passed", "failed"):
        for report in terminalreporter.stats.get(key, []):
            for name, value in getattr(report, "user_properties", ()):
                if name == "summary":
                    terminalreporter.write_line(f"{report.nodeid}: {value}")
