#!/usr/bin/env bash
# Creates the pinned Python environments of the golden-parity fixture generator (both gitignored, at the repo root):
#   bash tools/golden/setup.sh       .venv     requirements.txt     (make_fixtures.py and the other generators)
#   bash tools/golden/setup.sh hc    .venv-hc  requirements-hc.txt  (stream_fixtures.py's targets: transformers 5.25)
# Idempotent; re-running only installs what is missing.
# The default torch wheel also pulls the CUDA runtime libraries (several GB); the generator runs on CPU only.
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "${script_dir}/../.." && pwd)"
python_bin="${PYTHON:-python3}"
mode="${1:-default}"
case "${mode}" in
    default) venv="${repo_root}/.venv"; requirements="${script_dir}/requirements.txt" ;;
    hc) venv="${repo_root}/.venv-hc"; requirements="${script_dir}/requirements-hc.txt" ;;
    *) echo "usage: bash tools/golden/setup.sh [hc]" >&2; exit 2 ;;
esac

if [[ ! -x "${venv}/bin/python" ]]; then
    "${python_bin}" -m venv "${venv}"
fi
"${venv}/bin/python" -m pip install --upgrade --quiet pip
"${venv}/bin/python" -m pip install --quiet -r "${requirements}"
if [[ "${mode}" == hc ]]; then
    "${venv}/bin/python" - <<'PY'
import numpy, safetensors, torch, transformers
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead  # noqa: F401
print(f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {numpy.__version__}, "
      f"safetensors {safetensors.__version__}")
PY
else
    "${venv}/bin/python" - <<'PY'
import gguf, numpy, safetensors, torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"gguf {gguf.__version__ if hasattr(gguf, '__version__') else '?'}, numpy {numpy.__version__}, "
      f"safetensors {safetensors.__version__}")
PY
fi
echo "venv ready: ${venv}"
