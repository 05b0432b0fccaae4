#!/usr/bin/env bash
# What each op class costs inside a captured decode step, by difference: tailserve-bench runs the
# step with the op left out of every graph (--timing_skip, tokens meaningless), and the drop of the
# step's median is the op's cost, its node boundaries included. Unlike --profile, which times ops
# one by one between events (and so adds each op's launch latency), this is what a graph step
# pays (bench/results/2026-12-01g-h200.md, call 8). Batches above the GEMV's 16 rows: the smaller
# ones fuse these ops into the GEMVs (the norms, RoPE, SwiGLU) and name them otherwise. Above 16
# rows RoPE and the K/V write run inside decode attention, so there is no rope_kv node to leave out.
#   BIN=.bundle/bin/tailserve-bench SHAPES=8b,1b BATCHES=32,64 OUT=$OUT bash bench/decode/in_graph_costs.sh
# OPS lists the classes, space-separated; a comma joins ops left out together.
set -uo pipefail
BIN=${BIN:-.bundle/bin/tailserve-bench}
SHAPES=${SHAPES:-8b,1b}
BATCHES=${BATCHES:-32,64}
OUT=${OUT:-$PWD/gpu-out}
NEW_TOKENS=${NEW_TOKENS:-64}
OPS=${OPS:-"gate_up_gemm down_gemm qkv_gemm o_gemm attention attn_norm,mlp_norm silu_mul attn_norm,mlp_norm,silu_mul"}
mkdir -p "$OUT"

# Log names use '+' for ',' (the device tool does not return names with commas).
log_for() { echo "$OUT/in-graph-${1//,/+}.log"; }
if [ -z "${TABLE_ONLY:-}" ]; then
  for op in none $OPS; do
    args=()
    [ "$op" = none ] || args=(--timing_skip="$op")
    timeout 300 "$BIN" --shapes "$SHAPES" --batches "$BATCHES" --modes host \
      --new_tokens "$NEW_TOKENS" "${args[@]}" > "$(log_for "$op")" 2>&1 ||
      echo "in_graph_costs: $op failed (rc $?), see $(log_for "$op")"
  done
fi

# shape batch step_ms, from a tailserve-bench table.
steps() { awk '$1 ~ /^(1b|8b)$/ && $2 == "host" {print $1, $3, $5}' "$1" 2>/dev/null; }
# One row per op class: the step's change in ms when it is left out (negative: what it costs).
printf '%-40s' "left out"
steps "$(log_for none)" | while read -r shape batch ms; do printf ' %12s' "$shape bs$batch"; done
echo
printf '%-40s' "nothing (the step, ms)"
steps "$(log_for none)" | while read -r shape batch ms; do printf ' %12.3f' "$ms"; done
echo
for op in $OPS; do
  printf '%-40s' "$op"
  steps "$(log_for none)" | while read -r shape batch ms; do
    other=$(steps "$(log_for "$op")" | awk -v s="$shape" -v b="$batch" '$1 == s && $2 == b {print $3}')
    if [ -z "$other" ]; then printf ' %12s' "-"; else
      printf ' %12.3f' "$(awk -v a="$ms" -v b="$other" 'BEGIN {print b - a}')"; fi
  done
  echo
done
