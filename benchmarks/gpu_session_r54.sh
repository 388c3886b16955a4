#!/usr/bin/env bash
# GPU steps of the fifty-fourth session (outputs in $OUT/r54/, packed into $OUT/r54_STEP.tar).
# FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
#
#   bash benchmarks/gpu_session_r54.sh verify 560   # any sm90 card: the decode, subclass and
#                    # spec-function GPU tests (the latter corrected after their first H100 run),
#                    # then the host table with the rest of the budget
#   bash benchmarks/gpu_session_r54.sh flash 480   # (FA4 installed) ALiBi and SquaredDistance on
#                    # flex / flex_flash after the per-head where fix, the subclass GPU tests, then
#                    # every family's examples on flex_flash (tests/gpu/test_examples_flex_routes_gpu.py)
#   bash benchmarks/gpu_session_r54.sh band2 300   # (FA4 installed; on an H200) the two band cases
#                    # fa4rows did not reach in its time budget, into generalization_h200.json
#   bash benchmarks/gpu_session_r54.sh STEP BUDGET  # any step of gpu_session_r51.sh (fa4rows,
#                    # tests) under this session's name
set -uo pipefail
step="${1:?usage: $0 verify|flash|STEP-of-gpu_session_r51.sh [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r54
if [ "$step" != verify ] && [ "$step" != flash ] && [ "$step" != band2 ]; then
  SESSION=$session EXTRA_GPU_TESTS="tests/gpu/test_spec_functions_probed_gpu.py" \
    exec bash benchmarks/gpu_session_r51.sh "$step" "$budget"
fi
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here
if [ "$step" = band2 ]; then
  cp benchmarks/results/generalization_h200.json "$out/generalization_h200.json"
  run "generalization_band2_${gpu}_${session}" "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
    --resume --rerun --out "$out/generalization_h200.json" --cases llama32_3b_l2048_b4,gemma3_27b_l4096_b1 \
    --routes auto,auto_tuned,plain_sdpa,sdpa,sdpa_cudnn,sdpa_flash,flex,flex_flash,fa4 \
    --md "$out/generalization_band2_${gpu}_${session}.md" --quiet --time-budget "$(( $(left) - 40 ))"
  pack
  ls -la "$out"
  exit 0
fi
if [ "$step" = flash ]; then
  run "flex_flash_alibi_probe_${gpu}_${session}_after" "$(share 30)" python3 benchmarks/flex_flash_alibi_probe.py
  run "gpu_tests_subclassed_${gpu}_${session}_after" "$(share 20)" python3 -m pytest -m gpu -q -rfE \
    -p no:cacheprovider -n 4 tests/gpu/test_subclassed_specs_gpu.py
  run "gpu_tests_examples_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m pytest -m gpu -q -rfE \
    -p no:cacheprovider -n 6 tests/gpu/test_examples_flex_routes_gpu.py -k flex_flash
  pack
  ls -la "$out"
  exit 0
fi
run "gpu_tests_decode_${gpu}_${session}" "$(share 40)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 4 \
  tests/gpu/test_decode_gpu.py tests/gpu/test_subclassed_specs_gpu.py tests/gpu/test_spec_functions_probed_gpu.py
run "host_cost_${gpu}_${session}" "$(( $(left) - 5 ))" python3 benchmarks/host_cost.py --device cuda \
  --out "$out/host_cost_${gpu}_${session}.md"
pack
ls -la "$out"
