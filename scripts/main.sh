#!/usr/bin/env bash
# The main job: validation against the FP64 oracle plus the benchmark report on whatever device is here.
source "$(dirname "$0")/setup.sh"
"$PY" -m benchmarks.main "$@"
