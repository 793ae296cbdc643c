#!/usr/bin/env bash
# Everything a GPU session should run after kernel or plan changes, in one device call (H200, < 10 min):
# the test suite, the memcheck subset, then the benchmark report. Outputs go to $1 (e.g. $OUT); copy
# gpu_suite.log and memcheck.log to tests/gpu_logs/ and the JSON/PNG/log to benchmarks/results/.
# Device call: carry [".whl"], command `bash scripts/gpu_all.sh $OUT`.
set -u
OUTDIR=${1:?usage: gpu_all.sh OUTDIR}
bash "$(dirname "$0")/gpu_suite.sh" "$OUTDIR" > "$OUTDIR/suite_stdout.txt" 2>&1
tail -4 "$OUTDIR/gpu_suite.log"; tail -2 "$OUTDIR/memcheck.log"
source "$(dirname "$0")/setup.sh"
"$PY" -m benchmarks.main --out "$OUTDIR" --budget-s 240 > "$OUTDIR/bench.log" 2>&1
echo "benchmark rc=$?"; tail -c 6000 "$OUTDIR/bench.log"
