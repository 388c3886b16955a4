#!/usr/bin/env bash
# GPU steps prepared by the thirty-fourth session. One step per argument, under its own time
# limit; outputs go into $OUT/r37/, packed into $OUT/r37_STEP.tar after every sub-step.
#
#   bash benchmarks/gpu_session_r37.sh hostbound1 560  # (FA4 installed) the generalization sweep's
#   bash benchmarks/gpu_session_r37.sh hostbound2 560  # short cases (auto under 0.3 ms; half each),
#                    # every route again: their rows predate the host-time cuts of sessions 28-33
#                    # (a flex route's repeated call then cost 45 us more than compiled flex, now
#                    # about 2-7), so regret.py's "auto against hand-written calls" is stale.
#                    # After each, copy $OUT/r37/generalization_h200.json over
#                    # benchmarks/results/generalization_h200.json (the next step starts from it),
#                    # then run benchmarks/regret.py on the CPU.
#   bash benchmarks/gpu_session_r37.sh docs64 400      # (FA4 installed) documents at D=64, MHA and
#                    # GQA, with every route they list (fa4 and Triton flex split the training rows
#                    # by shape); into a copy of the sweep as above
#   bash benchmarks/gpu_session_r37.sh host 300        # host time per layer on a plan-cache hit; a
#                    # decode step's host time and kernels per spelling (decode_profile_probe.py:
#                    # fz.attention at 4K x 1 took 88 us against plain SDPA's 46); the GPU
#                    # document tests on the unified starts mask_mods
#   bash benchmarks/gpu_session_r37.sh decode 300      # decode_bench.py's steps again (its table,
#                    # results/decode_h200.md, predates SDPA over the live prefix in decode_step and
#                    # cuDNN at a repeated shape in fz.attention): decode_int, attention, sdpa,
#                    # flex_graph at 4K and 32K keys, batch 1, 8 and 32
set -uo pipefail
step="${1:?usage: $0 hostbound1|hostbound2|docs64|host|decode [BUDGET_S]}"
budget="${2:-300}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r37
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

SHORT_CASES_1=bert_base_l128_b128,bert_base_l512_b32,bert_large_l512_b32_padded,decode_b1_128k,\
decode_llama2_7b_b16_2k,decode_llama32_1b_b128_2k,decode_llama3_70b_b8_4k,decode_llama3_8b_b1_32k,\
decode_llama3_8b_b32_8k,decode_phi3_b8_4k_d96,decode_qwen25_7b_b64_1k,dinov2_g_l1370_b8,\
docs_bidir_bert_l4096_b4,docs_gpt2_l2048_b8,docs_llama32_1b_l8192_b2_d64,gemma3_27b_l4096_b1,\
gemma3_4b_local1024_l8192_d256
SHORT_CASES_2=gpt2_l1024_b16,gpt2_medium_l1024_b8,llama2_13b_l4096_b1,\
llama32_1b_l512_b64,llama32_3b_l2048_b4,llama3_8b_l128_b64,llama3_8b_l512_b32,\
modernbert_l1024_b16_padded,modernbert_l8192_local,paligemma_prefix256_l1024_b4_d256,\
prefill_chunk512_llama3_8b_8k,prefix512_l2048_b8_d64,qwen25_05b_l1024_b16,qwen2vl_vision_l4096_d80,\
spec4_llama3_8b_b8_8k,vit_b16_l197_b64,vit_h14_l257_b16_d80,vit_l14_l577_b32

DOCS_D64=docs_llama32_1b_l8192_b2_d64,docs_qwen25_05b_l8192_b4_d64,docs_pythia410m_l4096_b8_d64

sweep() {  # sweep NAME CASES: the sweep's every route again over CASES, into a copy of the sweep
  cp benchmarks/results/generalization_h200.json "$out/generalization_h200.json"
  run "generalization_${1}_r37" "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
    --resume --rerun --cases "$2" --out "$out/generalization_h200.json" \
    --md "$out/generalization_${1}_r37.md" --quiet --time-budget "$(( $(left) - 40 ))"
}

case "$step" in
  hostbound1) sweep short1 "$SHORT_CASES_1" ;;
  hostbound2) sweep short2 "$SHORT_CASES_2" ;;
  docs64) sweep docs64 "$DOCS_D64" ;;
  host)
    run host_layers_h200_r37 "$(( $(left) / 3 ))" python3 benchmarks/host_layers_probe.py --device cuda --rounds 15
    run decode_profile_h200_r37 "$(( $(left) / 3 ))" python3 benchmarks/decode_profile_probe.py \
      --shape 1,32,8,4096,128 --shape 8,32,8,4096,128 --shape 32,32,8,4096,128
    run gpu_tests_documents_r37 "$(( $(left) - 5 ))" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
      tests/gpu/test_routes_gpu.py tests/gpu/test_compile_gpu.py -k "document and not flex_flash and not fa4"
    ;;
  decode)
    run decode_h200_r37 "$(( $(left) - 5 ))" python3 benchmarks/decode_bench.py --lens 4096,32768 \
      --batch 1,8,32 --routes decode_int,attention,sdpa,flex_graph --repeats 10 \
      --md "$out/decode_h200_r37.md" --json "$out/decode_h200_r37.json"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
