"""Which ptxas assembles jax_api's kernels.

Both front ends compile the same PTX; torch's launcher assembles it with Triton's bundled ptxas, jaxlib with the
first ptxas it finds (`./bin`, then PATH, then CUDA_HOME, /usr/local/cuda and the pip CUDA packages; jaxlib 0.11).
Other assemblers make other machine code of the same PTX: CUDA 13.0's ptxas gave the 32768x128 backward 214
registers against Triton's 254 and ran it at 0.954 of torch's speed; with Triton's, 1.000 (H100, 2026-12-06).

jaxlib runs that same search for XLA's own kernels, whose PTX (ISA 9.0 from jaxlib 0.11.2) Triton's CUDA 12.8
ptxas cannot assemble. So PATH gets a `ptxas` that chooses per input: PTX of an ISA version Triton's ptxas
assembles (at most the version Triton itself emits) goes to Triton's ptxas, anything else, and `--version`, to
the ptxas jaxlib would have found.
"""

from __future__ import annotations

import atexit
import glob
import importlib.util
import os
import shutil
import tempfile

_SHIM = """#!/bin/sh
# PTX of ISA version <= {max_version} (Triton's): Triton's ptxas; any other input, and --version: jaxlib's.
# With XKERN_PTXAS_LOG set, one line per call there: which ptxas took it and the PTX's ISA version.
v=
for a in "$@"; do
  case "$a" in -*) continue ;; esac
  if [ -f "$a" ]; then
    v=$(sed -n 's/^[[:space:]]*\\.version[[:space:]]*\\([0-9][0-9]*\\)\\.\\([0-9]\\).*/\\1\\2/p' "$a" | head -n 1)
    if [ -n "$v" ]; then
      if [ "$v" -le {max_version} ]; then
        [ -n "$XKERN_PTXAS_LOG" ] && echo "triton $v" >> "$XKERN_PTXAS_LOG"
        exec '{triton}' "$@"
      fi
      break
    fi
  fi
done
[ -n "$XKERN_PTXAS_LOG" ] && echo "jaxlib $v" >> "$XKERN_PTXAS_LOG"
exec '{fallback}' "$@"
"""

_SHIM_PREFIX = "xkern-ptxas-"
_shim_dir: str | None = None


def triton_ptxas() -> tuple[str, int]:
    """Triton's bundled ptxas and the highest PTX ISA version it assembles (80 + minor for CUDA 12.minor, as
    Triton computes the version it emits)."""
    from triton.backends.nvidia import compiler

    tool = compiler.get_ptxas(90)
    if not tool.path or not os.access(tool.path, os.X_OK):
        raise FileNotFoundError("this triton build bundles no ptxas")
    return tool.path, compiler.ptx_get_version(tool.version)


def jaxlib_ptxas() -> str | None:
    """The ptxas jaxlib's search finds after `./bin` (PATH, CUDA_HOME, /usr/local/cuda, the pip CUDA packages),
    or None. PATH's own routing `ptxas` folders are passed over: one inherited from a parent process goes when
    that process exits."""
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and not os.path.basename(p).startswith(_SHIM_PREFIX))
    found = shutil.which("ptxas", path=path)
    if found:
        return found
    roots = [os.environ["CUDA_HOME"]] if os.environ.get("CUDA_HOME") else []
    for root in [*roots, "/usr/local/cuda"]:
        if os.access(os.path.join(root, "bin", "ptxas"), os.X_OK):
            return os.path.join(root, "bin", "ptxas")
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(glob.glob(os.path.join(root, "*", "bin", "ptxas"))):
            if os.access(candidate, os.X_OK):
                return candidate
    return None


def use_triton_ptxas() -> str:
    """Put a `ptxas` first on PATH that hands jax_api's kernels (Triton's PTX) to Triton's ptxas, as torch_api's
    are assembled, and any other PTX (XLA's) to the ptxas jaxlib's search finds; returns its directory.
    `import jax_api` calls it on a GPU machine unless XKERN_JAX_PTXAS=jaxlib; it takes effect for kernels
    jaxlib first assembles afterwards and changes PATH for the whole process. FileNotFoundError where Triton
    bundles no ptxas or jaxlib's search finds none (jaxlib then assembles in-process: XLA's PTX needs it)."""
    global _shim_dir
    triton, max_version = triton_ptxas()
    if _shim_dir is None:
        fallback = jaxlib_ptxas()
        if fallback is None:
            raise FileNotFoundError("no ptxas on PATH, CUDA_HOME, /usr/local/cuda or the pip CUDA packages for "
                                    "XLA's own PTX: jaxlib's search stays")
        _shim_dir = tempfile.mkdtemp(prefix=_SHIM_PREFIX)
        atexit.register(shutil.rmtree, _shim_dir, ignore_errors=True)
        shim = os.path.join(_shim_dir, "ptxas")
        with open(shim, "w") as f:
            f.write(_SHIM.format(max_version=max_version, triton=triton, fallback=fallback))
        os.chmod(shim, 0o755)
    entries = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != _shim_dir]
    os.environ["PATH"] = os.pathsep.join([_shim_dir, *entries])
    return _shim_dir
