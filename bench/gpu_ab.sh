#!/usr/bin/env bash
# The speculation and serving figures of record on a CUDA machine, two builds or settings alternating A B A B, from
# the repository root:
#   A=path/to/dflash B="env DFLASH_DRAFT_BF16=0 path/to/dflash" OUT=dir bench/gpu_ab.sh [what ...]
# what (default: serve lanes projection):
#   serve       the drafting server (drafter and prompt lookup) beside a plain one at 1, 8 and 64 requests
#   split       as serve, with a lookup-only and a drafter-only server beside them
#   lanes       the default model's lanes at one request (plain, lookup, the drafter as served and in full blocks)
#   projection  the Qwen3-8B shape with a real-shape DFlash2 drafter paid every round, at 1, 8 and 32 copies
#   plain       plain serving at 1 to 256 requests, 256-token completions
#   oracle      the round policy under load with no checkpoint: the SmolLM2 shape with random weights, the adaptive
#               oracle lane (mid profile, free drafts) beside plain at 1, 8 and 64 copies
# B may be left out: then A runs alone (twice). ROUNDS (default 2) is each serving stream's completions a level: 8
# weighs the servers' warm-up (the step gates' first explorations) less. SPREAD (default 0) spreads the serving
# completions' lengths over 128 · (1 ± SPREAD), so prompts arrive one at a time rather than in waves. Each run's tables land in
# OUT/<what>-<A|B>-<round>/; the lines of record are printed as they come.
set -euo pipefail
A=${A:?A=path/to/dflash}
B=${B:-}
OUT=${OUT:-bench/out/ab}
ROUNDS=${ROUNDS:-2}
SPREAD=${SPREAD:-0}
# A binary built elsewhere looks for the shipped drafters where it was built.
export DFLASH_ASSETS_DIR=${DFLASH_ASSETS_DIR:-$PWD/assets}
whats=("$@")
[[ ${#whats[@]} -gt 0 ]] || whats=(serve lanes projection)
S="--device cuda --max-concurrent 64"
P="--random-target qwen3-8b --random-drafter dflash2 --tokenizer crates/models/tests/fixtures/tiny-qwen3-next \
--per-group 1 --max-tokens 128 --repeat 1 --oracle-profile paper --oracle-pays-drafter --lanes plain,oracle16-fixed"
O="--random-target smollm2 --tokenizer crates/models/tests/fixtures/tiny-qwen3-next --per-group 1 --max-tokens 128 \
--repeat 1 --oracle-profile mid --lanes plain,oracle"

run() { # run WHAT NAME CMD...: one measurement into OUT/WHAT-NAME-ROUND
    local what=$1 name=$2 dir
    shift 2
    dir="$OUT/$what-$name-$round"
    mkdir -p "$dir"
    case $what in
    serve | split)
        local extra=()
        [[ $what == split ]] && extra=(--start "pld=$S --no-drafter" --start "drafter=$S --no-pld")
        "$@" bench serve --start "plain=$S --no-drafter --no-pld" "${extra[@]}" --start "served=$S" \
            --concurrency 1,8,64 --max-tokens 128 --rounds "$ROUNDS" --length-spread "$SPREAD" --out-dir "$dir" \
            >"$dir/log" 2>&1
        echo "== $what $name $round"; sed -n '/^| concurrent/,/^$/p' "$dir/serve-load.md" | head -12
        grep -E "^\* .*repeated request" "$dir/serve-load.md" || true ;;
    lanes)
        "$@" bench --device cuda lanes --lanes plain,pld,dflash,dflash-fixed --per-group 2 --max-tokens 128 \
            --repeat 1 --out-dir "$dir" >"$dir/log" 2>&1
        echo "== $what $name $round"; grep -E "^\| (group|all) |round-costs" "$dir/log" ;;
    projection)
        for c in 1 8 32; do
            # shellcheck disable=SC2086 # P is a list of flags
            "$@" bench --device cuda lanes $P --concurrency $c --out-dir "$dir/c$c" >"$dir/c$c.log" 2>&1
            echo "== $what $name $round, $c copies"; grep -E "^\| all |round-costs" "$dir/c$c.log"
        done ;;
    oracle)
        for c in 1 8 64; do
            # shellcheck disable=SC2086 # O is a list of flags
            "$@" bench --device cuda lanes $O --concurrency $c --out-dir "$dir/c$c" >"$dir/c$c.log" 2>&1
            echo "== $what $name $round, $c copies"; grep -E "^\| all |round-costs" "$dir/c$c.log"
        done ;;
    plain)
        "$@" bench serve --start "plain=--device cuda --no-drafter --no-pld --max-concurrent 256" \
            --concurrency 1,8,32,64,128,256 --max-tokens 256 --out-dir "$dir" >"$dir/log" 2>&1
        echo "== $what $name $round"; sed -n '/^| concurrent/,/^$/p' "$dir/serve-load.md" | head -9
        grep -E "^\* .*repeated request" "$dir/serve-load.md" || true ;;
    *) echo "unknown: $what" >&2; exit 2 ;;
    esac
}

for what in "${whats[@]}"; do
    for round in 1 2; do
        # shellcheck disable=SC2086 # A and B are command lines
        run "$what" A $A
        # shellcheck disable=SC2086
        [[ -z $B ]] || run "$what" B $B
    done
done
