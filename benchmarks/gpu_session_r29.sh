#!/usr/bin/env bash
# GPU steps of the twenty-ninth session, one step per argument, each under its own time limit.
# Outputs go into $OUT/r29/, packed into $OUT/r29_STEP.tar after every sub-step.
#
#   bash benchmarks/gpu_session_r29.sh nofa4 240   # (FA4 not needed) the sweep's decoding and
#                                                  # short cases again, SDPA's routes and auto
#                                                  # without FA4: their rows predate the sdpa
#                                                  # route's warm-cuDNN decoding
#   bash benchmarks/gpu_session_r29.sh fa4 540     # (FA4 installed) where the fa4 route's host time
#                                                  # goes (cProfile beside FA4's own call), a
#                                                  # growing-cache decode per route, then the fa4
#                                                  # and auto rows again on the cases whose fa4 rows
#                                                  # predate the route's cheaper eager call
#   bash benchmarks/gpu_session_r29.sh verify 360  # (FA4 installed) auto again on the rows whose
#                                                  # choice the session's rule changes moved
#   bash benchmarks/gpu_session_r29.sh missing 400 # (FA4 installed) the sweep's missing route rows
set -uo pipefail
step="${1:?usage: $0 nofa4|fa4|verify|missing [BUDGET_S]}"
budget="${2:-300}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r29
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

decode=decode_llama3_8b_b32_8k,decode_llama3_8b_b1_32k,decode_llama3_70b_b8_4k,decode_llama2_7b_b16_2k,decode_qwen25_7b_b64_1k,decode_llama32_1b_b128_2k,decode_phi3_b8_4k_d96,decode_b1_128k,decode_gemma2_b16_8k_d256,spec4_llama3_8b_b8_8k,spec16_llama3_8b_b4_4k
short=bert_base_l128_b128,vit_h14_l257_b16_d80,vit_b16_l197_b64,gpt2_l1024_b16
stale_fa4=gpt2_medium_l1024_b8,modernbert_l8192_local,llama32_3b_l2048_b4,gemma3_4b_global_l8192_d256,gemma3_27b_l4096_b1,bert_base_l512_b32,gpt2_l1024_b16,qwen25_05b_l1024_b16,bert_base_l128_b128,vit_b16_l197_b64

case "$step" in
  nofa4)
    cp benchmarks/results/generalization_h200.json /root/gen.json
    cp benchmarks/results/generalization_h200-nofa4-auto.json /root/gen-nofa4.json
    run generalization_nofa4_auto_r29 "$(( $(left) / 2 ))" python3 -m flexattn_zoo.bench generalization \
      --out /root/gen-nofa4.json --no-fa4 --resume --rerun --time-budget "$(( $(left) / 2 - 20 ))" --quiet \
      --routes auto --cases "$decode,$short"
    cp /root/gen-nofa4.json "$out/generalization_h200-nofa4-auto.json"
    run generalization_sdpa_r29 "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
      --out /root/gen.json --resume --rerun --time-budget "$(( $(left) - 40 ))" --quiet \
      --routes sdpa,plain_sdpa,sdpa_cudnn,sdpa_flash --cases "$decode,$short"
    cp /root/gen.json "$out/generalization_h200.json"
    pack
    ;;
  fa4)
    run fa4_host_profile_decode_r29 60 python3 benchmarks/host_profile_probe.py --fa4 32,32,8,1,8192,128 --calls 300 --top 30
    run fa4_host_profile_train_r29 60 python3 benchmarks/host_profile_probe.py --fa4 1,40,40,4096,4096,128 --fa4-grad --calls 100 --top 30
    run decode_growing_probe_h200_r29 100 python3 benchmarks/decode_growing_probe.py \
      --batch 32 --start 8000 --steps 150 --routes sdpa,fa4
    [ -f /root/gen.json ] || cp benchmarks/results/generalization_h200.json /root/gen.json
    run generalization_fa4_r29 "$(( $(left) - 15 ))" python3 -m flexattn_zoo.bench generalization \
      --out /root/gen.json --resume --rerun --time-budget "$(( $(left) - 60 ))" --quiet --routes fa4,auto \
      --cases "$stale_fa4,$decode"
    cp /root/gen.json "$out/generalization_h200.json"
    pack
    ;;
  verify)
    # (FA4 installed) auto again where the rules changed in this session: decoding goes to SDPA's
    # own choice, training at head dim 256 to cuDNN or FA4, training with fewer than 2**18 rows no
    # longer to SDPA first.
    run run_h200_fa4_auto_r29 150 env OUT="$out" bash benchmarks/run_h200.sh fa4 --resume --rerun \
      --routes auto --cases decode_gqa,gemma2_d256 --quiet
    [ -f /root/gen.json ] || cp benchmarks/results/generalization_h200.json /root/gen.json
    run generalization_auto_r29 "$(( $(left) - 15 ))" python3 -m flexattn_zoo.bench generalization \
      --out /root/gen.json --resume --rerun --time-budget "$(( $(left) - 60 ))" --quiet --routes auto \
      --cases "modernbert_l8192_global,qwen25_7b_l4096_b2,llama2_13b_l4096_b1,gemma3_4b_local1024_l8192_d256,gemma3_4b_global_l8192_d256,$decode"
    cp /root/gen.json "$out/generalization_h200.json"
    pack
    ;;
  missing)
    # (FA4 installed) every route's row the sweep lacks (--resume keeps the rows measured), for
    # the cases whose pairs had only auto rows, until the budget ends.
    cp benchmarks/results/generalization_h200.json /root/gen.json
    run generalization_missing_r29 "$(( $(left) - 15 ))" python3 -m flexattn_zoo.bench generalization \
      --out /root/gen.json --resume --time-budget "$(( $(left) - 60 ))" --quiet \
      --cases docs_gpt2_l2048_b8,docs_llama32_1b_l8192_b2_d64,docs_mixtral_l8192,docs_bidir_bert_l4096_b4,prefix512_l2048_b8_d64,alibi_mpt7b_l2048_b4,softcap50_l2048_b8_d128,paligemma_prefix256_l1024_b4_d256,prefix2048_llama3_8b_l8192_b2,softcap30_grok_l8192_gqa6
    cp /root/gen.json "$out/generalization_h200.json"
    pack
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
ls -la "$out"
