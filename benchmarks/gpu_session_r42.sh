#!/usr/bin/env bash
# GPU steps prepared by the forty-first session. One step per argument, under its own time limit;
# outputs go into $OUT/r42/ (names carry the card, `$gpu` from gpu_session_lib.sh), packed into
# $OUT/r42_STEP.tar after every sub-step. FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md,
# thirty-seventh session). Durations measured in the forty-first session (H100) in brackets.
#
#   bash benchmarks/gpu_session_r42.sh tuned 300      # (FA4 installed; an H200: its regret is
#                    # against the H200 route rows) the auto_tuned rows of the 15 cases that have
#                    # them, into a copy of the sweep (merge its rows into
#                    # benchmarks/results/generalization_h200.json, then run regret.py)
#   bash benchmarks/gpu_session_r42.sh host 250       # the host table on the current code [host_cost
#                    # alone needed more than 104 s]
#   bash benchmarks/gpu_session_r42.sh gathers 200    # T5 / Sandwich zoo rows and the pair-load
#                    # probe at D=64 and D=128 (two stages up to D=128 now)
#   bash benchmarks/gpu_session_r42.sh mla 120        # the MLA d192 forward+backward rows of the
#                    # sdpa route and plain SDPA, interleaved (the tables had them 3-4% apart)
#   bash benchmarks/gpu_session_r42.sh rows 200       # (FA4 installed) every route of the two cases
#                    # whose tuned rows fell below 0.97 against older route rows, with auto and
#                    # auto_tuned, in one process (merge into generalization_h200.json)
#   bash benchmarks/gpu_session_r42.sh tests 300      # the drop-in and decoding GPU tests (the SDPA
#                    # bound call's layout decided once per shape and strides), then the fa4
#                    # route's tests (its bound call restructured; FA4 installed)
set -uo pipefail
step="${1:?usage: $0 tuned|host|gathers|mla|rows|tests [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r42
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  tuned)
    cp benchmarks/results/generalization_h200.json "$out/generalization_${gpu}.json"
    run "generalization_tuned_${gpu}_r42" "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --routes auto_tuned --out "$out/generalization_${gpu}.json" \
      --cases alibi_bidir_l2048_b8_d64,bert_base_l128_b128,bert_base_l512_b32,decode_llama2_7b_b16_2k,decode_llama3_8b_b1_32k,dinov2_g_l1370_b8,docs_llama3_8b_l16k,gemma3_27b_l4096_b1,gemma3_4b_local1024_l8192_d256,gpt2_l1024_b16,llama2_13b_l4096_b1,llama32_3b_l2048_b4,llama3_8b_l128_b64,modernbert_l8192_local,vit_b16_l197_b64 \
      --md "$out/generalization_tuned_${gpu}_r42.md" --quiet --time-budget "$(( $(left) - 40 ))"
    ;;
  host)
    run "host_cost_${gpu}_r42" "$(( $(left) - 5 ))" python3 benchmarks/host_cost.py --device cuda \
      --out "$out/host_cost_${gpu}_r42.md"
    ;;
  gathers)
    run "zoo_gathers_${gpu}_r42" "$(share 55)" python3 -m flexattn_zoo.bench zoo --routes auto,raw_flex \
      --cases zoo_rel_pos_bias,zoo_sandwich,zoo_graphormer --out "$out/zoo_gathers_${gpu}_r42.json" \
      --md "$out/zoo_gathers_${gpu}_r42.md" --quiet --time-budget "$(( $(share 55) - 20 ))"
    run "pair_load_probe_${gpu}_r42" "$(( $(left) - 5 ))" python3 benchmarks/pair_load_probe.py \
      --mods rel_pos_bias sandwich --head-dims 64 128
    ;;
  mla)
    run "mla_${gpu}_r42" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench h200 --resume --rerun \
      --routes sdpa,plain_sdpa --cases mla_d192 --modes fwdbwd --iters 50 \
      --out "$out/mla_${gpu}_r42.json" --md "$out/mla_${gpu}_r42.md" --quiet
    ;;
  rows)
    cp benchmarks/results/generalization_h200.json "$out/generalization_rows_${gpu}.json"
    run "generalization_rows_${gpu}_r42" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --out "$out/generalization_rows_${gpu}.json" --cases llama32_3b_l2048_b4,bert_base_l128_b128 \
      --routes auto,auto_tuned,plain_sdpa,sdpa,sdpa_cudnn,sdpa_flash,sdpa_efficient,sdpa_split,varlen,flex,flex_flash,fa4,raw_flex \
      --md "$out/generalization_rows_${gpu}_r42.md" --quiet --time-budget "$(( $(left) - 30 ))"
    ;;
  tests)
    run "gpu_tests_dropin_decode_${gpu}_r42" "$(share 60)" python3 -m pytest -m gpu -q -rfE \
      -p no:cacheprovider -n 4 tests/gpu/test_dropin_gpu.py tests/gpu/test_decode_gpu.py
    # The fa4 route's restructured bound call (FA4 installed: otherwise these skip).
    run "gpu_tests_fa4_route_${gpu}_r42" "$(( $(left) - 5 ))" python3 -m pytest -m gpu -q -rfE \
      -p no:cacheprovider -n 4 tests/gpu/test_routes_gpu.py -k fa4
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
