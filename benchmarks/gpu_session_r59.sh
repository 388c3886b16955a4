#!/usr/bin/env bash
# GPU steps of the fifty-ninth session (outputs in $OUT/r59/, packed into $OUT/r59_STEP.tar).
# FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
#
#   bash benchmarks/gpu_session_r59.sh first 560    # the first call of a fresh machine (no FA4):
#                    # on an H200 the zoo without FA4 (zoonofa4), then the probe; elsewhere the
#                    # probe alone
#   bash benchmarks/gpu_session_r59.sh probe 200    # benchmarks/split_host_probe.py: sdpa_split's
#                    # host and device time per call, its first synchronizing op, the profiler table
#   bash benchmarks/gpu_session_r59.sh short 300    # the sweep's host-bound short cases: auto and
#                    # the SDPA routes beside plain SDPA (the hand-written-calls view)
#   bash benchmarks/gpu_session_r59.sh zoo 560      # (FA4 installed) every zoo case on auto and
#                    # hand-written flex into /root/zoo_GPU_r59.json (a second call resumes it);
#                    # CASES / ROUTES override the cases and routes
#   bash benchmarks/gpu_session_r59.sh zoonofa4 560 # the same with FA4 hidden (--no-fa4)
#   bash benchmarks/gpu_session_r59.sh band2 300    # (FA4 installed; on an H200) the two cases whose
#                    # fa4 rows are stale, into a copy of generalization_h200.json
#   bash benchmarks/gpu_session_r59.sh verify 200   # GPU tests: TESTK, the -k expression
#   bash benchmarks/gpu_session_r59.sh gw 300       # (FA4 installed) global tokens on fa4: the GPU tests,
#                    # then both global-window cases on auto, hand-written flex, flex_flash and fa4
set -uo pipefail
step="${1:?usage: $0 first|probe|short|zoo|zoonofa4|band2|verify|gw [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r59
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here
probe() {
  run "split_host_probe_${gpu}_${session}" "$1" python3 benchmarks/split_host_probe.py --device cuda
}
short() {
  run "generalization_short_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench generalization \
    --out "$out/generalization_short_${gpu}_${session}.json" \
    --cases bert_base_l128_b128,llama3_8b_l128_b64,gpt2_medium_l1024_b8,decode_llama3_70b_b8_4k,decode_qwen25_7b_b64_1k,vit_h14_l257_b16_d80,vit_b16_l197_b64,gpt2_l1024_b16,bert_base_l512_b32 \
    --routes auto,plain_sdpa,sdpa,sdpa_cudnn,sdpa_flash,sdpa_efficient \
    --md "$out/generalization_short_${gpu}_${session}_bench.md" --quiet --time-budget "$(( $(left) - 35 ))"
}
case "$step" in
  first)
    if [ "$gpu" = h200 ]; then
      whole=$budget
      budget=$(( whole - 150 ))  # the zoo stops starting rows in time for the probe
      zoo_sweep "-nofa4" --no-fa4
      budget=$whole
      probe "$(( $(left) - 5 ))"
    else
      probe "$(( $(left) - 5 ))"
    fi
    ;;
  probe) probe "$(( $(left) - 5 ))" ;;
  short) short ;;
  zoo) zoo_sweep "" ;;
  zoonofa4) zoo_sweep "-nofa4" --no-fa4 ;;
  band2) band2 ;;
  gw)
    run "gpu_tests_global_tokens_${gpu}_${session}" "$(share 40)" python3 -m pytest -m gpu -q -rfE \
      -p no:cacheprovider -n 4 tests/gpu/test_routes_gpu.py -k "global_tokens"
    run "zoo_global_window_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench zoo \
      --routes auto,raw_flex,flex_flash,fa4 --cases zoo_global_window,zoo_global_window_d64 \
      --out "$out/zoo_global_window_${gpu}_${session}.json" --md "$out/zoo_global_window_${gpu}_${session}.md" \
      --quiet --time-budget "$(( $(left) - 35 ))"
    ;;
  verify) verify ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
