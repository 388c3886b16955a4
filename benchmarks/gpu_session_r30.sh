#!/usr/bin/env bash
# GPU steps prepared in the twenty-eighth session and run in the twenty-ninth: the rule changes made from
# replayed rows are not yet measured as `auto`. One step per argument, each under its own time
# limit; outputs go into $OUT/r30/, packed into $OUT/r30_STEP.tar after every sub-step.
#
#   bash benchmarks/gpu_session_r30.sh nofa4 300   # (FA4 not needed) auto --no-fa4 over the
#                                                  # sweep's cases whose choice the last rules
#                                                  # moved (documents, short prefix-LM); host layers
#                                                  # (the fa4 route's no-grad path is CPU-checked only)
#   bash benchmarks/gpu_session_r30.sh fa4 540     # (FA4 installed) the sweep's missing route rows,
#                                                  # then auto over the cases the last rules moved,
#                                                  # then a decode_step path check over a growing cache
#   bash benchmarks/gpu_session_r30.sh tuned 240   # (FA4 installed) auto_tuned over the pairs it was
#                                                  # measured on
set -uo pipefail
step="${1:?usage: $0 nofa4|fa4 [BUDGET_S]}"
budget="${2:-300}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r30
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

moved=alibi_bidir_l2048_b8_d64,docs_gpt2_l2048_b8,docs_llama32_1b_l8192_b2_d64,docs_mixtral_l8192,docs_bidir_bert_l4096_b4,prefix512_l2048_b8_d64,docs_llama3_8b_l16k,paligemma_prefix256_l1024_b4_d256,prefix2048_llama3_8b_l8192_b2,alibi_mpt7b_l2048_b4,softcap50_l2048_b8_d128,softcap30_grok_l8192_gqa6

case "$step" in
  nofa4)
    cp benchmarks/results/generalization_h200-nofa4-auto.json /root/gen-nofa4.json
    run generalization_nofa4_auto_r30 "$(( $(left) - 90 ))" python3 -m flexattn_zoo.bench generalization \
      --out /root/gen-nofa4.json --no-fa4 --resume --rerun --time-budget "$(( $(left) - 130 ))" --quiet \
      --routes auto --cases "$moved"
    cp /root/gen-nofa4.json "$out/generalization_h200-nofa4-auto.json"
    # Is llama2_13b's sdpa-route forward really 0.89 of cuDNN's (plain SDPA ran 0.311 ms)?
    cp benchmarks/results/generalization_h200.json /root/gen-l13.json
    run llama2_13b_recheck_r30 100 python3 -m flexattn_zoo.bench generalization --out /root/gen-l13.json \
      --no-fa4 --resume --rerun --iters 50 --quiet --routes sdpa,plain_sdpa,sdpa_cudnn,sdpa_flash,auto \
      --cases llama2_13b_l4096_b1 --modes fwd
    cp /root/gen-l13.json "$out/generalization_h200_llama2_13b_recheck.json"
    run host_layers_h200_r30 "$(( $(left) - 5 ))" python3 benchmarks/host_layers_probe.py --device cuda
    ;;
  fa4)
    cp benchmarks/results/generalization_h200.json /root/gen.json
    run generalization_missing_r30 150 python3 -m flexattn_zoo.bench generalization \
      --out /root/gen.json --resume --time-budget 120 --quiet --cases "$moved"
    run generalization_auto_r30 "$(( $(left) - 130 ))" python3 -m flexattn_zoo.bench generalization \
      --out /root/gen.json --resume --rerun --time-budget "$(( $(left) - 170 ))" --quiet --routes auto \
      --cases "$moved"
    cp /root/gen.json "$out/generalization_h200.json"
    run gpu_tests_fa4_r30 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu -k fa4
    run decode_growing_probe_h200_r30 "$(( $(left) - 5 ))" python3 benchmarks/decode_growing_probe.py \
      --batch 32 --start 8000 --steps 150 --routes sdpa,fa4
    ;;
  tuned)
    # Measured route choice (auto_tuned, empty table per process) over the pairs it was measured on
    # before tuning timed routes through their bound calls.
    cp benchmarks/results/generalization_h200.json /root/gen-tuned.json
    run generalization_tuned_r30 "$(( $(left) - 30 ))" python3 -m flexattn_zoo.bench generalization \
      --out /root/gen-tuned.json --resume --rerun --time-budget "$(( $(left) - 60 ))" --quiet --routes auto_tuned \
      --cases gemma3_4b_local1024_l8192_d256,bert_base_l512_b32,alibi_bidir_l2048_b8_d64,docs_llama3_8b_l16k,llama2_13b_l4096_b1,modernbert_l8192_local,bert_base_l128_b128,vit_b16_l197_b64,decode_llama3_8b_b1_32k,decode_llama2_7b_b16_2k,llama3_8b_l128_b64
    cp /root/gen-tuned.json "$out/generalization_h200_tuned.json"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
