#!/usr/bin/env bash
# Creates <repo>/.venv (gitignored) with the pinned packages that tools/golden/make_fixtures.py needs.
# Usage: bash tools/golden/setup.sh        (idempotent; re-running only installs what is missing)
# The default torch wheel also pulls the CUDA runtime libraries (several GB); the generator runs on CPU only.
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "${script_dir}/../.." && pwd)"
venv="${repo_root}/.venv"
python_bin="${PYTHON:-python3}"

if [[ ! -x "${venv}/bin/python" ]]; then
    "${python_bin}" -m venv "${venv}"
fi
"${venv}/bin/python" -m pip install --upgrade --quiet pip
"${venv}/bin/python" -m pip install --quiet -r "${script_dir}/requirements.txt"
"${venv}/bin/python" - <<'PY'
import gguf, numpy, safetensors, torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"gguf {gguf.__version__ if hasattr(gguf, '__version__') else '?'}, numpy {numpy.__version__}, "
      f"safetensors {safetensors.__version__}")
PY
echo "venv ready: ${venv}"
