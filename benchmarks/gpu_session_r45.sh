#!/usr/bin/env bash
# GPU steps of the forty-fifth session (tracefix, host, tuned, gemma2fa4 and d256 ran on an H200;
# tunedall is prepared for the next session). One step per argument, under its own time
# limit; outputs go into $OUT/r45/ (names carry the card), packed into $OUT/r45_STEP.tar after every
# sub-step. FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
# transformers 5.24 and its dependencies (numpy left out: the device's torch environment has it)
# are in .whl/: one call carrying .whl with `python3 -m pip install -q --no-index --no-deps
# --no-compile --target /tmp/site .whl/*.whl`.
#
#   bash benchmarks/gpu_session_r45.sh tracefix 150   # the compile GPU tests that broke the graph
#                    # on all() over a generator (callable_ids), after the loop rewrite
#   bash benchmarks/gpu_session_r45.sh gemma2fa4 560  # (FA4 and /tmp/site) compiled Gemma-2
#                    # training, the zoo (its soft-capped layers now on flex_flash at head dim
#                    # 256) beside HF flex_attention, in one process
#   bash benchmarks/gpu_session_r45.sh host 200       # the host table after the plan cache's
#                    # insert fix and the leaner hit path, the hit's pieces (host_path_probe.py)
#                    # and the decode probe
#   bash benchmarks/gpu_session_r45.sh tuned 330      # (FA4 installed) auto_tuned rows of the
#                    # 15 tuned cases after the warm-up fix
#   bash benchmarks/gpu_session_r45.sh tunedall 560   # (FA4 installed) the tuned cases, every route
#                    # and auto_tuned in one process (the lowest-ratio cases first)
#   bash benchmarks/gpu_session_r45.sh d256 420       # (FA4 installed) the head-dim-256 cases on
#                    # every route they list (for the H200 tables), then the D=256 GPU tests
set -uo pipefail
step="${1:?usage: $0 tracefix|host|tuned|tunedall|gemma2fa4|d256 [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r45
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

D256_CASES=gemma2_9b_local_softcap_l8192_d256,gemma2_2b_global_softcap_l4096_d256,gemma3_4b_local1024_l8192_d256,paligemma_prefix256_l1024_b4_d256,gemma3_4b_global_l8192_d256

case "$step" in
  tracefix)
    run "gpu_tests_compile_callable_ids_${gpu}_r45" "$(( $(left) - 5 ))" python3 -m pytest -m gpu -q -rfE \
      -p no:cacheprovider -n 3 tests/gpu/test_compile_gpu.py -k "callable_ids or document_causal"
    ;;
  host)
    run "host_cost_${gpu}_r45" "$(share 70)" python3 benchmarks/host_cost.py --device cuda \
      --out "$out/host_cost_${gpu}_r45.md"
    run "host_path_probe_${gpu}_r45" "$(share 15)" python3 benchmarks/host_path_probe.py --device cuda
    run "sdpa_decode_host_probe_${gpu}_r45" "$(( $(left) - 5 ))" python3 benchmarks/sdpa_decode_host_probe.py --device cuda
    ;;
  tuned)  # (FA4 installed) auto_tuned on the tuned cases, after the warm-up fix (issue 20)
    cp benchmarks/results/generalization_h200.json "$out/generalization_tuned_${gpu}.json"
    run "generalization_tuned_${gpu}_r45" "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --routes auto_tuned --out "$out/generalization_tuned_${gpu}.json" \
      --cases alibi_bidir_l2048_b8_d64,bert_base_l128_b128,bert_base_l512_b32,decode_llama2_7b_b16_2k,decode_llama3_8b_b1_32k,dinov2_g_l1370_b8,docs_llama3_8b_l16k,gemma3_27b_l4096_b1,gemma3_4b_local1024_l8192_d256,gpt2_l1024_b16,llama2_13b_l4096_b1,llama32_3b_l2048_b4,llama3_8b_l128_b64,modernbert_l8192_local,vit_b16_l197_b64 \
      --md "$out/generalization_tuned_${gpu}_r45.md" --quiet --time-budget "$(( $(left) - 40 ))"
    ;;
  tunedall)  # (FA4 installed) the tuned cases with every route and auto_tuned in one process, so
    # the tuning regret compares rows of one host (the tuned rows alone compare across sessions)
    cp benchmarks/results/generalization_h200.json "$out/generalization_tunedall_${gpu}.json"
    run "generalization_tunedall_${gpu}_r45" "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --out "$out/generalization_tunedall_${gpu}.json" \
      --cases bert_base_l128_b128,bert_base_l512_b32,vit_b16_l197_b64,decode_llama3_8b_b1_32k,llama2_13b_l4096_b1,dinov2_g_l1370_b8,gemma3_27b_l4096_b1,docs_llama3_8b_l16k,alibi_bidir_l2048_b8_d64,decode_llama2_7b_b16_2k,gemma3_4b_local1024_l8192_d256,gpt2_l1024_b16,llama32_3b_l2048_b4,llama3_8b_l128_b64,modernbert_l8192_local \
      --md "$out/generalization_tunedall_${gpu}_r45.md" --quiet --time-budget "$(( $(left) - 40 ))"
    ;;
  gemma2fa4)
    PYTHONPATH="/tmp/site:$PYTHONPATH" run "compiled_models_gemma2_fa4_${gpu}_r45" "$(( $(left) - 5 ))" \
      python3 benchmarks/compiled_models.py --models gemma2 --impls flexattn_zoo,flex_attention --modes train \
      --steps 6 --warmup 1 --json "$out/compiled_models_gemma2_fa4_${gpu}_r45.json" \
      --md "$out/compiled_models_gemma2_fa4_${gpu}_r45.md" --time-budget "$(( $(left) - 30 ))"
    ;;
  d256)
    cp benchmarks/results/generalization_h200.json "$out/generalization_d256_${gpu}.json"
    run "generalization_d256_${gpu}_r45" "$(share 75)" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --out "$out/generalization_d256_${gpu}.json" --cases "$D256_CASES" \
      --md "$out/generalization_d256_${gpu}_r45.md" --quiet --time-budget "$(share 65)"
    run "gpu_tests_flex_flash_d256_${gpu}_r45" "$(( $(left) - 5 ))" python3 -m pytest -q -rfE \
      -p no:cacheprovider -n 4 tests/gpu/test_routes_gpu.py -k "head_dim_256"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
