#!/usr/bin/env bash
# The main job, end to end: install dependencies, build, start the tailserve server on the shipped
# default model (CPU backend), generate a continuation through the gRPC client, print it, then shut
# the server down with SIGTERM (it drains and exits 0).
#   MODEL_DIR (default tests/fixtures/tiny-gqa-untied), PROMPT (token ids), MAX_NEW_TOKENS
# The default model has RANDOM weights: its tokens are meaningless until a trained model ships.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build}
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo} >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target tailserve tailserve-client tailserve-generate

MODEL_DIR=${MODEL_DIR:-tests/fixtures/tiny-gqa-untied}
PROMPT=${PROMPT:-1,15,27,100,7}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-32}
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
echo "demo: server up at $addr (model $MODEL_DIR, random weights: tokens are meaningless)"
"$BUILD_DIR"/bench/client/tailserve-client --target "$addr" --prompt "$PROMPT" \
  --max_new_tokens "$MAX_NEW_TOKENS" --ignore_eos
kill -TERM $server
wait $server
echo "demo: server drained and exited with status $?"
