#!/usr/bin/env bash
# The test command: sets everything up on a fresh machine, then runs the suite's default tier (interpreter
# on CPU, compiled kernels on a GPU); `-m slow` runs the slow tier instead (.ci/run runs both; the GPU suite,
# scripts/gpu_suite.sh, runs everything). On CPU the tests run in two pytest-xdist processes (XDIST_N=0: one
# process), a file at a time per process: a file's tests share their subprocesses' reports.
source "$(dirname "$0")/setup.sh"
XDIST=()
if [ "${TRITON_INTERPRET:-}" = 1 ] && [ "${XDIST_N:-2}" != 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
  XDIST=(-n "${XDIST_N:-2}" --dist loadfile)
fi
"$PY" -m pytest -q -p no:cacheprovider -m "not slow" "${XDIST[@]}" "$@"
