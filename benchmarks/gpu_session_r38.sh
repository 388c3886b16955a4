#!/usr/bin/env bash
# GPU steps prepared by the thirty-fifth session (whose third call was lost with its machine).
# One step per argument, under its own time limit; outputs go into $OUT/r38/, packed into
# $OUT/r38_STEP.tar after every sub-step.
#
#   bash benchmarks/gpu_session_r38.sh host 300   # host time per layer on a plan-cache hit
#                    # (decode_step included); decode_profile_probe.py (fz.attention at 4K x 1 took
#                    # 88 us against plain SDPA's 46: which kernels and how much host time); the
#                    # GPU decode and drop-in tests (decode_step's prefix step and the SDPA pin changed
#                    # in session 35, untested on the GPU); the GPU document tests on the unified
#                    # starts mask_mods (not yet run on the GPU);
#                    # with FA4 installed, FA4's host time per forward call at three short shapes
#                    # (0.14-0.31 ms in the sweep: Llama-3.2-3B-style 4 x 2K, Gemma-3-27B-style 4K,
#                    # DINOv2-g), its own call beside the fa4 route
#   bash benchmarks/gpu_session_r38.sh rest 560   # (FA4 installed) the three short cases
#                    # hostbound2 of r37 did not reach, then documents at D=64 (the two cases
#                    # without rows), into a copy of the sweep; afterwards copy
#                    # $OUT/r38/generalization_h200.json over benchmarks/results/ and run regret.py
#   bash benchmarks/gpu_session_r38.sh gemma2fa4 560  # (FA4 installed, transformers 5.24 under
#                    # /tmp/site: carry .whl with .whlC and run `python3 -m pip install -q --no-index
#                    # --no-deps --no-compile --target /tmp/site .whl/*.whl` there) the compiled
#                    # Gemma 2 training row with FA4, the one compiled-model row not yet measured
#                    # (the fa4 route runs its local window + approx soft-cap at D=256; without FA4
#                    # the zoo row is 329.7 ms against HF flex 329.9 in compiled_models_h200_r22.md)
#   bash benchmarks/gpu_session_r38.sh tiles 200  # Graphormer's pair-loaded score mod (an int32
#                    # index per (b, q, kv) into a [S, H] table) at D=64 with torch's default tiles
#                    # and with fwd_num_stages=2: the flex route passes 2 stages to every pair-loaded
#                    # mod at D<=64 (table[kv-q] and bias[h,q,kv] failed to compile without), and
#                    # zoo_graphormer ran at 0.80x of hand-written flex, which kept the defaults
#   bash benchmarks/gpu_session_r38.sh tuned 240  # (FA4 installed; after `rest`, same $OUT) measured
#                    # route choice, now timed in rotated rounds, on the pairs the regret report
#                    # lists beyond their noise and the short forwards FA4 and SDPA split
#                    # (gemma3_27b, dinov2_g: fa4 faster; llama32_3b: SDPA faster)
set -uo pipefail
step="${1:?usage: $0 host|rest|gemma2fa4|tiles|tuned [BUDGET_S]}"
budget="${2:-300}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r38
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

SHORT_LEFT=llama2_13b_l4096_b1,prefix512_l2048_b8_d64,paligemma_prefix256_l1024_b4_d256
DOCS_D64=docs_qwen25_05b_l8192_b4_d64,docs_pythia410m_l4096_b8_d64

case "$step" in
  host)
    run decode_profile_h200_r38 "$(( $(left) / 3 ))" python3 benchmarks/decode_profile_probe.py \
      --shape 1,32,8,4096,128 --shape 8,32,8,4096,128 --shape 32,32,8,4096,128
    run host_layers_h200_r38 "$(( $(left) / 2 ))" python3 benchmarks/host_layers_probe.py --device cuda --rounds 15
    if python3 -c "import flash_attn.cute" 2>/dev/null; then  # FA4's host time per call by shape
      run fa4_host_shapes_h200_r38 "$(( $(left) / 4 ))" bash -c \
        'for s in 4,24,8,2048,2048,128 1,32,16,4096,4096,128 8,24,24,1370,1370,64; do
           python3 benchmarks/host_profile_probe.py --fa4 $s --calls 300 --top 12; done'
    fi
    run gpu_tests_decode_r38 "$(( $(left) / 2 ))" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
      tests/gpu/test_decode_gpu.py tests/gpu/test_dropin_gpu.py
    run gpu_tests_documents_r38 "$(( $(left) - 5 ))" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
      tests/gpu/test_routes_gpu.py tests/gpu/test_compile_gpu.py -k "document and not flex_flash and not fa4"
    ;;
  rest)
    [ -f "$out/generalization_h200.json" ] || cp benchmarks/results/generalization_h200.json "$out/generalization_h200.json"
    sweep() {  # sweep NAME CASES SHARE_S: the sweep's every route again over CASES
      run "generalization_${1}_r38" "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
        --resume --rerun --cases "$2" --out "$out/generalization_h200.json" \
        --md "$out/generalization_${1}_r38.md" --quiet --time-budget "$3"
    }
    sweep short "$SHORT_LEFT" "$(( $(left) / 2 ))"
    sweep docs64 "$DOCS_D64" "$(( $(left) - 40 ))"
    ;;
  gemma2fa4)
    PYTHONPATH="/tmp/site:$PYTHONPATH" run compiled_models_gemma2_fa4_r38 "$(( $(left) - 5 ))" \
      python3 benchmarks/compiled_models.py --models gemma2 --impls flexattn_zoo --modes train \
      --steps 6 --warmup 1 --json "$out/compiled_models_gemma2_fa4_r38.json" \
      --md "$out/compiled_models_gemma2_fa4_r38.md" --time-budget "$(( $(left) - 30 ))"
    ;;
  tuned)
    [ -f "$out/generalization_h200.json" ] || cp benchmarks/results/generalization_h200.json "$out/generalization_h200.json"
    run generalization_tuned_r38 "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --routes auto_tuned --out "$out/generalization_h200.json" \
      --cases gemma3_27b_l4096_b1,dinov2_g_l1370_b8,llama32_3b_l2048_b4,gemma3_4b_local1024_l8192_d256,gpt2_l1024_b16,bert_base_l128_b128 \
      --md "$out/generalization_tuned_r38.md" --quiet --time-budget "$(( $(left) - 40 ))"
    ;;
  tiles)
    run gathered_tile_graph_h200_r38 "$(( $(left) - 5 ))" python3 benchmarks/gathered_tile_probe.py \
      --lengths 1024 4096 --head-dims 64 128 --long-head-dims 64 --mods none 'table[pos[b,q,kv],h]'
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
