#!/usr/bin/env bash
# Create/refresh the project venv: torch first, then hybridflow and its dependencies (pip install -e .[test,envs]).
# Re-running is a no-op while pyproject.toml and this script are unchanged.
#
# Which torch build: HYBRIDFLOW_TORCH holds the pip arguments that install it (default torch==2.13.0).
# Plain `torch==2.13.0` from PyPI is the CUDA build on Linux x86_64 (several GB); on a machine without
# a GPU ask for the CPU build, e.g.
#   HYBRIDFLOW_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" bash scripts/demo.sh
# (a pip configuration that already offers a CPU wheel, e.g. through find-links, needs nothing).
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
venv_pip "$VENV" $TORCH_SPEC  # unquoted on purpose: pip arguments (a version, an --index-url)
venv_pip "$VENV" -e ".[test,envs]"
venv_stamp "$VENV" scripts/bootstrap.sh
