#!/usr/bin/env bash
# Moves what a GPU run needs to a machine without network access whose transfers are size-limited, and brings
# its results back in pieces.
#
#   stage.sh wheels                      pure-Python wheels the GPU machine lacks (gguf, dflash) -> .stage/wheels
#   stage.sh carry [--budget-mib N] [--ckpt FILE] [--gguf FILE]
#                                        the GGUF, the wheels and the previous checkpoint cut into parts, packed
#                                        into folders .stage/carry-1, carry-2, ... of at most N MiB each (default:
#                                        what fits beside the repository's travelling files in one 64 MiB
#                                        transfer); send one folder per transfer; they meet in .stage/ there
#   stage.sh assemble STAGE DEST         joins the parts found in STAGE/carry-*, checks each file's sha256 and
#                                        writes DEST/target.gguf, DEST/resume.pt, DEST/wheels/ (what it finds)
#   stage.sh pack RUN_DIR DEST           the run's checkpoint (resume.pt), metrics and log as a tar in <= 15 MiB
#                                        parts + sha256 + the log's tail -> DEST (at most 8 files, < 64 MiB)
#   stage.sh unpack SRC DEST             joins and checks the parts from SRC, extracts into DEST
#   stage.sh wait RUN_DIR [SECONDS]      waits for a detached run (run_h200.sh --detach) to end, at most SECONDS
#                                        (default 540), printing its log's tail; exit 0 when it ended well, 3 when
#                                        it is still running, its status otherwise
#
# tools/train/.stage/ is git-ignored (tools/train/.gitignore), so it travels only when named as carried.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
stage="${here}/.stage"
python_bin="${PYTHON:-python3}"
default_gguf="${DFLASH_MODELS_DIR:-${HOME}/.cache/dflash/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
mib=$((1024 * 1024))

wheels() {
    mkdir -p "${stage}/wheels"
    # Both are pure Python (py3-none-any); their own dependencies (numpy, pyyaml, tqdm) are on the GPU image.
    "${python_bin}" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        -d "${stage}/wheels" gguf==0.17.1 dflash==0.1.0
    ls -l "${stage}/wheels"
}

# carry: every file is cut into parts of at most the budget, and parts are packed first-fit into carry folders.
# MiB left for carried files in one transfer: 63 MiB less the files that travel anyway (tracked and untracked,
# not ignored).
travel_budget_mib() {
    local tree
    tree=$(cd "$(git -C "${here}" rev-parse --show-toplevel)" && git ls-files -co --exclude-standard -z |
        xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
    local left=$(((63 * mib - tree) / mib))
    ((left >= 4)) || { echo "only ${left} MiB left beside the repository's files" >&2; exit 1; }
    echo "${left}"
}

carry() {
    local budget="" ckpt="" gguf="${default_gguf}"
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --budget-mib) budget="$2"; shift 2 ;;
            --ckpt) ckpt="$2"; shift 2 ;;
            --gguf) gguf="$2"; shift 2 ;;
            *) echo "carry: unknown argument $1" >&2; exit 2 ;;
        esac
    done
    [[ -n "${budget}" ]] || budget=$(travel_budget_mib)
    echo "carry folders of at most ${budget} MiB"
    local work="${stage}/parts"
    rm -rf "${work}" "${stage}"/carry-*
    mkdir -p "${work}"
    split_file "${gguf}" target.gguf "${budget}" "${work}"
    [[ -z "${ckpt}" ]] || split_file "${ckpt}" resume.pt "${budget}" "${work}"
    if [[ -d "${stage}/wheels" ]]; then
        tar -C "${stage}" -cf "${work}/wheels.tar.whole" wheels
        split_file "${work}/wheels.tar.whole" wheels.tar "${budget}" "${work}"
        rm "${work}/wheels.tar.whole"
    fi
    # First fit, largest parts first: the fewest folders, so the fewest transfers.
    local used=() size i placed
    for part in $(ls -S "${work}"/*.part-*); do
        size=$(stat -c %s "${part}")
        placed=""
        for i in "${!used[@]}"; do
            if ((used[i] + size <= budget * mib)); then placed="${i}"; break; fi
        done
        if [[ -z "${placed}" ]]; then placed=${#used[@]}; used+=(0); fi
        mkdir -p "${stage}/carry-$((placed + 1))"
        mv "${part}" "${stage}/carry-$((placed + 1))/"
        used[placed]=$((used[placed] + size))
    done
    # Every folder gets every checksum, so any folder tells what the whole set is.
    for dir in "${stage}"/carry-*; do cp "${work}"/*.sha256 "${dir}/"; done
    rm -rf "${work}"
    du -sh "${stage}"/carry-*
}

split_file() {
    local file="$1" name="$2" budget="$3" work="$4"
    # Parts a little under the budget, so a folder's checksums fit beside its part.
    split -b $((budget * mib - 64 * 1024)) -d -a 2 "${file}" "${work}/${name}.part-"
    sha256sum "${file}" | cut -d' ' -f1 >"${work}/${name}.sha256"
}

assemble() {
    local src="$1" dest="$2" name want got sum
    mkdir -p "${dest}"
    local sums
    sums=$(ls "${src}"/carry-*/*.sha256 2>/dev/null | xargs -r -n1 basename | sort -u)
    [[ -n "${sums}" ]] || { echo "no carried files under ${src}/carry-*" >&2; exit 1; }
    for name in ${sums}; do
        name="${name%.sha256}"
        sum=$(ls "${src}"/carry-*/"${name}".sha256 | head -1)
        # Parts in part-number order, whichever folders they came in.
        for part in "${src}"/carry-*/"${name}".part-*; do echo "${part##*.part-} ${part}"; done | sort -n |
            cut -d' ' -f2 | xargs cat >"${dest}/${name}"
        want=$(cat "${sum}")
        got=$(sha256sum "${dest}/${name}" | cut -d' ' -f1)
        if [[ "${want}" != "${got}" ]]; then
            echo "${name}: sha256 ${got} != ${want} (a carry folder is missing?)" >&2
            rm -f "${dest}/${name}"
            exit 1
        fi
        echo "${name}: $(stat -c %s "${dest}/${name}") bytes, sha256 ok"
    done
    if [[ -f "${dest}/wheels.tar" ]]; then
        tar -C "${dest}" -xf "${dest}/wheels.tar" && rm "${dest}/wheels.tar"
    fi
}

pack() {
    local run="$1" dest="$2"
    mkdir -p "${dest}"
    local items=()
    for p in ckpt/resume.pt ckpt/metrics.jsonl ckpt/metrics.json data/samples.json run.log; do
        [[ -e "${run}/${p}" ]] && items+=("${p}")
    done
    tar -C "${run}" -cf - "${items[@]}" | split -b 15M -d -a 2 - "${dest}/results.tar.part-"
    (cd "${dest}" && sha256sum results.tar.part-* >results.sha256)
    [[ -e "${run}/run.log" ]] && tail -c 200000 "${run}/run.log" >"${dest}/run-tail.log"
    ls -l "${dest}"
    local total
    total=$(du -cb "${dest}"/* | tail -1 | cut -f1)
    if ((total > 63 * mib)); then echo "warning: ${total} bytes to bring back, over 63 MiB" >&2; fi
}

unpack() {
    local src="$1" dest="$2"
    (cd "${src}" && sha256sum -c results.sha256)
    mkdir -p "${dest}"
    cat "${src}"/results.tar.part-* | tar -C "${dest}" -xf -
    echo "unpacked into ${dest}:"
    find "${dest}" -maxdepth 2 | sort
}

wait_run() {
    local run="$1" limit="${2:-540}" start
    start=$(date +%s)
    while [[ ! -f "${run}/exit-status" ]] && (($(date +%s) - start < limit)); do sleep 10; done
    tail -n 25 "${run}/run.log" 2>/dev/null || tail -n 25 "${run}/detached.log" 2>/dev/null || true
    if [[ ! -f "${run}/exit-status" ]]; then
        echo "still running after ${limit} s"
        return 3
    fi
    return "$(cat "${run}/exit-status")"
}

case "${1:-}" in
    wheels) wheels ;;
    carry) shift; carry "$@" ;;
    assemble) assemble "$2" "$3" ;;
    pack) pack "$2" "$3" ;;
    unpack) unpack "$2" "$3" ;;
    wait) wait_run "$2" "${3:-540}" ;;
    *)
        sed -n '2,24p' "$0"
        exit 2
        ;;
esac
