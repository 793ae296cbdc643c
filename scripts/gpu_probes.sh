#!/usr/bin/env bash
# The probes behind docs/benchmarks.md's open questions, in one GPU run, each under its own time limit:
# - tools.jax_torch_profile --cases quick, with Triton's ptxas first (as `import jax_api` puts it) and with
#   jaxlib's own ptxas search: what the same machine code is worth;
# - tools.moe_probe: the MoE weighted combine's tiles and its unrolled copy loop (TOP_K), and the token-major
#   dispatch and combine backward against the slot-major kernels;
# - tools.host_profile --device cuda --parts: xkern's eager Python on this host, launches stubbed and real.
# Usage, on a machine with an NVIDIA GPU and the wheels in .whl/ (docs/gpu-runs.md):
#   bash scripts/gpu_probes.sh OUTDIR [SIZE]      (SIZE of the MoE probe: qwen3-moe (default), deepseek-v3)
# Everything goes to OUTDIR/<kind>/probes/; about 8 minutes on an H100 (PROFILE_TIMEOUT 120 each,
# MOE_TIMEOUT 300, HOST_TIMEOUT 90 each).
set -u
OUTDIR=${1:?usage: gpu_probes.sh OUTDIR [SIZE]}
SIZE=${2:-qwen3-moe}
source "$(dirname "$0")/setup.sh"
set +e
OUT="$OUTDIR/$GPU_KIND/probes"
mkdir -p "$OUT/jaxlib-ptxas" "$OUT/triton-ptxas"
run() {  # run NAME LIMIT COMMAND...: the command's output in OUT/NAME.log, its last lines printed
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "## $name rc=$?"; tail -n 12 "$OUT/$name.log"
}
run jax-torch-triton-ptxas "${PROFILE_TIMEOUT:-120}" "$PY" -m tools.jax_torch_profile --cases quick --out "$OUT/triton-ptxas"
run jax-torch-jaxlib-ptxas "${PROFILE_TIMEOUT:-120}" "$PY" -m tools.jax_torch_profile --cases quick --jaxlib-ptxas \
  --out "$OUT/jaxlib-ptxas"
run moe-probe "${MOE_TIMEOUT:-300}" "$PY" -m tools.moe_probe --sizes "$SIZE" --kernels "weighted combine,token-major" \
  --out "$OUT"
run host-profile-stubbed "${HOST_TIMEOUT:-90}" "$PY" -m tools.host_profile --device cuda --parts
run host-profile-real "${HOST_TIMEOUT:-90}" "$PY" -m tools.host_profile --device cuda --real --parts
