#!/usr/bin/env bash
# Create/refresh the project venv: torch first (the CPU wheel on this kind of machine), then
# hybridflow and its dependencies. Re-running is a no-op while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_lib.sh
VENV="${HYBRIDFLOW_VENV:-.venv}"
TORCH_SPEC="${HYBRIDFLOW_TORCH:-torch==2.13.0}"
# The code sandbox (hybridflow/agent/sandbox.py) prefers bubblewrap; best effort: it falls back to unshare.
if ! command -v bwrap >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "[bootstrap] installing bubblewrap for the code sandbox" >&2
  export DEBIAN_FRONTEND=noninteractive
  { timeout 300 apt-get install -y -q bubblewrap || { timeout 300 apt-get update -q && timeout 300 apt-get install -y -q bubblewrap; }; } \
    >/dev/null 2>&1 || echo "[bootstrap] could not install bubblewrap; the sandbox will use unshare" >&2
fi
venv_up_to_date "$VENV" scripts/bootstrap.sh && exit 0
echo "[bootstrap] setting up $VENV (torch: $TORCH_SPEC)" >&2
venv_create "$VENV"
"$VENV/bin/pip" install -q "$TORCH_SPEC"
"$VENV/bin/pip" install -q -e ".[test]"
venv_stamp "$VENV" scripts/bootstrap.sh
