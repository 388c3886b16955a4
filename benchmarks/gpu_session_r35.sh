#!/usr/bin/env bash
# GPU steps the thirty-second session could not reach (its device time went to gpu_session_r34.sh
# and to diagnosing a recompile). One step per argument, under its own time limit; outputs go into
# $OUT/r35/, packed into $OUT/r35_STEP.tar after every sub-step.
#
#   bash benchmarks/gpu_session_r35.sh compile 560  # the flex routes' repeated unguarded calls
#                                                   # (autocast included), every GPU compile test
#                                                   # (fullgraph per route included), then the soak
#                                                   # at its default size
#   bash benchmarks/gpu_session_r35.sh fa4 560      # (FA4 installed) flex_flash's route tests,
#                                                   # repeated unguarded calls included, and the
#                                                   # compile tests that need FA4, then the
#                                                   # soak at its default size
set -uo pipefail
step="${1:?usage: $0 compile|fa4 [BUDGET_S]}"
budget="${2:-300}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r35
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  compile)
    run gpu_tests_unguarded_r35 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
      tests/gpu/test_routes_gpu.py -k "unguarded or self_attention_then"
    run gpu_tests_compile_r35 "$(( $(left) * 3 / 5 ))" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
      tests/gpu/test_compile_gpu.py
    FLEXATTN_ZOO_SOAK_SUMMARY="$out/soak_r35.json" run gpu_tests_soak_r35 "$(( $(left) - 5 ))" \
      python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_soak_gpu.py
    ;;
  fa4)
    run gpu_tests_flex_flash_r35 "$(( $(left) / 2 ))" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
      tests/gpu/test_routes_gpu.py -k flex_flash
    run gpu_tests_compile_fa4_r35 "$(( $(left) / 3 ))" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
      tests/gpu/test_compile_gpu.py -k "fa4 or flex_flash"
    FLEXATTN_ZOO_SOAK_SUMMARY="$out/soak_fa4_r35.json" run gpu_tests_soak_fa4_r35 "$(( $(left) - 5 ))" \
      python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_soak_gpu.py
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
