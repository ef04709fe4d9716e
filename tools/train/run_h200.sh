#!/usr/bin/env bash
# One GPU run of the resumable training series: generate a fresh data shard with the target, train both drafters
# from the previous run's checkpoint for the rest of the time budget, evaluate, and leave the checkpoint and the
# metrics in the output folder. One H200 is plenty. The export (and its reference check) runs where the results
# land, from the checkpoint (export.py), unless --export asks for it here.
#
# Usage: tools/train/run_h200.sh --out DIR --run N [options] [-- train.py options]
#   --out DIR          this run's folder: data/, ckpt/ (resume.pt, train_state.pt, metrics.jsonl), run.log
#   --run N            run index of the series, from 1: picks the prompt shard ((N-1) mod shards) and the seeds
#   --resume CKPT      the previous run's checkpoint (resume.pt or train_state.pt); not for run 1
#   --stage DIR        carried files (stage.sh carry): joins and checks them, then takes the GGUF, the wheels and,
#                      unless --resume is given, the checkpoint from there
#   --budget-s N       seconds for generation + training, setup included (default 1200)
#   --gen-share F      share of the budget for generation (default 0.4)
#   --num-shards N     prompt shards of the series (default 2)
#   --shard K          this run's prompt shard instead of (N-1) mod shards (a series restarted from shipped
#                      weights takes the shard they have not seen)
#   --variants N       sampled-prefix responses per prompt besides greedy (default 2)
#   --gen-args "..."   more generate.py options (e.g. "--max-rows 1536 --kv-gib 96 --max-new-tokens 1024")
#   --total-steps N    the series' step budget (required for run 1; later runs keep the checkpoint's)
#   --gguf PATH        the target GGUF (default ~/.cache/dflash/models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   --wheels DIR       install these wheels into a private site dir first
#   --from STEP        resume this run at generate (default), train or export, reusing what --out holds
#   --export           also export and check here (needs about a minute more)
#   --pack DIR         finally pack checkpoint, metrics and log into <= 15 MiB parts in DIR (stage.sh pack)
#   --detach           run in the background (its own session, so it outlives the calling shell) and return;
#                      `stage.sh wait DIR` follows it
#   --python BIN       interpreter (default python3)
#   --smoke            CPU check of the whole chain on a tiny random target, about a minute
set -euo pipefail
export PYTHONUNBUFFERED=1

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
all_args=("$@")
out="" run_index="" resume="" stage_dir="" budget=1200 gen_share=0.4 num_shards=2 shard="" variants=2 total_steps=""
gguf="${DFLASH_MODELS_DIR:-${HOME}/.cache/dflash/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
wheels="" from="generate" do_export="" pack="" detach="" py="python3" smoke="" gen_args=""
train_extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --run) run_index="$2"; shift 2 ;;
        --resume) resume="$2"; shift 2 ;;
        --stage) stage_dir="$2"; shift 2 ;;
        --budget-s) budget="$2"; shift 2 ;;
        --gen-share) gen_share="$2"; shift 2 ;;
        --num-shards) num_shards="$2"; shift 2 ;;
        --shard) shard="$2"; shift 2 ;;
        --variants) variants="$2"; shift 2 ;;
        --gen-args) gen_args="$2"; shift 2 ;;
        --total-steps) total_steps="$2"; shift 2 ;;
        --gguf) gguf="$2"; shift 2 ;;
        --wheels) wheels="$2"; shift 2 ;;
        --from) from="$2"; shift 2 ;;
        --export) do_export=1; shift ;;
        --pack) pack="$2"; shift 2 ;;
        --detach) detach=1; shift ;;
        --python) py="$2"; shift 2 ;;
        --smoke) smoke="--smoke"; shift ;;
        --) shift; train_extra=("$@"); break ;;
        *) echo "unknown argument: $1" >&2; sed -n '2,29p' "$0" >&2; exit 2 ;;
    esac
done
[[ -n "${out}" && -n "${run_index}" ]] || { echo "--out DIR and --run N are required" >&2; exit 2; }
if [[ -n "${shard}" ]] && ! { [[ "${shard}" =~ ^[0-9]+$ ]] && ((10#${shard} < num_shards)); }; then
    echo "--shard must be one of 0 .. $((num_shards - 1))" >&2
    exit 2
fi
mkdir -p "${out}/data" "${out}/ckpt"

if [[ -n "${detach}" ]]; then
    rest=()
    for a in "${all_args[@]}"; do [[ "${a}" == "--detach" ]] || rest+=("${a}"); done
    rm -f "${out}/exit-status"
    setsid nohup bash "$0" "${rest[@]}" >"${out}/detached.log" 2>&1 </dev/null &
    echo "started in the background (pid $!); follow it with: bash ${here}/stage.sh wait ${out}"
    exit 0
fi
trap 'echo $? >"${out}/exit-status"' EXIT
exec > >(tee -a "${out}/run.log") 2>&1
t0=$(date +%s)
say() { echo "[run_h200 $(date +%H:%M:%S) +$(($(date +%s) - t0))s] $*"; }

if [[ -n "${stage_dir}" ]]; then
    bash "${here}/stage.sh" assemble "${stage_dir}" "${stage_dir}/assembled"  # cheap; checks every file again
    gguf="${stage_dir}/assembled/target.gguf"
    [[ -n "${resume}" || ! -f "${stage_dir}/assembled/resume.pt" ]] || resume="${stage_dir}/assembled/resume.pt"
    [[ -n "${wheels}" || ! -d "${stage_dir}/assembled/wheels" ]] || wheels="${stage_dir}/assembled/wheels"
fi
if [[ -n "${wheels}" ]]; then
    site="${TMPDIR:-/tmp}/dflash-train-site"
    "${py}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${site}" "${wheels}"/*.whl
    export PYTHONPATH="${site}${PYTHONPATH:+:${PYTHONPATH}}"
fi
[[ -n "${smoke}" || -f "${gguf}" ]] || { echo "target GGUF not found: ${gguf}" >&2; exit 1; }
gguf_arg=(--gguf "${gguf}")
if [[ -n "${smoke}" ]]; then
    gguf_arg=(--gguf "${out}/tiny-target.gguf")
    [[ -f "${out}/tiny-target.gguf" ]] || "${py}" "${here}/tiny_target.py" --out "${out}/tiny-target.gguf" --source "${gguf}"
fi

# Fail in seconds, not minutes, if a package is missing or the GPU is not visible.
SMOKE="${smoke}" "${py}" - <<'PY'
import importlib
import os
import torch
mods = {m: importlib.import_module(m) for m in ("numpy", "safetensors", "tokenizers", "jinja2", "gguf", "transformers")}
import dflash.model  # noqa: F401  (the reference package's model classes)
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-",
      " ".join(f"{m} {getattr(v, '__version__', '?')}" for m, v in mods.items()))
if not torch.cuda.is_available() and not os.environ["SMOKE"]:
    raise SystemExit("no GPU visible")
PY

if [[ -n "${shard}" ]]; then shard=$((10#${shard})); else shard=$(((run_index - 1) % num_shards)); fi
gen_budget=$("${py}" -c "print(int(${budget} * ${gen_share}))")
resume_arg=()
[[ -z "${resume}" ]] || resume_arg=(--resume "${resume}")
steps_arg=()
[[ -z "${total_steps}" ]] || steps_arg=(--total-steps "${total_steps}")
case "${from}" in
    generate)
        say "run ${run_index}: generate shard ${shard}/${num_shards}, budget ${gen_budget}s"
        "${py}" -u "${here}/generate.py" "${gguf_arg[@]}" --out "${out}/data/samples.npz" --shard "${shard}" \
            --num-shards "${num_shards}" --variants "${variants}" --seed "${run_index}" \
            --time-budget-s "${gen_budget}" ${smoke} ${gen_args}
        ;& # fall through
    train)
        left=$((budget - ($(date +%s) - t0)))
        if [[ "${from}" == "train" ]]; then left=$((budget - gen_budget)); fi
        say "run ${run_index}: train ${resume:+from ${resume} }for ${left}s"
        "${py}" -u "${here}/train.py" "${gguf_arg[@]}" --data "${out}/data/samples.npz" --out "${out}/ckpt" \
            "${resume_arg[@]}" "${steps_arg[@]}" --time-budget-s "${left}" ${smoke} "${train_extra[@]}"
        ;&
    export)
        if [[ -n "${do_export}" || -n "${smoke}" ]]; then
            say "export and reference check"
            "${py}" -u "${here}/export.py" "${gguf_arg[@]}" --ckpt "${out}/ckpt/resume.pt" --out "${out}/export" ${smoke}
        fi
        ;;
    *) echo "--from must be generate, train or export" >&2; exit 2 ;;
esac
say "done; checkpoint and metrics:"
ls -l "${out}/ckpt"
if [[ -n "${pack}" ]]; then
    bash "${here}/stage.sh" pack "${out}" "${pack}"
fi
