#!/usr/bin/env bash
# Create/refresh the project venv: torch first (the CPU wheel on this kind of machine), then
# hybridflow and its dependencies. Re-running is a no-op while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HYBRIDFLOW_VENV:-.venv}"
TORCH_SPEC="${HYBRIDFLOW_TORCH:-torch==2.13.0}"
stamp="$VENV/.hybridflow-installed"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[bootstrap] setting up $VENV (torch: $TORCH_SPEC)" >&2
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "$TORCH_SPEC"
"$VENV/bin/pip" install -q -e ".[test]"
echo "$want" > "$stamp"
