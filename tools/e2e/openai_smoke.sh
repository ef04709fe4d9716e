#!/usr/bin/env bash
# Smoke test of `dflash serve` with the official openai and anthropic Python clients: builds <repo>/.venv-e2e (gitignored) from
# tools/e2e/requirements.txt, starts the release binary on a free port (served as dflash-e2e and smol-alias), runs
# openai_smoke.py and the other tools/e2e scripts against it, then stops the server with SIGTERM and checks that it
# exits cleanly.
# Usage: bash tools/e2e/openai_smoke.sh     (after `cargo build --release`; the model must already be cached,
#        e.g. by `dflash fetch`)
# Env: DFLASH_BIN (default <repo>/target/release/dflash), PYTHON (default python3), DFLASH_SERVE_ARGS (extra flags).
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "${script_dir}/../.." && pwd)"
venv="${repo_root}/.venv-e2e"
dflash="${DFLASH_BIN:-${repo_root}/target/release/dflash}"
python_bin="${PYTHON:-python3}"
startup_polls=900   # 0.2 s each: three minutes to load the model and listen
shutdown_polls=150  # 0.2 s each: thirty seconds to exit after SIGTERM
model_names="dflash-e2e,smol-alias"  # --served-model-name: the first is the one responses carry

if [[ ! -x "${dflash}" ]]; then
    echo "no binary at ${dflash}; run cargo build --release first (or set DFLASH_BIN)" >&2
    exit 1
fi
if [[ ! -x "${venv}/bin/python" ]]; then
    "${python_bin}" -m venv "${venv}"
fi
"${venv}/bin/python" -m pip install --quiet --disable-pip-version-check -r "${script_dir}/requirements.txt"

log="$(mktemp)"
# shellcheck disable=SC2086  # DFLASH_SERVE_ARGS is a list of flags
NO_COLOR=1 DFLASH_LOG=info "${dflash}" serve --host 127.0.0.1 --port 0 --threads 2 \
    --served-model-name "${model_names}" ${DFLASH_SERVE_ARGS:-} 2>"${log}" &
server_pid=$!
cleanup() {
    if kill -0 "${server_pid}" 2>/dev/null; then
        kill -KILL "${server_pid}" 2>/dev/null || true
        wait "${server_pid}" 2>/dev/null || true
    fi
    rm -f "${log}"
}
trap cleanup EXIT
fail() {
    echo "openai_smoke.sh: $1" >&2
    echo "--- server log (last 50 lines) ---" >&2
    tail -n 50 "${log}" >&2
    exit 1
}

port=""
for _ in $(seq "${startup_polls}"); do
    port="$(grep -o 'listening on http://[0-9.]*:[0-9]*' "${log}" | head -n 1 | sed 's/.*://' || true)"
    [[ -n "${port}" ]] && break
    kill -0 "${server_pid}" 2>/dev/null || fail "the server exited before listening"
    sleep 0.2
done
[[ -n "${port}" ]] || fail "the server did not log 'listening on' in time"
echo "dflash serve listening on port ${port} (pid ${server_pid})"

"${venv}/bin/python" "${script_dir}/openai_smoke.py" "http://127.0.0.1:${port}/v1" || fail "the smoke test failed"
"${venv}/bin/python" "${script_dir}/openai_tools.py" "http://127.0.0.1:${port}/v1" || fail "the tool-calling test failed"
"${venv}/bin/python" "${script_dir}/openai_responses.py" "http://127.0.0.1:${port}/v1" "${model_names%%,*}" \
    || fail "the Responses API test failed"
"${venv}/bin/python" "${script_dir}/anthropic_messages.py" "http://127.0.0.1:${port}" "${model_names%%,*}" \
    || fail "the Messages API test failed"
"${venv}/bin/python" "${script_dir}/openai_structured.py" "http://127.0.0.1:${port}/v1" || fail "the structured-output test failed"
"${venv}/bin/python" "${script_dir}/openai_chat_details.py" "http://127.0.0.1:${port}/v1" ${model_names//,/ } \
    || fail "the chat-details test failed"

kill -TERM "${server_pid}"
for _ in $(seq "${shutdown_polls}"); do
    kill -0 "${server_pid}" 2>/dev/null || break
    sleep 0.2
done
kill -0 "${server_pid}" 2>/dev/null && fail "the server was still running 30 s after SIGTERM"
server_status=0
wait "${server_pid}" || server_status=$?
[[ "${server_status}" -eq 0 ]] || fail "the server exited with status ${server_status} after SIGTERM"
echo "openai smoke test passed; the server shut down cleanly"
