#!/usr/bin/env bash
# The GPU checks, in one prepared script for a CUDA machine (one GPU, ~16 cores, package registries
# only). Any session that is lent a device runs it at once:
#
#   bash scripts/gpu_check.sh            # install (CUDA torch, vLLM) and run the checks, print the tables
#   bash scripts/gpu_check.sh --dry-run  # print the plan only (no GPU needed; tested on CPU)
#
# Status: dry-run tested on CPU; the whole script has NOT yet run on a GPU. Its exact-cuda step's
# bench ran on an H200 (2026-12-04, the image's own torch 2.11 + cu130: docs/hybrid_engine.md); the
# machine lent then reaches no package index, so the installs below could not run there. With one GPU, NCCL runs at world size 1: the multi-rank switch
# test and bench/reshard.py stay on gloo (CPU processes) until a multi-GPU machine is lent.
# Budget: every step has its own timeout; the whole script is meant to finish well under 10 minutes
# once the venvs exist (the installs come first and are cached in .venv-cuda / .venv-vllm-cuda).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
OUT="${GPU_CHECK_OUT:-runs/gpu_check}"
CUDA_VENV=.venv-cuda
VLLM_VENV=.venv-vllm-cuda
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
failed=()

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== [$name] (timeout ${limit}s): $*"
  [ "$DRY" = 1 ] && return 0
  if ! timeout "$limit" bash -c "$*"; then failed+=("$name"); echo "!! [$name] failed"; fi
}

step device 30 "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv"
# 1. venvs: CUDA torch from PyPI (its default x86_64 wheel is the CUDA build), vLLM (CUDA) in its own.
step venv-cuda 420 "[ -x $CUDA_VENV/bin/python ] || python3 -m venv $CUDA_VENV; $CUDA_VENV/bin/pip install -q torch && $CUDA_VENV/bin/pip install -q -e '.[test]' && $CUDA_VENV/bin/python -c 'import torch; assert torch.cuda.is_available(); print(torch.__version__, torch.cuda.get_device_name(0))'"
step venv-vllm 600 "[ -x $VLLM_VENV/bin/python ] || python3 -m venv $VLLM_VENV; $VLLM_VENV/bin/pip install -q vllm && $VLLM_VENV/bin/pip install -q -e '.[test]' && $VLLM_VENV/bin/python -c 'import vllm; print(vllm.__version__)'"
# 2. The exact rollout mode on the GPU: sampler vs trainer log-probs bit for bit (fp32, bf16, FSDP2 trainer).
step exact-cuda 300 "$CUDA_VENV/bin/python bench/exact_device.py --device cuda"
# 3. The demo's GRPO in bf16 on NCCL (one worker per GPU: trainer.n_gpus_per_node=1).
step demo-bf16-nccl 300 "$CUDA_VENV/bin/hybridflow demo --output-dir $OUT/demo trainer.device=cuda trainer.n_gpus_per_node=1 actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16 trainer.progress_bar=false"
# 4. The hybrid engine's bit-exact switch (every layout, N=2 and 4) and its bench (gloo processes).
step switch-bit-exact 300 "$CUDA_VENV/bin/python -m pytest -q -p no:cacheprovider tests/test_hybrid_engine.py -k 'bit_exact or wrong_plan'"
step bench-reshard 300 "$CUDA_VENV/bin/python bench/reshard.py --worlds 2 --repeats 2 --no-3d --json $OUT/reshard.json"
# 5. One vLLM (CUDA) GRPO run of 2 steps: rollout log-probs vs the trainer's.
step vllm-grpo 420 "$VLLM_VENV/bin/hybridflow demo --output-dir $OUT/vllm --rl-steps 2 trainer.device=cuda trainer.n_gpus_per_node=1 actor_rollout_ref.rollout.name=vllm trainer.progress_bar=false"
# 6. The tables.
step tables 30 "$CUDA_VENV/bin/python - <<'PY'
import json, pathlib
out = pathlib.Path('$OUT')
for name in ('demo', 'vllm'):
    p = out / name / 'summary.json'
    if p.exists():
        s = json.loads(p.read_text())
        print(f'{name:6s} val_acc_after_sft {s[\"val_acc_after_sft\"]:.3f} -> val_acc_final {s[\"val_acc_final\"]:.3f} in {s[\"wall_seconds\"]:.0f} s')
m = out / 'vllm' / 'grpo' / 'metrics.jsonl'
if m.exists():
    rows = [json.loads(l) for l in m.read_text().splitlines() if 'rollout/logprob_diff_max' in l]
    print('vllm rollout/logprob_diff_max per step:', [round(r['rollout/logprob_diff_max'], 6) for r in rows])
r = out / 'reshard.json'
if r.exists():
    for row in json.loads(r.read_text()):
        print(row)
PY"
if [ "$DRY" = 1 ]; then echo "dry run: nothing executed"; exit 0; fi
if [ ${#failed[@]} -gt 0 ]; then echo "gpu_check: FAILED steps: ${failed[*]}"; exit 1; fi
echo "gpu_check: all steps passed"
