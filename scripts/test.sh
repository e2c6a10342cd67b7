#!/usr/bin/env bash
# The test suite: unit + Ray/FSDP2 end-to-end tests in .venv, then the vLLM backend's tests in
# .venv-vllm (set HYBRIDFLOW_SKIP_VLLM=1 to skip those). Both halves always run, so a failure in
# one does not hide the other; the exit status is non-zero if either failed.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh || exit 1
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
"${HYBRIDFLOW_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider -m "not vllm" "$@"
main_rc=$?
vllm_rc=0
if [ "${HYBRIDFLOW_SKIP_VLLM:-0}" != "1" ]; then
  if bash scripts/bootstrap_vllm.sh; then
    "${HYBRIDFLOW_VLLM_VENV:-.venv-vllm}/bin/python" -m pytest -q -p no:cacheprovider -m vllm "$@"
    vllm_rc=$?
  else
    vllm_rc=1
  fi
fi
echo "[test.sh] main half: exit $main_rc; vLLM half: exit $vllm_rc$([ "${HYBRIDFLOW_SKIP_VLLM:-0}" = "1" ] && echo ' (skipped)')" >&2
[ "$main_rc" -eq 0 ] && [ "$vllm_rc" -eq 0 ]
