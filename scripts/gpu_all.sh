#!/usr/bin/env bash
# Everything a GPU session should run after kernel or plan changes: the test suite, the memcheck subset,
# and (BENCH_S > 0) the benchmark report, each step under its own time limit so one slow step cannot take
# the others' logs with it. Outputs go to $1 (e.g. $OUT); copy gpu_suite.log and memcheck.log to
# tests/gpu_logs/ and the JSON/PNG/log to benchmarks/results/.
# Device call: carry [".whl"], command `bash scripts/gpu_all.sh $OUT`. The suite, the large tests and
# memcheck take ~470 s (2026-12-04, fea8ef5), so in one 600 s call the benchmark is off by default: run it
# in its own call (or BENCH_S=... where the suite is known to be shorter). A call brings back at most 8
# files: this writes gpu_suite.log, memcheck.log and, with the benchmark, bench.log and its 5 outputs.
set -u
OUTDIR=${1:?usage: gpu_all.sh OUTDIR}
SUITE_S=${SUITE_S:-240} BENCH_S=${BENCH_S:-0}
export LARGE_TIMEOUT=${LARGE_TIMEOUT:-200}
SUITE_TIMEOUT=$SUITE_S bash "$(dirname "$0")/gpu_suite.sh" "$OUTDIR" > /dev/null 2>&1
tail -4 "$OUTDIR/gpu_suite.log"; tail -2 "$OUTDIR/memcheck.log"
[ "$BENCH_S" -gt 0 ] || exit 0
source "$(dirname "$0")/setup.sh"
set +e
timeout $((BENCH_S + 60)) "$PY" -m benchmarks.main --out "$OUTDIR" --budget-s "$BENCH_S" > "$OUTDIR/bench.log" 2>&1
echo "benchmark rc=$?"; grep -v "^  " "$OUTDIR/bench.log" | tail -c 5000
