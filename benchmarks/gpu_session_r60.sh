#!/usr/bin/env bash
# GPU steps of the sixtieth session (outputs in $OUT/r60/, packed into $OUT/r60_STEP.tar).
# FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
#
#   bash benchmarks/gpu_session_r60.sh zoonofa4 560 # FA4 hidden: every zoo case on auto and
#                    # hand-written flex into /root/zoo_GPU-nofa4_r60.json (a second call resumes it,
#                    # as does a fresh machine from benchmarks/results/ when that card's file is there)
#   bash benchmarks/gpu_session_r60.sh gw 560       # (FA4 installed) global tokens on fa4: the GPU
#                    # tests, then the global-window case beside the same window alone on fa4
#                    # (benchmarks/global_tokens_bound.yaml: the path's floor); TESTS_S: the tests'
#                    # seconds (default 35% of the budget)
#   bash benchmarks/gpu_session_r60.sh rerun 560    # (FA4 installed) the D=64 global-window case on
#                    # auto, hand-written flex, flex_flash and fa4; the zoo's Graphormer, NATTEN and
#                    # T5 rows (last measured many sessions ago) on auto and hand-written flex
#   bash benchmarks/gpu_session_r60.sh last 380     # no FA4: zoonofa4 (resumed) on 45% of the budget,
#                    # then the sweep's short, host-bound cases on auto beside plain SDPA and the
#                    # SDPA routes (the hand-written-calls view) on the rest
#   bash benchmarks/gpu_session_r60.sh verify 200   # GPU tests: TESTK, the -k expression
set -uo pipefail
step="${1:?usage: $0 zoonofa4|gw|rerun|last|verify [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r60
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here
gw_cases() {  # gw_cases NAME CONFIG CASES ROUTES: a bench run of those cases into $out/NAME.{json,md}
  run "$1" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench "$2" --routes "$4" --cases "$3" \
    --out "$out/$1.json" --md "$out/$1.md" --quiet --time-budget "$(( $(left) - 35 ))"
}
case "$step" in
  zoonofa4)
    zoo_nofa4
    ;;
  gw)
    run "gpu_tests_global_tokens_${gpu}_${session}" "${TESTS_S:-$(share 35)}" python3 -m pytest -m gpu -q -rfE \
      -p no:cacheprovider -n 4 tests/gpu/test_routes_gpu.py -k "global_tokens"
    run "global_tokens_bound_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench \
      benchmarks/global_tokens_bound.yaml --out "$out/global_tokens_bound_${gpu}_${session}.json" \
      --md "$out/global_tokens_bound_${gpu}_${session}.md" --quiet --time-budget "$(( $(left) - 35 ))"
    ;;
  rerun)
    whole=$budget
    budget=$(( whole * 45 / 100 ))
    gw_cases "zoo_global_window_d64_${gpu}_${session}" zoo zoo_global_window_d64 auto,raw_flex,flex_flash,fa4
    budget=$whole
    gw_cases "zoo_rerun_${gpu}_${session}" zoo zoo_graphormer,zoo_natten_2d,zoo_rel_pos_bias auto,raw_flex
    ;;
  last)
    whole=$budget
    budget=$(( whole * 45 / 100 ))
    zoo_nofa4
    budget=$whole
    short_beside_sdpa
    ;;
  verify) verify ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
