#!/usr/bin/env bash
# The main job: task data, tiny model, SFT warm start, GRPO on 2 FSDP2 workers -> runs/demo/summary.json
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
exec "${HYBRIDFLOW_VENV:-.venv}/bin/hybridflow" demo "$@"
