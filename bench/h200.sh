#!/usr/bin/env bash
# The per-machine figures of docs/BENCHMARKS.md on a CUDA machine, from the repository root:
#   DFLASH=path/to/dflash OUT=dir bench/h200.sh
# 1. the prefix cache: a 4K-token chat's second turn, cold and warm (with and without the drafter);
# 2. the lanes on the held-out prompts, greedy and at T 0.7, lanes alternating.
set -euo pipefail
DFLASH=${DFLASH:-dflash}
OUT=${OUT:-bench/out}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
"$DFLASH" bench --device "$DEVICE" prefix --context 4096 --repeat 3 >"$OUT/prefix.md" 2>"$OUT/prefix.log"
"$DFLASH" bench --device "$DEVICE" lanes --prompts bench/prompts/heldout.json --lanes plain,pld,dflash,mtp \
  --temperatures 0,0.7 --repeat 1 --max-tokens 128 --out-dir "$OUT" >"$OUT/lanes.md" 2>"$OUT/lanes.log"
