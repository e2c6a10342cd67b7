#!/usr/bin/env bash
# The test suite: unit + Ray/FSDP2 end-to-end tests in .venv, then the vLLM backend's tests in
# .venv-vllm (set HYBRIDFLOW_SKIP_VLLM=1 to skip those).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
"${HYBRIDFLOW_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider -m "not vllm" "$@"
if [ "${HYBRIDFLOW_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/bootstrap_vllm.sh
  "${HYBRIDFLOW_VLLM_VENV:-.venv-vllm}/bin/python" -m pytest -q -p no:cacheprovider -m vllm "$@"
fi
