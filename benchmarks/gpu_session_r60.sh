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
zoo_nofa4() {  # the zoo without FA4; a fresh machine resumes from the committed rows of its card
  local kept="benchmarks/results/zoo_${gpu}-nofa4_${session}.json"
  [ -f "/root/zoo_${gpu}-nofa4_${session}.json" ] || { [ -f "$kept" ] && cp "$kept" /root/; }
  zoo_sweep "-nofa4" --no-fa4
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
    run "generalization_short_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench generalization \
      --out "$out/generalization_short_${gpu}_${session}.json" --no-fa4 \
      --cases bert_base_l128_b128,llama3_8b_l128_b64,vit_b16_l197_b64,bert_base_l512_b32,gpt2_l1024_b16,vit_h14_l257_b16_d80,decode_qwen25_7b_b64_1k,decode_llama3_70b_b8_4k \
      --routes auto,plain_sdpa,sdpa,sdpa_cudnn,sdpa_flash,sdpa_efficient \
      --md "$out/generalization_short_${gpu}_${session}.md" --quiet --time-budget "$(( $(left) - 35 ))"
    ;;
  verify) verify ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
