#!/usr/bin/env bash
# GPU steps for the unguarded flex graphs (flex bound calls and fz.decode's planned flex steps run
# the graph Dynamo compiled for them without Dynamo's frame evaluation and guards). One step per
# argument, under its own time limit; outputs go into $OUT/r34/, packed into $OUT/r34_STEP.tar
# after every sub-step.
#
#   bash benchmarks/gpu_session_r34.sh tests 560  # the flex routes' GPU tests (repeated calls
#                                                 # forward and backward through the unguarded
#                                                 # graph), decode, compile and the soak
#   bash benchmarks/gpu_session_r34.sh ab 420     # host layers of this tree and of e780b64 (before
#                                                 # the change) alternately on one host; ab_old/
#                                                 # made beforehand by: mkdir ab_old && git archive
#                                                 # e780b64 flexattn_zoo masks score_mods
#                                                 # benchmarks/host_layers_probe.py | tar -x -C ab_old
#   bash benchmarks/gpu_session_r34.sh fa4 480    # (FA4 installed) flex_flash's GPU route tests
set -uo pipefail
step="${1:?usage: $0 tests|ab|fa4 [BUDGET_S]}"
budget="${2:-300}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r34
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  tests)
    run gpu_tests_unguarded_r34 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/gpu/test_routes_gpu.py -k "unguarded or (flex and not flex_flash)"
    run gpu_tests_decode_compile_r34 "$(( $(left) - 150 ))" python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/gpu/test_decode_gpu.py tests/gpu/test_compile_gpu.py -x
    run gpu_tests_soak_r34 "$(( $(left) - 5 ))" python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/gpu/test_soak_gpu.py -x
    ;;
  ab)
    for round in 1 2; do
      for tree in ab_old .; do
        echo "## $tree (round $round)" >> "$out/ab_host_h200_r34.txt"
        (cd "$tree" && PYTHONPATH=$PWD timeout 100 python3 benchmarks/host_layers_probe.py --device cuda --rounds 15 \
          | grep -E "flex:|sdpa:|dispatcher: fz.attention, no-op|decode: " >> "$out/ab_host_h200_r34.txt")
      done
    done
    ;;
  fa4)
    run gpu_tests_flex_flash_r34 "$(( $(left) - 5 ))" python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/gpu/test_routes_gpu.py -k flex_flash -x
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
