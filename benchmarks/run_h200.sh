#!/usr/bin/env bash
# Regenerate the H200 benchmark results from flexattn_zoo/bench/configs/h200.yaml (the sweep ships
# as package data; benchmarks/configs links there in a checkout).
#
#   benchmarks/run_h200.sh [fa4|nofa4] [flexattn_zoo.bench options...]
#
#   fa4   (default) -> benchmarks/results/h200.{json,md,log} + h200-{fwd,fwdbwd}.png
#                      needs flash-attn-4 (flash_attn.cute) importable: the flex_flash route.
#   nofa4           -> benchmarks/results/h200-nofa4.*: same sweep with flash_attn.cute hidden
#                      (--no-fa4), i.e. what a user without FA4 gets from auto.
#
# Files are written into $OUT when it is set (the device tool brings back only $OUT), then copied
# into benchmarks/results/. Rows are saved after every route, so a run stopped at a time limit
# keeps what it measured. To split the sweep over several calls, give a budget and resume:
#
#   benchmarks/run_h200.sh fa4 --time-budget 480            # exit code 3: not finished
#   (copy $OUT/h200.json back to benchmarks/results/ so it travels with the tree)
#   benchmarks/run_h200.sh fa4 --time-budget 480 --resume   # continues from benchmarks/results/h200.json
#
# Other useful options: --cases causal,document_causal  --routes auto,flex  --modes fwd  --iters 10
# Environment: PYTHON (default python3); FLEXATTN_ZOO_GIT=<commit> to record the commit when the
# tree travels without .git. The whole nofa4 sweep took 6.5 minutes on an H200 (torch 2.11); FA4 adds
# its compiles, so on a 10-minute command limit pass --time-budget 480 and --resume as above.
set -euo pipefail

variant="${1:-fa4}"
[ "$#" -gt 0 ] && shift
case "$variant" in
  fa4) name=h200; extra=() ;;
  nofa4) name=h200-nofa4; extra=(--no-fa4) ;;
  *) echo "usage: $0 [fa4|nofa4] [flexattn_zoo.bench options...]" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
results="$root/benchmarks/results"
dest="${OUT:-$results}"
mkdir -p "$dest" "$results"

# Make this checkout importable without the network: the package maps masks/ and score_mods/ to
# flexattn_zoo.masks / flexattn_zoo.score_mods, which a link farm on PYTHONPATH reproduces (an
# editable pip install would need setuptools' build backend on that machine).
if ! "$py" -c "import flexattn_zoo.masks" 2>/dev/null; then
  shim="$(mktemp -d)/site"
  mkdir -p "$shim/flexattn_zoo"
  for f in "$root"/flexattn_zoo/*; do ln -s "$f" "$shim/flexattn_zoo/"; done
  ln -s "$root/masks" "$shim/flexattn_zoo/masks"
  ln -s "$root/score_mods" "$shim/flexattn_zoo/score_mods"
  export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
  "$py" -c "import flexattn_zoo.masks" || { echo "error: cannot import flexattn_zoo from $root" >&2; exit 1; }
fi
if [ "$variant" = fa4 ] && ! "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('flash_attn.cute') is None)"; then
  echo "error: the fa4 run needs flash-attn-4 (flash_attn.cute) importable; install it or run '$0 nofa4'" >&2
  exit 1
fi

for arg in "$@"; do
  if [ "$arg" = --resume ] && [ ! -f "$dest/$name.json" ] && [ -f "$results/$name.json" ]; then
    cp "$results/$name.json" "$dest/$name.json"
  fi
done
png=()
if "$py" -c "import matplotlib" 2>/dev/null; then png=(--png "$dest/$name"); fi

export FLEXATTN_ZOO_BENCH_COMMAND="benchmarks/run_h200.sh $variant${*:+ $*}"
export PYTHONUNBUFFERED=1
set +e
"$py" -m flexattn_zoo.bench flexattn_zoo/bench/configs/h200.yaml --out "$dest/$name.json" --md "$dest/$name.md" \
  ${png[@]+"${png[@]}"} ${extra[@]+"${extra[@]}"} "$@" 2>&1 | tee "$dest/$name.log"
rc=${PIPESTATUS[0]}
set -e

if [ "$(cd "$dest" && pwd)" != "$results" ]; then
  cp "$dest/$name".* "$results/" 2>/dev/null || true
  cp "$dest/$name"-*.png "$results/" 2>/dev/null || true
fi
echo "exit code $rc; results in $dest/$name.{json,md}" >&2
exit "$rc"
