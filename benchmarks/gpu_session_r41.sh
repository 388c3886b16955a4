#!/usr/bin/env bash
# GPU steps prepared by the fortieth session. One step per argument, under its own time limit;
# outputs go into $OUT/r41/, packed into $OUT/r41_STEP.tar after every sub-step. FA4: three calls
# (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session); transformers into /tmp/site
# (carry .whl). Durations measured on the H200 in the fortieth session are in brackets.
#
#   bash benchmarks/gpu_session_r41.sh tests 420      # the zoo GPU tests (-n 8) [125 s], the
#                    # export / CUDA-graph / static-cache compile tests [75 s] and the decoding
#                    # tests [80 s]; each sub-step gets a share of the budget, not a fixed offset
#   bash benchmarks/gpu_session_r41.sh gathers 200    # the zoo rows of T5 buckets and Sandwich
#                    # (auto vs raw_flex), now on two stages first, and the rest of the pair-load
#                    # probe (D=64 and D=128)
#   bash benchmarks/gpu_session_r41.sh gemma2prefill 280  # compiled Gemma 2 prefill without FA4,
#                    # HF flex_attention and flexattn_zoo [HF's row alone took 86 s]
#   bash benchmarks/gpu_session_r41.sh llamaprefill 260   # (FA4 installed) compiled Llama prefill
#   bash benchmarks/gpu_session_r41.sh host 150       # (the forty-first session's code) the host
#                    # table, then one-query decode steps of FlashAttention-2, SDPA's own choice
#                    # and decode_step from 2 MB to 1 GB of k/v (where cuDNN starts to pay)
#   bash benchmarks/gpu_session_r41.sh tuned 300      # (FA4 installed) the auto_tuned rows of the
#                    # 15 cases that have them, into a copy of the sweep (merge its rows into
#                    # benchmarks/results/generalization_h200.json, then run regret.py)
set -uo pipefail
step="${1:?usage: $0 tests|gathers|gemma2prefill|llamaprefill|tuned|host [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r41
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  tests)
    run gpu_tests_zoo_r41 "$(share 45)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 8 \
      -W ignore::UserWarning -W ignore::DeprecationWarning tests/gpu/test_zoo_gpu.py
    PYTHONPATH="/tmp/site:$PYTHONPATH" run gpu_tests_compile_r41 "$(share 27)" python3 -m pytest -m gpu \
      -q -rfE -p no:cacheprovider -n 4 tests/gpu/test_compile_gpu.py \
      -k "export or reduce_overhead or hf_generate or decode_steps_over or eager_call_replays"
    run gpu_tests_decode_r41 "$(( $(left) - 5 ))" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 4 \
      tests/gpu/test_decode_gpu.py tests/gpu/test_routes_gpu.py
    ;;
  gathers)
    run zoo_gathers_r41 "$(share 55)" python3 -m flexattn_zoo.bench zoo --routes auto,raw_flex \
      --cases zoo_rel_pos_bias,zoo_sandwich,zoo_graphormer --out "$out/zoo_gathers_r41.json" \
      --md "$out/zoo_gathers_r41.md" --quiet --time-budget "$(( $(share 55) - 20 ))"
    run pair_load_probe_h200_r41 "$(( $(left) - 5 ))" python3 benchmarks/pair_load_probe.py \
      --mods rel_pos_bias sandwich --head-dims 64 128
    ;;
  gemma2prefill)
    PYTHONPATH="/tmp/site:$PYTHONPATH" run compiled_models_gemma2_prefill_nofa4_r41 "$(( $(left) - 5 ))" \
      python3 benchmarks/compiled_models.py --models gemma2 --impls flex_attention,flexattn_zoo \
      --modes prefill --steps 10 --warmup 2 --no-fa4 --json "$out/compiled_models_gemma2_prefill_nofa4_r41.json" \
      --md "$out/compiled_models_gemma2_prefill_nofa4_r41.md" --time-budget "$(( $(left) - 30 ))"
    ;;
  llamaprefill)
    PYTHONPATH="/tmp/site:$PYTHONPATH" run compiled_models_llama_prefill_fa4_r41 "$(( $(left) - 5 ))" \
      python3 benchmarks/compiled_models.py --models llama --impls flex_attention,flexattn_zoo \
      --modes prefill --steps 10 --warmup 2 --json "$out/compiled_models_llama_prefill_fa4_r41.json" \
      --md "$out/compiled_models_llama_prefill_fa4_r41.md" --time-budget "$(( $(left) - 30 ))"
    ;;
  tuned)
    cp benchmarks/results/generalization_h200.json "$out/generalization_h200.json"
    run generalization_tuned_r41 "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --routes auto_tuned --out "$out/generalization_h200.json" \
      --cases alibi_bidir_l2048_b8_d64,bert_base_l128_b128,bert_base_l512_b32,decode_llama2_7b_b16_2k,decode_llama3_8b_b1_32k,dinov2_g_l1370_b8,docs_llama3_8b_l16k,gemma3_27b_l4096_b1,gemma3_4b_local1024_l8192_d256,gpt2_l1024_b16,llama2_13b_l4096_b1,llama32_3b_l2048_b4,llama3_8b_l128_b64,modernbert_l8192_local,vit_b16_l197_b64 \
      --md "$out/generalization_tuned_r41.md" --quiet --time-budget "$(( $(left) - 40 ))"
    ;;
  host)
    run host_cost_h200_r41 "$(share 55)" python3 benchmarks/host_cost.py --device cuda \
      --out "$out/host_cost_h200_r41.md"
    run decode_kernel_probe_h200_r41 "$(( $(left) - 5 ))" python3 benchmarks/decode_kernel_probe.py \
      --rounds 3 --steps 100 --only flash,sdpa,decode_step \
      --shapes 1:8:8:1024:64,1:32:8:4096:128,4:32:8:4096:128,8:32:8:4096:128,1:32:8:32768:128,16:32:8:4096:128,32:32:8:8192:128
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
