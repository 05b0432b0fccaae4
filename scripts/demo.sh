#!/usr/bin/env bash
# The main job, end to end: install dependencies, build, start the tailserve server on the shipped
# default model (models/default, a small Llama trained on the King James Bible; CPU backend), send
# a text prompt through the gRPC client, print the streamed continuation, then shut the server
# down with SIGTERM (it drains and exits 0).
#   MODEL_DIR (default models/default), PROMPT (text), MAX_NEW_TOKENS, TEMPERATURE, SEED
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build}
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo} >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target tailserve tailserve-client tailserve-load tailserve-generate

MODEL_DIR=${MODEL_DIR:-models/default}
PROMPT=${PROMPT:-And God said,}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-48}
TEMPERATURE=${TEMPERATURE:-0.7}
SEED=${SEED:-1}
log=$(mktemp)
"$BUILD_DIR"/server/tailserve --model_dir "$MODEL_DIR" --backend cpu --port 0 >"$log" 2>&1 &
server=$!
trap 'kill -9 $server 2>/dev/null || true; rm -f "$log"' EXIT
addr=""
for _ in $(seq 1 300); do
  addr=$(sed -n 's/.*tailserve listening on \([^ ]*\).*/\1/p' "$log" | head -1)
  [ -n "$addr" ] && break
  kill -0 $server 2>/dev/null || { cat "$log"; echo "demo: server exited early" >&2; exit 1; }
  sleep 0.1
done
[ -n "$addr" ] || { cat "$log"; echo "demo: server did not start" >&2; exit 1; }
echo "demo: server up at $addr (model $MODEL_DIR)"
echo "demo: prompt: $PROMPT"
"$BUILD_DIR"/bench/client/tailserve-client --target "$addr" --prompt_text "$PROMPT" \
  --max_new_tokens "$MAX_NEW_TOKENS" --temperature "$TEMPERATURE" --seed "$SEED"
kill -TERM $server
wait $server
echo "demo: server drained and exited with status $?"
