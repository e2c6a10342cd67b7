#!/usr/bin/env bash
# The GPU check, prepared for the GPU machine the device tool lends (one GPU; its own image: Python
# 3.12, torch 2.11 + cu130, transformers 5.17, peft, accelerate, pyarrow, pytest; no Ray, no vLLM,
# no package index; 64 MiB of files brought along; 15 minutes of machine time, 10 per command).
# Nothing is installed from an index: what the image lacks travels as wheels (scripts/gpu_wheels.sh,
# into .gpu_wheels/, an ignored folder carried with the working tree) and is installed into a
# folder on PYTHONPATH; hybridflow itself runs from the checkout, through torchrun (no Ray).
#
#   bash scripts/gpu_wheels.sh                       # here, once (needs PyPI): the wheels, their sizes and total
#   GPU_CHECK_OUT=$OUT/gpu_check bash scripts/gpu_check.sh    # on the GPU machine (device tool: carry [".gpu_wheels"], timeout_s 540)
#   bash scripts/gpu_check.sh --dry-run              # the plan and the GPU shapes; runs nothing (CI, fast tier)
#   bash scripts/gpu_check.sh --device cpu           # the CPU rehearsal: every step on CPU with tiny shapes, in the
#                                                    # bootstrap venv with only the image's and the carried packages
#                                                    # importable (scripts/gpu_check/); CI runs it (tests/test_gpu_check.py)
#   bash scripts/gpu_check.sh --device cpu --image PY    # the same steps with another Python as the image's (e.g. a
#                                                    # venv of torch 2.11 + transformers 5.17 only): wheels installed as on the GPU
#
# Steps, each with its own timeout, all within GPU_CHECK_BUDGET_S (default 420 s: a step's timeout is
# cut to what is left of it, so the check ends well within 8 minutes of the machine's start):
#   device  the card (nvidia-smi) or the CPU
#   wheels  the carried wheels installed (pip --no-index --no-deps --target) into a folder on PYTHONPATH
#   env     versions; hybridflow's trainer imports; Ray and vLLM are not importable
#   demo    the demo through torchrun on 1 GPU, GRPO in bf16: held-out accuracy after SFT -> final, seconds
#   grpo    bench/grpo_device.py: the card's bf16 matmul peak, then a GRPO step of a SmolLM2-135M- and a
#           Qwen2.5-0.5B-shaped model (random weights): gen / log-probs / update / switch seconds, tokens/s,
#           MFU; the switch (NCCL, world size 1) checked bit-exact with the trainer's weights every step
#   exact   bench/exact_device.py: the exact rollout mode's sampler vs the trainer, bit for bit (fp32, bf16)
#   tables  one table per step's result, then the steps' status and seconds (what docs quote)
# Status: the dry run and the CPU rehearsal run in CI; the whole script has NOT yet run on a GPU
# (bench/exact_device.py alone ran on an H200 on 2026-12-04: docs/hybrid_engine.md).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0; DEVICE=cuda; IMAGE_PY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --device) DEVICE=${2:-}; shift ;;
    --device=*) DEVICE=${1#*=} ;;
    --image) IMAGE_PY=${2:-}; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (--dry-run, --device cuda|cpu, --image PYTHON)" >&2; exit 2 ;;
  esac
  shift
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check.sh: --device cuda or cpu, not '$DEVICE'" >&2; exit 2 ;; esac
OUT="${GPU_CHECK_OUT:-runs/gpu_check}"
WHEELS="${GPU_WHEELS_DIR:-.gpu_wheels}"
BUDGET="${GPU_CHECK_BUDGET_S:-420}"
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ "$DEVICE" = cuda ] || [ -n "$IMAGE_PY" ]; then
  # as on the GPU machine: the image's Python (its torch, transformers) with the carried wheels installed
  # into a folder on PYTHONPATH and hybridflow from the checkout
  MODE=image
  PY="${IMAGE_PY:-$(command -v python3 || command -v python)}"
  SITE="${TMPDIR:-/tmp}/hybridflow-gpu-site"     # not under $OUT: that comes back from the device tool
  export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  # the rehearsal in the bootstrap venv: only the image's and the carried distributions importable (scripts/gpu_check/)
  MODE=filter
  PY=.venv/bin/python
  SITE="${TMPDIR:-/tmp}/hybridflow-gpu-site-rehearsal"  # the install is rehearsed for Python 3.12, not imported
  if [ "$DRY" = 0 ]; then
    HYBRIDFLOW_HIDE_MODULES=$("$PY" scripts/gpu_check/hidden.py modules) || exit 1
    HYBRIDFLOW_HIDE_DISTS=$("$PY" scripts/gpu_check/hidden.py dists) || exit 1
    export HYBRIDFLOW_HIDE_MODULES HYBRIDFLOW_HIDE_DISTS
    export PYTHONPATH="$ROOT/scripts/gpu_check:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
if [ "$DEVICE" = cuda ]; then
  DEMO_ARGS=""; GRPO_ARGS=""; EXACT_ARGS=""
else  # tiny shapes and few steps: the rehearsal takes well under 2 minutes
  DEMO_ARGS="--sft-steps 60 --rl-steps 3"; GRPO_ARGS="--tiny"; EXACT_ARGS="--quick --tokens 8"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
TORCHRUN="$PY -m torch.distributed.run --standalone --nproc_per_node=1"
START=$(date +%s)
results=()  # name|status|seconds|limit
failed=()

step() {  # step NAME TIMEOUT_S COMMAND: run it under its timeout (cut to the budget left), log to $OUT/logs/NAME.log
  local name=$1 limit=$2 cmd=$3
  echo "== [$name] (timeout ${limit}s): $cmd"
  [ "$DRY" = 1 ] && return 0
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then
    echo "!! [$name] skipped: ${left}s left of the ${BUDGET}s budget"; results+=("$name|skipped|0|$limit"); failed+=("$name"); return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0 rc ms secs; t0=$(date +%s%N)
  timeout --kill-after=10 "$limit" bash -c "$cmd" 2>&1 | tee "$OUT/logs/$name.log"
  rc=${PIPESTATUS[0]}
  ms=$(( ($(date +%s%N) - t0) / 1000000 )); secs="$((ms / 1000)).$(( (ms % 1000) / 100 ))"
  if [ "$rc" = 0 ]; then results+=("$name|ok|$secs|$limit")
  else
    local why="exit $rc"; [ "$rc" = 124 ] || [ "$rc" = 137 ] && why="timeout"
    results+=("$name|FAILED ($why)|$secs|$limit"); failed+=("$name"); echo "!! [$name] failed ($why)"
  fi
}

if [ "$DRY" = 0 ]; then mkdir -p "$OUT/logs"; fi
echo "gpu_check: device $DEVICE, python $PY ($MODE), out $OUT, budget ${BUDGET}s"

if [ "$DEVICE" = cuda ]; then
  step device 20 "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv"
else
  step device 20 "$PY -c 'import os, torch; print(\"CPU:\", os.cpu_count(), \"cores; torch\", torch.__version__, \"threads\", torch.get_num_threads())'"
fi
if [ "$MODE" = image ]; then
  # pip from no index; where the image's Python has no pip, the wheels (no .data parts) are unzipped instead
  step wheels 60 "rm -rf '$SITE' && mkdir -p '$SITE' && ls -l '$WHEELS'/*.whl && { $PY -m pip install -q --no-index --no-deps --disable-pip-version-check --target '$SITE' '$WHEELS'/*.whl || $PY -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' '$SITE' '$WHEELS'/*.whl; } && echo installed into $SITE"
else
  # the same install for the image's Python 3.12 (manylinux x86_64), into a folder that is not imported here
  step wheels 60 "if ls '$WHEELS'/*.whl >/dev/null 2>&1; then ls -l '$WHEELS'/*.whl && rm -rf '$SITE' && $PY -m pip install -q --no-index --no-deps --disable-pip-version-check --target '$SITE' --python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --only-binary=:all: '$WHEELS'/*.whl && echo installed for Python 3.12: \$(ls '$SITE' | wc -l) entries; else echo 'no $WHEELS/ here (bash scripts/gpu_wheels.sh makes it): the install is not rehearsed, the package set is (scripts/gpu_check/)'; fi"
fi
step env 60 "$PY scripts/gpu_check/env_check.py --device $DEVICE"
step demo 180 "$TORCHRUN examples/train_ppo.py --output-dir $OUT/demo $DEMO_ARGS trainer.device=$DEVICE actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16 trainer.progress_bar=false"
step grpo 240 "$TORCHRUN bench/grpo_device.py --device $DEVICE $GRPO_ARGS --json $OUT/grpo.json"
step exact 150 "$PY bench/exact_device.py --device $DEVICE $EXACT_ARGS"
step tables 30 "$PY scripts/gpu_check/tables.py $OUT"

if [ "$DRY" = 1 ]; then
  echo "the grpo step's shapes on $DEVICE (bench/grpo_device.py --print-plan $GRPO_ARGS):"
  DRY_PY=$PY; [ -x .venv/bin/python ] && DRY_PY=.venv/bin/python  # hybridflow's config layer (omegaconf): the bootstrap venv where there is one
  PYTHONPATH="$ROOT" "$DRY_PY" bench/grpo_device.py --print-plan $GRPO_ARGS | sed 's/^/  /' || echo "  (bench/grpo_device.py --print-plan failed)"
  echo "dry run: nothing executed"; exit 0
fi
total=$(( $(date +%s) - START ))
{
  echo ""
  echo "gpu_check on $DEVICE: steps (seconds within the ${BUDGET}s budget)"
  printf '%-8s %-18s %8s %8s\n' step status seconds timeout
  for r in "${results[@]}"; do IFS='|' read -r n s t l <<< "$r"; printf '%-8s %-18s %8s %8s\n' "$n" "$s" "$t" "$l"; done
  printf '%-8s %-18s %8s\n' total "" "$total"
} | tee "$OUT/steps.txt"
if [ ${#failed[@]} -gt 0 ]; then echo "gpu_check: FAILED steps: ${failed[*]}"; exit 1; fi
echo "gpu_check: all steps passed"
