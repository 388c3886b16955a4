#!/usr/bin/env bash
# GPU steps of the forty-third session. One step per argument, under its own time limit; outputs go
# into $OUT/r43/ (names carry the card, `$gpu` from gpu_session_lib.sh), packed into $OUT/r43_STEP.tar
# after every sub-step. FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh
# session).
#
#   bash benchmarks/gpu_session_r43.sh tests 300      # the drop-in and decoding GPU tests (the SDPA
#                    # bound call's layout decided once per shape and strides), then the fa4
#                    # route's tests (its bound call restructured; FA4 installed)
#   bash benchmarks/gpu_session_r43.sh host 130       # the host table on the current code
#   bash benchmarks/gpu_session_r43.sh ffprofile 150  # (FA4 installed) where the decode rows' and
#                    # flex_flash's eager host time goes: host_profile_probe.py --decode, then
#                    # block_select and dilated_sliding_window forwards on flex_flash beside
#                    # compiled flex with BACKEND="FLASH" on a prebuilt BlockMask
#   bash benchmarks/gpu_session_r43.sh ffpair 300     # (FA4 installed) device and host time of
#                    # flex_flash vs hand-written FLASH / Triton flex on the same masks, each call
#                    # timed alone (flex_flash_pair_probe.py; ffprofile's cProfile saw the launch wait)
#   bash benchmarks/gpu_session_r43.sh hostrows 200   # (FA4 installed) auto, sdpa and plain SDPA
#                    # again, in one process, on the short cases whose `auto` rows (measured many
#                    # host-path changes ago) were host-bound and 0.58-0.87x plain SDPA
#   bash benchmarks/gpu_session_r43.sh warmfix 240    # (no FA4) after the warm-up fix: auto,
#                    # auto_tuned, sdpa and plain SDPA on a decode case whose auto row got 8
#                    # timed calls, and on the short cases tuning missed, into a fresh no-FA4 file
#   bash benchmarks/gpu_session_r43.sh rows 200       # (FA4 installed) every route of the two cases
#                    # whose tuned rows fell below 0.97 against older route rows, with auto and
#                    # auto_tuned, in one process (merge into generalization_h200.json)
set -uo pipefail
step="${1:?usage: $0 tests|host|ffprofile|ffpair|hostrows|warmfix|rows [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r43
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  tests)
    run "gpu_tests_dropin_decode_${gpu}_r43" "$(share 60)" python3 -m pytest -m gpu -q -rfE \
      -p no:cacheprovider -n 4 tests/gpu/test_dropin_gpu.py tests/gpu/test_decode_gpu.py
    run "gpu_tests_fa4_route_${gpu}_r43" "$(( $(left) - 5 ))" python3 -m pytest -m gpu -q -rfE \
      -p no:cacheprovider -n 4 tests/gpu/test_routes_gpu.py -k fa4
    ;;
  host)
    run "host_cost_${gpu}_r43" "$(( $(left) - 5 ))" python3 benchmarks/host_cost.py --device cuda \
      --out "$out/host_cost_${gpu}_r43.md"
    ;;
  ffprofile)
    run "host_profile_decode_${gpu}_r43" "$(share 30)" python3 benchmarks/host_profile_probe.py --device cuda --decode --calls 2000 --top 35
    for example in block_select dilated_sliding_window; do
      run "host_profile_flex_flash_${example}_${gpu}_r43" "$(share 33)" python3 benchmarks/host_profile_probe.py \
        --device cuda --example "$example" --route flex_flash --shape 2,16,4096,128 --calls 500 --top 40
    done
    ;;
  ffpair)
    run "flex_flash_pair_probe_${gpu}_r43" "$(( $(left) - 5 ))" python3 benchmarks/flex_flash_pair_probe.py
    ;;
  hostrows)
    cp benchmarks/results/generalization_h200.json "$out/generalization_hostrows_${gpu}.json"
    run "generalization_hostrows_${gpu}_r43" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --out "$out/generalization_hostrows_${gpu}.json" --routes auto,sdpa,plain_sdpa \
      --cases bert_base_l128_b128,llama3_8b_l128_b64,gpt2_medium_l1024_b8,decode_llama3_70b_b8_4k,decode_qwen25_7b_b64_1k,vit_h14_l257_b16_d80,vit_b16_l197_b64 \
      --md "$out/generalization_hostrows_${gpu}_r43.md" --quiet --time-budget "$(( $(left) - 30 ))"
    ;;
  warmfix)
    run "generalization_warmfix_${gpu}_r43" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench generalization \
      --no-fa4 --out "$out/generalization_warmfix_${gpu}-nofa4.json" --routes auto,auto_tuned,sdpa,plain_sdpa \
      --cases decode_llama3_70b_b8_4k,bert_base_l128_b128,llama32_3b_l2048_b4 \
      --md "$out/generalization_warmfix_${gpu}_r43.md" --quiet --time-budget "$(( $(left) - 40 ))"
    ;;
  rows)
    cp benchmarks/results/generalization_h200.json "$out/generalization_rows_${gpu}.json"
    run "generalization_rows_${gpu}_r43" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --out "$out/generalization_rows_${gpu}.json" --cases llama32_3b_l2048_b4,bert_base_l128_b128 \
      --routes auto,auto_tuned,plain_sdpa,sdpa,sdpa_cudnn,sdpa_flash,sdpa_efficient,sdpa_split,varlen,flex,flex_flash,fa4,raw_flex \
      --md "$out/generalization_rows_${gpu}_r43.md" --quiet --time-budget "$(( $(left) - 30 ))"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
