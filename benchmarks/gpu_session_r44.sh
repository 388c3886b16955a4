#!/usr/bin/env bash
# GPU steps of the forty-fourth session. One step per argument, under its own time limit; outputs go
# into $OUT/r44/ (names carry the card, `$gpu` from gpu_session_lib.sh), packed into $OUT/r44_STEP.tar
# after every sub-step. FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh
# session).
#
#   bash benchmarks/gpu_session_r44.sh d256tests 280  # (FA4 installed) flex_flash at head dim 256
#                    # (64-key BlockMask blocks) against float64, the route coverage test, the
#                    # planning tests of the block sizes
#   bash benchmarks/gpu_session_r44.sh d256rows 420   # (FA4 installed) the head-dim-256 cases of
#                    # the generalization sweep on auto, flex, flex_flash, fa4 and hand-written
#                    # flex, and gemma2_d256 of h200.yaml, into fresh files named by the card
#   bash benchmarks/gpu_session_r44.sh host 200       # the host table, then the decode probe that
#                    # takes the SDPA route's decode call apart (sdpa_decode_host_probe.py)
#   bash benchmarks/gpu_session_r44.sh warmfix 240    # (no FA4) after the warm-up fix: auto,
#                    # auto_tuned, sdpa and plain SDPA on a decode case and two short cases
set -uo pipefail
step="${1:?usage: $0 d256tests|d256rows|host|warmfix [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r44
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

D256_CASES=gemma2_9b_local_softcap_l8192_d256,gemma2_2b_global_softcap_l4096_d256,gemma3_4b_local1024_l8192_d256,paligemma_prefix256_l1024_b4_d256,gemma3_4b_global_l8192_d256

case "$step" in
  d256tests)
    run "gpu_tests_flex_flash_d256_${gpu}_r44" "$(( $(left) - 5 ))" python3 -m pytest -q -rfE \
      -p no:cacheprovider -n 4 tests/unit/test_flex_flash_blocks.py tests/gpu/test_routes_gpu.py \
      -k "head_dim or route_coverage or block"
    ;;
  d256rows)
    run "generalization_d256_${gpu}_r44" "$(share 70)" python3 -m flexattn_zoo.bench generalization \
      --out "$out/generalization_d256_${gpu}.json" --routes auto,flex,flex_flash,fa4,raw_flex \
      --cases "$D256_CASES" --md "$out/generalization_d256_${gpu}_r44.md" --quiet --time-budget "$(share 62)"
    run "h200_gemma2_d256_${gpu}_r44" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench h200 \
      --out "$out/h200_gemma2_d256_${gpu}.json" --routes auto,flex,flex_flash,fa4 --cases gemma2_d256 \
      --md "$out/h200_gemma2_d256_${gpu}_r44.md" --quiet --time-budget "$(( $(left) - 40 ))"
    ;;
  host)
    run "host_cost_${gpu}_r44" "$(share 70)" python3 benchmarks/host_cost.py --device cuda \
      --out "$out/host_cost_${gpu}_r44.md"
    run "sdpa_decode_host_probe_${gpu}_r44" "$(( $(left) - 5 ))" python3 benchmarks/sdpa_decode_host_probe.py --device cuda
    ;;
  warmfix)
    run "generalization_warmfix_${gpu}_r44" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench generalization \
      --no-fa4 --out "$out/generalization_warmfix_${gpu}-nofa4.json" --routes auto,auto_tuned,sdpa,plain_sdpa \
      --cases decode_llama3_70b_b8_4k,bert_base_l128_b128,llama32_3b_l2048_b4 \
      --md "$out/generalization_warmfix_${gpu}_r44.md" --quiet --time-budget "$(( $(left) - 40 ))"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
