#!/usr/bin/env bash
# Prepares what the GPU run needs for a machine without network access whose file transfers are size-limited,
# and brings its results back in pieces of at most 15 MiB.
#
#   stage.sh wheels                  pure-Python wheels the GPU machine lacks (gguf, dflash) -> tools/train/.stage/wheels
#   stage.sh split-gguf [GGUF]       the target GGUF (94 MiB) in two halves -> tools/train/.stage/gguf-a, .stage/gguf-b
#   stage.sh join-gguf DIR OUT       concatenates DIR/target.gguf.part-* into OUT and checks its sha256
#   stage.sh pack RUN_DIR DEST       tar of the run's results in <= 15 MiB parts + sha256 -> DEST
#   stage.sh unpack SRC DEST         joins and checks the parts from SRC, extracts into DEST
#
# tools/train/.stage/ is git-ignored (tools/train/.gitignore), so it travels only when named as carried.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
stage="${here}/.stage"
python_bin="${PYTHON:-python3}"
default_gguf="${DFLASH_MODELS_DIR:-${HOME}/.cache/dflash/models}/SmolLM2-135M-Instruct.Q4_1.gguf"

wheels() {
    mkdir -p "${stage}/wheels"
    # Both are pure Python (py3-none-any); their own dependencies (numpy, pyyaml, tqdm) are on the GPU image.
    "${python_bin}" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        -d "${stage}/wheels" gguf==0.17.1 dflash==0.1.0
    ls -l "${stage}/wheels"
}

split_gguf() {
    local gguf="${1:-${default_gguf}}"
    local size half
    size=$(stat -c %s "${gguf}")
    half=$(((size + 1) / 2))
    rm -rf "${stage}/gguf-a" "${stage}/gguf-b"
    mkdir -p "${stage}/gguf-a" "${stage}/gguf-b"
    head -c "${half}" "${gguf}" >"${stage}/gguf-a/target.gguf.part-0"
    tail -c +"$((half + 1))" "${gguf}" >"${stage}/gguf-b/target.gguf.part-1"
    sha256sum "${gguf}" | cut -d' ' -f1 >"${stage}/gguf-b/target.gguf.sha256"
    cp "${stage}/gguf-b/target.gguf.sha256" "${stage}/gguf-a/"
    ls -l "${stage}/gguf-a" "${stage}/gguf-b"
}

join_gguf() {
    local dir="$1" out="$2"
    cat "${dir}"/target.gguf.part-* >"${out}"
    local want got
    want=$(cat "${dir}/target.gguf.sha256")
    got=$(sha256sum "${out}" | cut -d' ' -f1)
    if [[ "${want}" != "${got}" ]]; then
        echo "joined GGUF sha256 ${got} != ${want} (a part is missing?)" >&2
        rm -f "${out}"
        exit 1
    fi
    echo "GGUF joined: ${out} ($(stat -c %s "${out}") bytes, sha256 ok)"
}

pack() {
    local run="$1" dest="$2"
    mkdir -p "${dest}"
    local items=()
    for p in export ckpt/metrics.json data/samples.json data/samples.npz run.log; do
        [[ -e "${run}/${p}" ]] && items+=("${p}")
    done
    tar -C "${run}" -cf - "${items[@]}" | split -b 15M -d -a 2 - "${dest}/results.tar.part-"
    (cd "${dest}" && sha256sum results.tar.part-* >results.sha256)
    [[ -e "${run}/run.log" ]] && tail -c 200000 "${run}/run.log" >"${dest}/run-tail.log"
    ls -l "${dest}"
}

unpack() {
    local src="$1" dest="$2"
    (cd "${src}" && sha256sum -c results.sha256)
    mkdir -p "${dest}"
    cat "${src}"/results.tar.part-* | tar -C "${dest}" -xf -
    echo "unpacked into ${dest}:"
    find "${dest}" -maxdepth 2 | sort
}

case "${1:-}" in
    wheels) wheels ;;
    split-gguf) split_gguf "${2:-}" ;;
    join-gguf) join_gguf "$2" "$3" ;;
    pack) pack "$2" "$3" ;;
    unpack) unpack "$2" "$3" ;;
    *)
        sed -n '2,11p' "$0"
        exit 2
        ;;
esac
