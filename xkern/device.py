"""The GPU the launch plans are made for: its architecture, SM count and the shared memory a block may use.

Plans read `properties()` where a number depends on the GPU (persistent grids sized by the SM count, GEMM
pipelines sized by shared memory); everything else in a plan comes from shapes and dtypes alone. On the H100
and H200 (132 SMs, sm_90) every plan is what the fixed constants gave before (`compile_check --sass`).

Read from the CUDA driver (libcuda through ctypes), not from a framework: the core imports neither torch nor
jax, and both front ends then plan alike from one source, which their bitwise parity needs. (triton's
`driver.active.utils.get_device_properties` reads the same attributes, but triton 3.6 builds its driver on
torch, which a JAX-only install lacks.) Device 0 is read, as jax-triton compiles for device 0: a process plans
for one kind of GPU (recipes are cached by shape, not by device).

Without a GPU, or under Triton's interpreter, the H100/H200's values: CPU runs then take the GPU's plans.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import sys

from xkern.launch import INTERPRET


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    """What a plan may depend on. `max_shared_mem`: bytes of shared memory one block may opt into (the CUDA
    attribute MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: the SM's capacity less 1 KiB the driver reserves)."""

    arch: int            # compute capability as 10 * major + minor: 90 for sm_90
    num_sms: int
    max_shared_mem: int


# The H100 and H200 (SXM): 132 SMs, 227 KiB a block on sm_90.
H100 = DeviceProperties(arch=90, num_sms=132, max_shared_mem=227 * 1024)

# Every architecture triton 3.6 compiles for, with its per-block shared-memory opt-in maximum (the CUDA
# programming guide's compute-capability table; NVIDIA's libcu++ `arch_traits` gives the same: the SM's
# 164/100/228 KiB less 1 KiB reserved) and a GPU of that architecture's SM count (the compile check plans
# for it, so that grids sized by the SM count are covered too).
ARCHITECTURES = {
    80: DeviceProperties(80, 108, 163 * 1024),   # A100
    86: DeviceProperties(86, 84, 99 * 1024),     # RTX 3090, A40
    89: DeviceProperties(89, 142, 99 * 1024),    # L40S
    90: H100,
    100: DeviceProperties(100, 148, 227 * 1024),  # B200
    120: DeviceProperties(120, 170, 99 * 1024),  # RTX 5090
}

_target: DeviceProperties | None = None


def properties() -> DeviceProperties:
    """The GPU plans are made for: `target`'s inside it, else this machine's device 0 (read once), else H100."""
    return _target or _device_properties()


@functools.cache
def _device_properties() -> DeviceProperties:
    if INTERPRET:
        return H100
    return _query_cuda(0) or H100


def _query_cuda(ordinal: int) -> DeviceProperties | None:
    """Device `ordinal`'s properties from libcuda, None without a driver or a device."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1" if sys.platform.startswith("linux") else "nvcuda.dll")
    except OSError:
        return None
    device, value = ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
        return None

    def attribute(code: int) -> int:
        if cuda.cuDeviceGetAttribute(ctypes.byref(value), code, device) != 0:
            raise OSError(f"cuDeviceGetAttribute({code}) failed")
        return value.value

    try:  # CUdevice_attribute codes: 75, 76 the compute capability; 16 SMs; 97 shared memory opt-in
        major, minor = attribute(75), attribute(76)
        return DeviceProperties(10 * major + minor, attribute(16), attribute(97))
    except OSError:
        return None


@contextlib.contextmanager
def target(props: DeviceProperties):
    """Plan for `props` instead of this machine's GPU: the compile check's other architectures, and tests of
    the plans. Every cached recipe of xkern is cleared on the way in and out (their plans depend on it); the
    front ends' executors are not, so launch nothing inside."""
    global _target
    saved, _target = _target, props
    _clear_recipe_caches()
    try:
        yield props
    finally:
        _target = saved
        _clear_recipe_caches()


def _clear_recipe_caches() -> None:
    for name, module in list(sys.modules.items()):
        if name == "xkern" or name.startswith("xkern."):
            for value in list(vars(module).values()):
                if value is not _device_properties and callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()
