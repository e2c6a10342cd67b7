#!/usr/bin/env bash
# The test suite (unit tests + Ray/FSDP2 end-to-end tests on 2 workers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
exec "${HYBRIDFLOW_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider "$@"
