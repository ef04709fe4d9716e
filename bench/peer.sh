#!/usr/bin/env bash
# The serving table of record: our servers beside llama.cpp's in one call, on one GPU, from the repository root:
#   DFLASH=path/to/dflash LLAMA_SERVER=path/to/llama-server OUT=dir bench/peer.sh
# Greedy chat completions of MAX_TOKENS (default 256) tokens at each of LEVELS concurrent requests, twice (A B A B).
# llama.cpp's server (tools/peer/build-llama-server.sh builds it) serves the default model's GGUF with every layer on
# the GPU and flash attention, started afresh for each level with as many slots as requests, 512 tokens each
# (PEER_FLAGS adds flags): one server of 256 slots for every level ran slower as the run went on (its attention spans
# every cell of the cache used so far; docs/PERFORMANCE.md entry 116). Our plain server and our server as shipped
# (drafter and prompt lookup on) are started once by `dflash bench serve` for all levels. Tables land in
# OUT/<round>/llama.cpp-<level>/ and OUT/<round>/dflash/.
set -euo pipefail
DFLASH=${DFLASH:?DFLASH=path/to/dflash}
LLAMA_SERVER=${LLAMA_SERVER:?LLAMA_SERVER=path/to/llama-server}
OUT=${OUT:-bench/out/peer}
MAX_TOKENS=${MAX_TOKENS:-256}
LEVELS=${LEVELS:-1,8,32,64,128,256}
GGUF=${GGUF:-$HOME/.cache/dflash/models/SmolLM2-135M-Instruct.Q4_1.gguf}
PORT=${PORT:-8089}
DEVICE=${DEVICE:-cuda} # our servers' --device (cpu runs the script end to end without a GPU)
export DFLASH_ASSETS_DIR=${DFLASH_ASSETS_DIR:-$PWD/assets}

peer_level() { # peer_level ROUND LEVEL: a llama.cpp server with LEVEL slots, loaded at LEVEL requests
    local dir="$OUT/$1/llama.cpp-$2" peer
    mkdir -p "$dir"
    # shellcheck disable=SC2086 # PEER_FLAGS is a list of flags
    "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$PORT" -ngl 99 -fa -np "$2" -c $(($2 * 512)) \
        ${PEER_FLAGS:-} >"$dir/server.log" 2>&1 &
    peer=$!
    for _ in $(seq 1 120); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
        kill -0 $peer 2>/dev/null || { echo "llama.cpp's server exited; see $dir/server.log" >&2; return 1; }
        sleep 0.5
    done
    local loaded=0
    "$DFLASH" bench serve --server "llama.cpp=http://127.0.0.1:$PORT/v1" --concurrency "$2" \
        --max-tokens "$MAX_TOKENS" --out-dir "$dir" >"$dir/log" 2>&1 || loaded=$?
    kill $peer 2>/dev/null || true
    wait $peer 2>/dev/null || true
    if [[ $loaded -ne 0 ]]; then echo "| $2 | the bench failed: see $dir/log |"; return 0; fi
    sed -n '/^| concurrent/,/^$/p' "$dir/serve-load.md" | sed -n 3p
}

S="--device $DEVICE --max-concurrent 256"
for round in 1 2; do
    echo "== round $round: llama.cpp, a server sized to each level"
    for level in ${LEVELS//,/ }; do peer_level "$round" "$level"; done
    dir="$OUT/$round/dflash"
    mkdir -p "$dir"
    "$DFLASH" bench serve --start "plain=$S --no-drafter --no-pld" --start "served=$S" --concurrency "$LEVELS" \
        --max-tokens "$MAX_TOKENS" --out-dir "$dir" >"$dir/log" 2>&1
    echo "== round $round: ours"; sed -n '/^| concurrent/,/^$/p' "$dir/serve-load.md" | head -9
    grep -E "^\* .*repeated request" "$dir/serve-load.md" || true
done
