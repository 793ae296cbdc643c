#!/usr/bin/env bash
# The GPU validation run (an H100 or H200): the whole test suite on compiled kernels
# (pytest-xdist), then the large tests and the compute-sanitizer memcheck subset side by side (the large
# tests want GPU memory and one core, memcheck a core and little memory). Logs go to $1/<kind>/ (default
# tests/gpu_logs/<kind>/, <kind> from the GPU's name, e.g. nvidia-h100: scripts/setup.sh): gpu_suite.log
# (the suite, then the large tests, each with its slowest tests) and memcheck.log. Each step has its own
# time limit in seconds, SUITE_TIMEOUT, LARGE_TIMEOUT and MEMCHECK_TIMEOUT; at the limit pytest gets an
# interrupt, so the log still ends in its summary and durations. STEPS (default "suite,large,memcheck") runs
# some of them, e.g. the suite in one session and the rest in another (the large tests' part then appends to
# gpu_suite.log). Needs jax-triton (docs/gpu-runs.md).
source "$(dirname "$0")/setup.sh"
# setup.sh sets -e: a failing pytest would end the logged block there, skipping the rc line and the large
# tests (on 2026-12-04 two failures hid both).
set +e
LOGS=${1:-tests/gpu_logs}/$GPU_KIND
mkdir -p "$LOGS"
SUITE_TIMEOUT=${SUITE_TIMEOUT:-1200} LARGE_TIMEOUT=${LARGE_TIMEOUT:-600} MEMCHECK_TIMEOUT=${MEMCHECK_TIMEOUT:-600}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# One Triton cache for every process of the run: a kernel variant compiled by one xdist worker is loaded,
# not compiled again, by the others, the large tests and memcheck (jax_api puts the variable back after
# jax-triton 0.3.1 clears it on import; jax-triton's own compiles are cached per process only).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/xkern-triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
# Inductor compiles in each test process itself: a pool of compile workers per xdist process (one per core
# by default) would put ~14 x 16 processes on 16 cores (the H100 machines') and start each pool for a few small graphs.
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
# Kernel compiles dominate the run: spread the tests over the cores less two (XDIST_N; 14 on 16 cores) where
# pytest-xdist is installed, handed out test by test, idle processes taking queued tests from busy ones
# (`worksteal`, pytest-xdist >= 3.2; else `load`). The large tests: two processes, the tests of many GB
# in one of them (their xdist_group), the others beside.
if "$PY" -c "import xdist" 2>/dev/null; then
  read -r DIST GROUPS_OK < <("$PY" -c "import xdist.scheduler as s; print('worksteal' if hasattr(s, 'WorkStealingScheduling') else 'load', int(hasattr(s, 'LoadGroupScheduling')))")
  CORES=$(nproc)
  XDIST="-n ${XDIST_N:-$(( CORES > 3 ? CORES - 2 : 1 ))} --dist ${XDIST_DIST:-$DIST}"
  [ "$GROUPS_OK" = 1 ] && XDIST_LARGE="-n 2 --dist loadgroup"
fi
STEPS=${STEPS:-suite,large,memcheck}
START=$SECONDS
# XKERN_COMMIT: the commit of the tree copied here (a copied working tree may carry an older .git)
TREE=${XKERN_COMMIT:-"$(git rev-parse --short HEAD 2>/dev/null || echo unknown) ($(git status --porcelain 2>/dev/null | wc -l) paths changed)"}
[[ $STEPS == *suite* ]] && {
  echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)," \
       "commit $TREE"
  "$PY" -c "import torch, triton, jax, jax_triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'jax', jax.__version__, 'jax_triton', jax_triton.__version__, 'numpy', numpy.__version__)"
  echo "# suite: pytest ${XDIST:-(one process)}, limit $SUITE_TIMEOUT s; Triton cache $TRITON_CACHE_DIR"
  # tests/test_gpu_large.py (tensors past 2**31 elements, both frameworks) runs afterwards: beside 13 other
  # processes it left them out of GPU memory (cuBLAS handles, opcheck, jax; 2026-12-04).
  timeout -s INT -k 20 "$SUITE_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider -rf --durations=25 $XDIST tests/ \
    --ignore=tests/test_gpu_large.py 2>&1
  echo "pytest rc=$? ($((SECONDS - START)) s)"
} | tee "$LOGS/gpu_suite.log"
T1=$SECONDS
[[ $STEPS == *large* ]] && (
  echo "# large tests: pytest ${XDIST_LARGE:-(one process)}, memcheck beside them; limit $LARGE_TIMEOUT s"
  timeout -s INT -k 20 "$LARGE_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider -rf --durations=25 $XDIST_LARGE \
    tests/test_gpu_large.py 2>&1
  echo "pytest (large) rc=$? ($((SECONDS - T1)) s)"
) > "$LOGS/large.part" &
LARGE=$!
[[ $STEPS == *memcheck* ]] && {
  echo "# $(date -u +%FT%TZ) compute-sanitizer --tool memcheck, PYTORCH_NO_CUDA_MEMORY_CACHING=1, limit $MEMCHECK_TIMEOUT s"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 20 "$MEMCHECK_TIMEOUT" compute-sanitizer --tool memcheck \
    --print-limit 20 --error-exitcode 1 "$PY" tests/gpu_sanitize.py 2>&1
  echo "memcheck rc=$? ($((SECONDS - T1)) s)"
} > "$LOGS/memcheck.log"
wait
[ -f "$LOGS/large.part" ] && cat "$LOGS/large.part" >> "$LOGS/gpu_suite.log"
rm -f "$LOGS/large.part"
echo "# total $((SECONDS - START)) s" >> "$LOGS/gpu_suite.log"
tail -n 4 "$LOGS/gpu_suite.log"
[ -f "$LOGS/memcheck.log" ] && tail -n 3 "$LOGS/memcheck.log"
