#!/usr/bin/env bash
# The MoE layer benchmarks on one GPU at one size: the torch step (xkern, Liger's fused MoE, torchtitan,
# plain), the JAX step (xkern against the MaxText-style path, in its own process) and, at the Qwen3-MoE size,
# the Hugging Face training step. Each under its own time limit, logs and results in OUTDIR/<kind>/.
#   bash scripts/gpu_moe.sh OUTDIR [qwen3-moe|deepseek-v3]
# Qwen3-MoE on an H100: about 7 minutes in all; DeepSeek-V3 about 12 (one path's layer row about 2 minutes,
# Liger's first about 3: its autotuner; autotuning results are cached, TRITON_CACHE_AUTOTUNING).
# Limits against a hung step (s): TORCH_TIMEOUT 1800, JAX_TIMEOUT 900, HF_TIMEOUT 600.
# PARTS (default "torch jax hf") picks the steps; TORCH_ARGS goes to benchmarks.moe_layer (`--parts layer
# --paths liger`: those rows measured again, the results file's others kept), JAX_ARGS to
# benchmarks.jax_moe_layer (PARTS=jax reads the torch JSON beside it for the JAX / torch ratio).
set -u
OUTDIR=${1:?usage: gpu_moe.sh OUTDIR [SIZE]}
SIZE=${2:-qwen3-moe}
source "$(dirname "$0")/setup.sh"
set +e
OUT_KIND="$OUTDIR/$GPU_KIND"
mkdir -p "$OUT_KIND"
# XLA's Triton GEMM with its autotuner off took 580 us for the router GEMM that cuBLAS runs in 34: give the
# GEMMs to cuBLAS where this XLA knows the flag (an unknown flag stops the process).
FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_experimental_use_ragged_dot_fusion=true"
XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \
  "$PY" -c "import jax.numpy as jnp; jnp.ones(1).block_until_ready()" > /dev/null 2>&1 \
  && FLAGS="$FLAGS --xla_gpu_enable_triton_gemm=false"
echo "# $(date -u +%FT%TZ) $GPU_KIND, $SIZE, XLA flags: $FLAGS"

PARTS=" ${PARTS:-torch jax hf} "
if [[ $PARTS == *" torch "* ]]; then
  # shellcheck disable=SC2086 # TORCH_ARGS: words for the command line
  TRITON_CACHE_AUTOTUNING=1 timeout "${TORCH_TIMEOUT:-1800}" "$PY" -m benchmarks.moe_layer --sizes "$SIZE" \
    --out "$OUT_KIND" ${TORCH_ARGS:-} >> "$OUT_KIND/moe-layer-$SIZE.log" 2>&1
  echo "torch moe_layer rc=$?"; grep -E "^$SIZE" "$OUT_KIND/moe-layer-$SIZE.log"
fi

# The experts' GEMMs by xkern's grouped GEMM (jax_api.grouped_mm): XLA's own ragged_dot expands the weight
# gradient per expert (197 GiB for the Qwen3-MoE step).
if [[ $PARTS == *" jax "* ]]; then
  # shellcheck disable=SC2086 # JAX_ARGS: words for the command line
  timeout "${JAX_TIMEOUT:-900}" "$PY" -m benchmarks.jax_moe_layer --sizes "$SIZE" --out "$OUT_KIND" \
    --experts-gemm xkern --xla-flags "$FLAGS" ${JAX_ARGS:-} > "$OUT_KIND/jax-moe-layer-$SIZE.log" 2>&1
  echo "jax_moe_layer rc=$?"; grep -E "^$SIZE" "$OUT_KIND/jax-moe-layer-$SIZE.log"
fi

if [[ $SIZE == qwen3-moe && $PARTS == *" hf "* ]]; then
  timeout "${HF_TIMEOUT:-600}" "$PY" -m benchmarks.hf_moe_step --out "$OUT_KIND" > "$OUT_KIND/hf-moe-step.log" 2>&1
  echo "hf_moe_step rc=$?"; grep -E "^hf " "$OUT_KIND/hf-moe-step.log"
fi
