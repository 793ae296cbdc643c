#!/usr/bin/env bash
# Everything a GPU session should run after kernel or plan changes, in one device call (H200, < 10 min):
# the test suite, the memcheck subset, then the benchmark report, each step under its own time limit so
# one slow step cannot take the others' logs with it. Outputs go to $1 (e.g. $OUT); copy gpu_suite.log
# and memcheck.log to tests/gpu_logs/ and the JSON/PNG/log to benchmarks/results/.
# Device call: carry [".whl"], command `bash scripts/gpu_all.sh $OUT`.
set -u
OUTDIR=${1:?usage: gpu_all.sh OUTDIR}
SUITE_S=${SUITE_S:-330} BENCH_S=${BENCH_S:-180}
SUITE_TIMEOUT=$SUITE_S bash "$(dirname "$0")/gpu_suite.sh" "$OUTDIR" > "$OUTDIR/suite_stdout.txt" 2>&1
tail -4 "$OUTDIR/gpu_suite.log"; tail -2 "$OUTDIR/memcheck.log"
source "$(dirname "$0")/setup.sh"
set +e
timeout $((BENCH_S + 60)) "$PY" -m benchmarks.main --out "$OUTDIR" --budget-s "$BENCH_S" > "$OUTDIR/bench.log" 2>&1
echo "benchmark rc=$?"; grep -v "^  " "$OUTDIR/bench.log" | tail -c 5000
