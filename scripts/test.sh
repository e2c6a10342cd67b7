#!/usr/bin/env bash
# The test suite: .venv's tests on two pytest-xdist workers, and beside them the vLLM backend's tests
# in .venv-vllm (built first, also beside them; set HYBRIDFLOW_SKIP_VLLM=1 to skip those). One
# stream of tests keeps both cores busy only ~85% of the time (process start-up, driver-side work);
# two workers (a file's tests on one) and the vLLM half fill the gaps (docs/testing.md). Both halves always run, so a
# failure in one does not hide the other; the exit status is non-zero if either failed.
#
#   bash scripts/test.sh                  # everything (what CI runs)
#   bash scripts/test.sh --fast           # the fast tier: no Ray, torchrun or process groups (docs/results.md)
#   bash scripts/test.sh tests/x.py ...   # those files, each in the venv it needs (-k etc. pass through)
#   HYBRIDFLOW_TEST_WORKERS=0 bash scripts/test.sh tests/x.py --pdb   # one process (for --pdb, -x, print debugging)
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh || exit 1
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
PY="${HYBRIDFLOW_VENV:-.venv}/bin/python"
VPY="${HYBRIDFLOW_VLLM_VENV:-.venv-vllm}/bin/python"
WORKERS="${HYBRIDFLOW_TEST_WORKERS:-2}"

fast=0; main_files=(); vllm_files=(); opts=()
for a in "$@"; do
  case "$a" in
    --fast) fast=1 ;;
    tests/*.py|tests/*.py::*)
      if grep -q "pytest.mark.vllm" "${a%%::*}" 2>/dev/null; then vllm_files+=("$a"); else main_files+=("$a"); fi ;;
    *) opts+=("$a") ;;
  esac
done
any_files=$(( ${#main_files[@]} + ${#vllm_files[@]} ))

if [ "$fast" = 1 ]; then
  exec "$PY" -m pytest -q -p no:cacheprovider -m "not slow and not vllm" "${main_files[@]}" "${opts[@]}"
fi

mkdir -p runs
vllm_half() {  # build .venv-vllm (niced: ~2 minutes of pip on a fresh machine), then run its tests; all output to the log
  nice -n 15 bash scripts/bootstrap_vllm.sh || { echo "[test.sh] could not set up .venv-vllm"; return 1; }
  "$VPY" -c "import vllm, hybridflow" || { echo "[test.sh] .venv-vllm cannot import vllm: the vLLM tests fail, they do not skip"; return 1; }
  # only the files that hold vLLM tests: collecting the other ~900 there would import them all for nothing
  [ ${#vllm_files[@]} -gt 0 ] || mapfile -t vllm_files < <(grep -l "pytest.mark.vllm" tests/*.py)
  "$VPY" -m pytest -q -p no:cacheprovider --basetemp="${TMPDIR:-/tmp}/hybridflow-tests-vllm" --durations=5 -m vllm \
    "${vllm_files[@]}" "${opts[@]}"
}

vllm_note=""
if [ "${HYBRIDFLOW_SKIP_VLLM:-0}" = "1" ]; then
  vllm_note=" (skipped: HYBRIDFLOW_SKIP_VLLM=1)"
elif [ "$any_files" = 0 ] || [ ${#vllm_files[@]} -gt 0 ]; then
  vllm_half > runs/test_vllm.log 2>&1 &
  vllm_pid=$!
else
  vllm_note=" (no vLLM file asked for)"
fi

main_rc=0
if [ "$any_files" = 0 ] || [ ${#main_files[@]} -gt 0 ]; then
  "$PY" -m pytest -q -p no:cacheprovider -n "$WORKERS" --dist loadfile --durations=15 -m "not vllm" "${main_files[@]}" "${opts[@]}"
  main_rc=$?
fi
vllm_rc=0
if [ -n "${vllm_pid:-}" ]; then
  wait "$vllm_pid"
  vllm_rc=$?
  echo "[test.sh] the vLLM half (ran beside the tests above; runs/test_vllm.log):"
  cat runs/test_vllm.log
fi
echo "[test.sh] main half: exit $main_rc; vLLM half: exit $vllm_rc$vllm_note" >&2
[ "$main_rc" -eq 0 ] && [ "$vllm_rc" -eq 0 ]
