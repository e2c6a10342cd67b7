#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh carries to the GPU machine, which reaches no package index: what
# hybridflow imports there and the image lacks (scripts/gpu_check/wheels.txt), as cp312 manylinux
# x86_64 or py3-none-any wheels for its Python 3.12, at the versions installed in the bootstrap venv
# (.venv: the ones CI tests; unpinned where .venv lacks one). Run here, where PyPI is reachable:
#
#   bash scripts/gpu_wheels.sh        # -> .gpu_wheels/ (ignored by git; the device tool carries it: carry [".gpu_wheels"])
#
# Prints every wheel with its size and the total, and fails when the total with the working tree
# (what the device tool copies) is not under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${GPU_WHEELS_DIR:-.gpu_wheels}"
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
LIMIT=$((64 * 1024 * 1024))

mapfile -t names < <(sed 's/#.*//' scripts/gpu_check/wheels.txt | tr -d ' \t' | grep -v '^$')
specs=()
for n in "${names[@]}"; do
  v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$n" 2>/dev/null || true)
  specs+=("${n}${v:+==$v}")
done
echo "[gpu_wheels] ${#specs[@]} wheels for Python 3.12 manylinux x86_64: ${specs[*]}" >&2
rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$DEST.tmp" "${specs[@]}"
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"

total=0
printf '%-72s %10s\n' wheel MiB
for f in "$DEST"/*.whl; do
  size=$(stat -c %s "$f"); total=$((total + size))
  printf '%-72s %10.2f\n' "$(basename "$f")" "$(awk "BEGIN {print $size / 1048576}")"
done
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
printf '%-72s %10.2f\n' "total ($(ls "$DEST"/*.whl | wc -l) wheels)" "$(awk "BEGIN {print $total / 1048576}")"
printf '%-72s %10.2f\n' "the working tree the device tool copies with them" "$(awk "BEGIN {print $tree / 1048576}")"
printf '%-72s %10.2f\n' "together (the limit: 64 MiB)" "$(awk "BEGIN {print ($total + $tree) / 1048576}")"
if [ $((total + tree)) -ge "$LIMIT" ]; then echo "[gpu_wheels] over the 64 MiB the device tool carries" >&2; exit 1; fi
