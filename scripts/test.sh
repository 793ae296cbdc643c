#!/usr/bin/env bash
# The test command: sets everything up on a fresh machine, then runs the suite (interpreter on CPU,
# compiled kernels on a GPU) and, on CPU, the sm_90 compile check of every kernel variant.
source "$(dirname "$0")/setup.sh"
"$PY" -m pytest -q -p no:cacheprovider "$@"
