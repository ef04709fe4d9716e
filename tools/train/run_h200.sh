#!/usr/bin/env bash
# The GPU run: regenerate the training data with the target, train the DFlash2 drafter and the MTP head, export
# both and check them against the reference package. One H200 is plenty; the budget covers generation and
# training together (loading, export and the check come on top, about a minute).
#
# Usage: tools/train/run_h200.sh --out DIR [options]
#   --out DIR          everything goes here: data/, ckpt/, export/, run.log
#   --budget-s N       seconds for generation + training together (default 450)
#   --gen-share F      fraction of the budget for generation (default 0.42)
#   --gguf PATH        the target GGUF (default ~/.cache/dflash/models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   --gguf-parts DIR   join DIR/target.gguf.part-* (stage.sh split-gguf) into DIR/target.gguf first
#   --wheels DIR       install these wheels (stage.sh wheels) into a private site dir first
#   --from STEP        resume: start at generate (default), train or export, reusing what --out holds
#   --pack DIR         finally pack the results into <= 15 MiB parts in DIR (stage.sh pack)
#   --python BIN       interpreter (default python3)
#   --smoke            CPU check of the whole chain with tiny sizes (every script's --smoke), about 3 minutes
# Extra arguments after `--` go to train.py (e.g. -- --layers 3).
set -euo pipefail
export PYTHONUNBUFFERED=1

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out=""
budget=450
gen_share=0.42
gguf="${DFLASH_MODELS_DIR:-${HOME}/.cache/dflash/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
gguf_parts=""
wheels=""
from="generate"
pack=""
py="python3"
smoke=""
train_extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --budget-s) budget="$2"; shift 2 ;;
        --gen-share) gen_share="$2"; shift 2 ;;
        --gguf) gguf="$2"; shift 2 ;;
        --gguf-parts) gguf_parts="$2"; shift 2 ;;
        --wheels) wheels="$2"; shift 2 ;;
        --from) from="$2"; shift 2 ;;
        --pack) pack="$2"; shift 2 ;;
        --python) py="$2"; shift 2 ;;
        --smoke) smoke="--smoke"; shift ;;
        --) shift; train_extra=("$@"); break ;;
        *) echo "unknown argument: $1" >&2; sed -n '2,18p' "$0" >&2; exit 2 ;;
    esac
done
[[ -n "${out}" ]] || { echo "--out DIR is required" >&2; exit 2; }
mkdir -p "${out}/data" "${out}/ckpt" "${out}/export"
exec > >(tee -a "${out}/run.log") 2>&1
t0=$(date +%s)
say() { echo "[run_h200 $(date +%H:%M:%S) +$(($(date +%s) - t0))s] $*"; }

if [[ -n "${wheels}" ]]; then
    site="${TMPDIR:-/tmp}/dflash-train-site"
    "${py}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${site}" "${wheels}"/*.whl
    export PYTHONPATH="${site}${PYTHONPATH:+:${PYTHONPATH}}"
fi
if [[ -n "${gguf_parts}" ]]; then
    gguf="${gguf_parts}/target.gguf"
    [[ -f "${gguf}" ]] || bash "${here}/stage.sh" join-gguf "${gguf_parts}" "${gguf}"
fi
[[ -f "${gguf}" ]] || { echo "target GGUF not found: ${gguf}" >&2; exit 1; }

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

gen_budget=$("${py}" -c "print(int(${budget} * ${gen_share}))")
case "${from}" in
    generate)
        say "generate: budget ${gen_budget}s"
        "${py}" -u "${here}/generate.py" --gguf "${gguf}" --out "${out}/data/samples.npz" --time-budget-s "${gen_budget}" ${smoke}
        ;& # fall through
    train)
        left=$((budget - ($(date +%s) - t0)))
        if [[ "${from}" == "train" ]]; then left=$((budget - gen_budget)); fi
        say "train: budget ${left}s"
        "${py}" -u "${here}/train.py" --gguf "${gguf}" --data "${out}/data/samples.npz" --out "${out}/ckpt" \
            --time-budget-s "${left}" ${smoke} "${train_extra[@]}"
        ;&
    export)
        say "export and reference check"
        "${py}" -u "${here}/export.py" --gguf "${gguf}" --ckpt "${out}/ckpt/train_state.pt" --out "${out}/export" \
            --samples "${out}/data/samples.npz" ${smoke}
        ;;
    *) echo "--from must be generate, train or export" >&2; exit 2 ;;
esac
say "done; exported files:"
ls -l "${out}/export/drafter" "${out}/export/mtp"
if [[ -n "${pack}" ]]; then
    bash "${here}/stage.sh" pack "${out}" "${pack}"
fi
