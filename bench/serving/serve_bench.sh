#!/usr/bin/env bash
# End-to-end serving latency through the gRPC server, device loop against host-driven: for each
# --decode_loop mode, starts `tailserve --backend cuda` on one checkpoint, runs `tailserve-load`
# open-loop (Poisson) at each rate, and prints TTFT and ITL p50/p99 per (mode, rate). Runs on the
# GPU machine from a bundle (scripts/gpu-bundle.sh puts tailserve and tailserve-load in it).
#
#   MODEL=/tmp/llama8b MODES="host loop" RATES="4 16 48" REQUESTS=200 \
#     bash bench/serving/serve_bench.sh
#
# SERVER_ARGS adds tailserve flags (with TAG to tell the runs apart), for example
# SERVER_ARGS="--prefill_step_tokens 192" TAG=-s192.
#
# MODEL: a Hugging Face Llama directory; when missing, tests/gpu/make_llama_reference.py writes a
# random-weight one in the SHAPE given (default 8b). Prompts are random ids, uniform 64-512 tokens,
# 128 output tokens (EOS ignored), greedy; --max_batch 64. Full reports under $OUT/serve-*. The last
# columns are p99s of the server's own Timing: its TTFT, and the queue (a slot and KV blocks), wait
# (behind other prompts) and prefill parts of it; results.jsonl has them per request, and
# $OUT/serve-<mode>-<rate>.ttft-tail.txt splits the slowest first tokens
# (bench/serving/ttft_tail.py), .itl-tail.txt the slowest token intervals
# (bench/serving/itl_tail.py); $OUT/serve-all-tails.txt holds every run's two reports in one file,
# whose name sorts before the others, for a remote runner that returns only the first few files.
# The last two columns are the server's counters over each rate's run (tailserve-load's
# server_counters): the share of mixed steps (decode and prefill in one step) and the loop's
# launches. The device loop's server prints, as it exits, its step counts and how its attention
# regime changed (on the device, or by an exit that leaves the GPU idle for the update); the
# script echoes that line and keeps it in $OUT/serve-exits.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/serve-out}
MODEL=${MODEL:-/tmp/llama8b}
SHAPE=${SHAPE:-8b}
MODES=${MODES:-"host loop"}
RATES=${RATES:-"4 16 48"}
REQUESTS=${REQUESTS:-200}
PORT=${PORT:-50077}
TAG=${TAG:-}  # appended to the mode in file names and rows
SERVER_ARGS=${SERVER_ARGS:-}  # more tailserve flags, e.g. "--prefill_step_tokens 192"
BIN=${BIN:-.bundle/bin}
mkdir -p "$OUT"
[ -d .bundle/lib ] && export LD_LIBRARY_PATH=$PWD/.bundle/lib:${LD_LIBRARY_PATH:-}
if [ ! -f "$MODEL/config.json" ]; then
  t0=$(date +%s)
  python3 tests/gpu/make_llama_reference.py --shape "$SHAPE" --out "$MODEL" \
    > "$OUT/make-model.log" 2>&1 || { echo "cannot write $MODEL"; tail -5 "$OUT/make-model.log"; exit 1; }
  echo "model $MODEL written in $(( $(date +%s) - t0 )) s"
fi

rows=()
for mode in $MODES; do
  log="$OUT/serve-$mode$TAG.log"
  "$BIN/tailserve" --backend cuda --model_dir "$MODEL" --max_batch 64 --decode_loop "$mode" \
    --port "$PORT" --stats_interval_s 0 $SERVER_ARGS > "$log" 2>&1 &
  pid=$!
  t0=$(date +%s.%N)
  for _ in $(seq 600); do
    grep -q "tailserve listening" "$log" && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.5
  done
  if ! grep -q "tailserve listening" "$log"; then
    echo "$mode: the server did not start"; tail -20 "$log"; kill $pid 2>/dev/null; continue
  fi
  echo "$mode$TAG: listening after $(awk "BEGIN{print $(date +%s.%N) - $t0}") s"
  for rate in $RATES; do
    dir="$OUT/serve-$mode$TAG-$rate"
    "$BIN/tailserve-load" --target "localhost:$PORT" --rate "$rate" --num_requests "$REQUESTS" \
      --warmup_requests 16 --input_dist uniform:64:512 --output_len 128 --seed 1 \
      --out_dir "$dir" > "$dir.log" 2>&1 || echo "$mode $rate: tailserve-load rc=$?"
    python3 bench/serving/ttft_tail.py "$dir/results.jsonl" > "$dir.ttft-tail.txt" 2>&1
    python3 bench/serving/itl_tail.py "$dir/results.jsonl" > "$dir.itl-tail.txt" 2>&1
    for t in ttft itl; do
      { echo "==== $mode$TAG $rate req/s: $t tail"; cat "$dir.$t-tail.txt"; } >> "$OUT/serve-all-tails.txt"
    done
    rows+=("$(python3 - "$dir/summary.json" "$mode$TAG" "$rate" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
m = s["metrics"]
t, i = m["ttft_ms"], m["itl_ms"]
# The server's counters over this rate's run: the share of its steps that were mixed, and how
# often the loop was launched (each launch after an exit: the host stood between two steps).
c = s["run"].get("server_counters") or {}
mixed = f"{100 * c['mixed_steps'] / c['steps']:6.1f}" if c.get("steps") else f"{'-':>6}"
launches = f"{c['loop_launches']:8d}" if c.get("loop_launches") is not None else f"{'-':>8}"
# The server's share of the TTFT tail (its Timing): waiting for a slot, and prefill to first token.
srv = [m.get(k, {}).get("p99")
       for k in ("server_ttft_ms", "server_queue_ms", "server_prefill_wait_ms", "server_prefill_ms")]
srv = " ".join(f"{v:9.1f}" if v is not None else f"{'-':>9}" for v in srv)
print(f"{sys.argv[2]:10} {sys.argv[3]:>5} {t['median']:9.1f} {t['p99']:9.1f} {i['median']:8.2f} "
      f"{i['p99']:8.2f} {i['p99'] / i['median']:7.2f} {m['requests_ok']:5d} {m['requests_failed']:4d} "
      f"{srv} {mixed} {launches}")
EOF
)")
  done
  kill -TERM $pid; wait $pid
  echo "$mode: server exit $?" >> "$OUT/serve-exits.txt"
  # The loop's totals over every rate of this server (see the header).
  grep "device loop:" "$log" | sed "s/^/$mode$TAG: /" | tee -a "$OUT/serve-exits.txt" || true
done
echo "mode        rate  ttft_p50  ttft_p99  itl_p50  itl_p99 p99/p50    ok fail  srv_ttft srv_queue  srv_wait srv_prefill (p99)  mixed% launches"
printf '%s\n' "${rows[@]}"
