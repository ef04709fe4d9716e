#!/usr/bin/env bash
# The serving table of record: our servers beside llama.cpp's in one call, on one GPU, from the repository root:
#   DFLASH=path/to/dflash LLAMA_SERVER=path/to/llama-server OUT=dir bench/peer.sh
# llama.cpp's server (tools/peer/build-llama-server.sh builds it) serves the default model's GGUF with every layer
# on the GPU, flash attention and 256 slots of 512 tokens (PEER_FLAGS adds to or overrides them). Then `dflash bench
# serve` loads it, our plain server and our server as shipped (drafter and prompt lookup on), greedy completions of
# MAX_TOKENS (default 256) tokens at 1 to 256 requests; twice, so every server runs twice (A B A B). Each run's
# tables land in OUT/run-<round>/.
set -euo pipefail
DFLASH=${DFLASH:?DFLASH=path/to/dflash}
LLAMA_SERVER=${LLAMA_SERVER:?LLAMA_SERVER=path/to/llama-server}
OUT=${OUT:-bench/out/peer}
MAX_TOKENS=${MAX_TOKENS:-256}
LEVELS=${LEVELS:-1,8,32,64,128,256}
GGUF=${GGUF:-$HOME/.cache/dflash/models/SmolLM2-135M-Instruct.Q4_1.gguf}
PORT=${PORT:-8089}
export DFLASH_ASSETS_DIR=${DFLASH_ASSETS_DIR:-$PWD/assets}
mkdir -p "$OUT"
# shellcheck disable=SC2086 # PEER_FLAGS is a list of flags
"$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$PORT" -ngl 99 -fa -np 256 -c $((256 * 512)) ${PEER_FLAGS:-} \
    >"$OUT/llama.cpp.server.log" 2>&1 &
peer=$!
trap 'kill $peer 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $peer 2>/dev/null || { echo "llama.cpp's server exited; see $OUT/llama.cpp.server.log" >&2; exit 1; }
    sleep 1
done
S="--device cuda --max-concurrent 256"
for round in 1 2; do
    dir="$OUT/run-$round"
    "$DFLASH" bench serve --server "llama.cpp=http://127.0.0.1:$PORT/v1" --start "plain=$S --no-drafter --no-pld" \
        --start "served=$S" --concurrency "$LEVELS" --max-tokens "$MAX_TOKENS" --out-dir "$dir" >"$dir.log" 2>&1
    echo "== run $round"; sed -n '/^| concurrent/,/^$/p' "$dir/serve-load.md" | head -9
    grep -E "^\* .*repeated request" "$dir/serve-load.md" || true
done
