#!/usr/bin/env bash
# GPU steps prepared for the fiftieth session: `decode` here; every other step is
# gpu_session_r48.sh's (see its header), run with this session's name on its outputs ($OUT/r50/).
#
#   bash benchmarks/gpu_session_r50.sh decode 400   # the decode GPU tests and those of presets'
#                    # subclasses with their own functions, decode steps under a
#                    # 4096 window on every route (the flex step's block list is read on the host
#                    # since the forty-ninth session: not measured on a GPU yet), a cProfile of the decode steps
#                    # (host_profile_probe.py --decode) and of the default pairs, the host table
#   bash benchmarks/gpu_session_r50.sh STEP BUDGET  # any step of gpu_session_r48.sh
set -uo pipefail
step="${1:?usage: $0 decode|STEP-of-gpu_session_r48.sh [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "$step" != decode ]; then
  SESSION=r50 exec bash benchmarks/gpu_session_r48.sh "$@"
fi
session=r50
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

run "gpu_tests_decode_${gpu}_r50" "$(share 35)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 4 \
  tests/gpu/test_decode_gpu.py tests/gpu/test_subclassed_specs_gpu.py
run "decode_window_${gpu}_r50" "$(share 30)" python3 benchmarks/decode_bench.py --window 4096 \
  --lens 32768 --batch 1,8,32 --routes decode_int,sdpa,flex,flex_graph \
  --md "$out/decode_window_${gpu}_r50.md" --json "$out/decode_window_${gpu}_r50.json"
run "host_profile_decode_${gpu}_r50" "$(share 12)" python3 benchmarks/host_profile_probe.py --device cuda \
  --decode --calls 2000 --top 35
run "host_profile_${gpu}_r50" "$(share 8)" python3 benchmarks/host_profile_probe.py --device cuda --calls 2000 --top 35
run "host_cost_${gpu}_r50" "$(( $(left) - 5 ))" python3 benchmarks/host_cost.py --device cuda \
  --out "$out/host_cost_${gpu}_r50.md"
pack
ls -la "$out"
