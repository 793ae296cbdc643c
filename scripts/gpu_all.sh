#!/usr/bin/env bash
# The GPU validation after kernel or plan changes: the test suite, the large tests and the memcheck subset
# (scripts/gpu_suite.sh), and (BENCH_S > 0) the benchmark report, each step under its own time limit so one
# slow step cannot take the others' logs with it. Prints the summary lines of the logs.
# Usage, on a machine with an NVIDIA GPU (docs/gpu-runs.md): `bash scripts/gpu_all.sh OUTDIR`. Logs go to OUTDIR/<kind>/ (nvidia-h100, nvidia-h200: from the GPU's name), gpu_suite.log and
# memcheck.log: copy that folder over tests/gpu_logs/<kind>/, and the benchmark's JSON/PNG/log to
# benchmarks/results/<kind>/.
# Each step stops at its own limit against a hang (scripts/gpu_suite.sh). The benchmark usually runs on its own
# (BENCH_S=0).
set -u
OUTDIR=${1:?usage: gpu_all.sh OUTDIR}
BENCH_S=${BENCH_S:-0}
bash "$(dirname "$0")/gpu_suite.sh" "$OUTDIR" > /dev/null 2>&1
source "$(dirname "$0")/setup.sh"
set +e
grep -hE "^# (20|total)|passed|failed|rc=|ERROR SUMMARY|sanitize subset" "$OUTDIR/$GPU_KIND/gpu_suite.log" \
  "$OUTDIR/$GPU_KIND/memcheck.log" | grep -v "^tests/.*: [0-9]"
[ "$BENCH_S" -gt 0 ] || exit 0
timeout $((BENCH_S + 60)) "$PY" -m benchmarks.main --out "$OUTDIR" --budget-s "$BENCH_S" > "$OUTDIR/bench.log" 2>&1
echo "benchmark rc=$?"; grep -v "^  " "$OUTDIR/bench.log" | tail -c 5000
