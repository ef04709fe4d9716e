#!/usr/bin/env bash
# Lists Rust and CUDA kernel sources over the soft limit of 800 lines; fails above the hard limit of 1000.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
while IFS= read -r f; do
    n=$(wc -l <"$f")
    if [ "$n" -gt 1000 ]; then
        echo "too long: $f ($n lines, limit 1000)"
        status=1
    elif [ "$n" -gt 800 ]; then
        echo "long: $f ($n lines, soft limit 800)"
    fi
done < <(git ls-files '*.rs' '*.cu' '*.cuh')
exit $status
