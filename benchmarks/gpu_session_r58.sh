#!/usr/bin/env bash
# GPU steps of the fifty-eighth session (outputs in $OUT/r58/, packed into $OUT/r58_STEP.tar).
# FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
#
#   bash benchmarks/gpu_session_r58.sh verify 200   # (FA4 installed) the strided (dilated) layout's
#                    # GPU tests on fa4 and the SDPA routes, the fullgraph dilated case, the zoo
#                    # family test of the dilated preset, the draft tree on sdpa_split
#   bash benchmarks/gpu_session_r58.sh dilated 150  # (FA4 installed) the README's dilated command in one
#                    # process: both modes on auto, hand-written flex, flex_flash and fa4
#   bash benchmarks/gpu_session_r58.sh tree 150     # (FA4 installed) the draft-tree case on every route that
#                    # runs it (its new split form on sdpa_split among them), one process
#   bash benchmarks/gpu_session_r58.sh zoo 560      # (FA4 installed) every zoo case on auto and
#                    # hand-written flex into /root/zoo_GPU_r58.json (kept while the machine is warm:
#                    # a second call resumes it); CASES / ROUTES override the cases and routes
#   bash benchmarks/gpu_session_r58.sh zoonofa4 560 # the same with FA4 hidden (--no-fa4)
set -uo pipefail
step="${1:?usage: $0 verify|dilated|tree|zoo|zoonofa4 [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r58
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here
case "$step" in
  verify)
    run "gpu_tests_strided_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m pytest -m gpu -q -rfE \
      -p no:cacheprovider -n 4 tests/gpu/test_routes_gpu.py tests/gpu/test_compile_gpu.py \
      tests/gpu/test_zoo_gpu.py -k "${TESTK:-dilated or residue_classes or fa4_layouts or split_tree}"
    ;;
  dilated)
    run "zoo_dilated_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench zoo \
      --routes auto,raw_flex,flex_flash,fa4 --cases zoo_dilated_sliding_window \
      --out "$out/zoo_dilated_${gpu}_${session}.json" --md "$out/zoo_dilated_${gpu}_${session}.md" --quiet \
      --time-budget "$(( $(left) - 35 ))"
    ;;
  tree)
    run "zoo_tree_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench zoo \
      --routes auto,raw_flex,flex,flex_flash,sdpa_split --cases zoo_tree,zoo_tree_verify \
      --out "$out/zoo_tree_${gpu}_${session}.json" --md "$out/zoo_tree_${gpu}_${session}.md" --quiet \
      --time-budget "$(( $(left) - 35 ))"
    ;;
  zoo) zoo_sweep "" ;;
  zoonofa4) zoo_sweep "-nofa4" --no-fa4 ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
