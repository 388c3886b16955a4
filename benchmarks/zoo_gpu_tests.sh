#!/usr/bin/env bash
# tests/gpu/test_zoo_gpu.py (every registered family vs float64 on auto, flex and flex_flash) as
# three parallel pytest processes, one per route group (correctness only, nothing is timed, so
# sharing the GPU is harmless; the flex_flash compiles are CPU-bound), and write $OUT/NAME.txt.
#
#   OUT=$OUT benchmarks/zoo_gpu_tests.sh gpu_zoo_fa4          # FA4 importable (PYTHONPATH)
#   OUT=$OUT K="sigmoid or relu" benchmarks/zoo_gpu_tests.sh gpu_zoo_nofa4_new
#
# Environment: OUT (default benchmarks/results), TEST_TIMEOUT seconds per process (default 300),
# K: an extra pytest -k expression ANDed with each group's.
set -uo pipefail
name="${1:?usage: $0 NAME}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/benchmarks/results}"
limit="${TEST_TIMEOUT:-300}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-$root}" PYTHONUNBUFFERED=1
logs="$(mktemp -d)"
start=$(date +%s)
extra="${K:+ and ($K)}"
# test_every_family_runs_somewhere reads what the flex tests of its own process ran.
declare -A groups=(
  [auto]="auto$extra"
  [flex]="(flex and not flex_flash and not auto or every_family)$extra"
  [flex_flash]="flex_flash$extra"
)
for g in auto flex flex_flash; do
  ( timeout "$limit" python3 -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider \
      tests/gpu/test_zoo_gpu.py -k "${groups[$g]}" >"$logs/$g.log" 2>&1; echo $? >"$logs/$g.rc" ) &
done
wait
{
  echo "# tests/gpu/test_zoo_gpu.py on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  python3 -c "import importlib.util as u; print('# FA4', 'importable' if u.find_spec('flash_attn') and u.find_spec('flash_attn.cute') else 'not importable')" 2>/dev/null
  echo "# command: benchmarks/zoo_gpu_tests.sh $name (K=${K:-}; 3 processes, $(( $(date +%s) - start )) s wall)"
  for g in auto flex flex_flash; do
    echo; echo "## -k \"${groups[$g]}\" (exit $(cat "$logs/$g.rc"))"; cat "$logs/$g.log"
  done
} >"$out/$name.txt"
tail -n 3 "$logs"/*.log
