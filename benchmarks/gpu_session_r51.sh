#!/usr/bin/env bash
# GPU steps of the fifty-first session: `verify` and `fa4rows` here; every other step is
# gpu_session_r48.sh's (see its header), run with the session's name on its outputs ($OUT/r51/ unless SESSION says).
# FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
#
#   bash benchmarks/gpu_session_r51.sh verify 420   # the decode GPU tests and the subclass GPU tests
#                    # after the shared tolerance check, the window decode steps again (the eager
#                    # flex step with a tensor length measured 50% slower in the fiftieth session),
#                    # the host table
#   bash benchmarks/gpu_session_r51.sh fa4rows 560  # (FA4 installed; on an H200) the cases around the
#                    # fa4 band rule (2e10-4e10 of visible work) into generalization_h200.json, then
#                    # the score-mod and prefix-LM cases flex_flash serves into a copy of it
#   bash benchmarks/gpu_session_r51.sh tests 560    # (FA4 installed) the compile GPU suite, the decode
#                    # and subclass GPU tests, the host table
#   bash benchmarks/gpu_session_r51.sh STEP BUDGET  # any step of gpu_session_r48.sh
#
# A later session runs these steps with its own name on the outputs (SESSION=r52) and more GPU
# test files beside the decode and subclass ones (EXTRA_GPU_TESTS, space-separated paths).
set -uo pipefail
step="${1:?usage: $0 verify|fa4rows|tests|STEP-of-gpu_session_r48.sh [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case "$step" in
  verify|fa4rows|tests) ;;
  *) SESSION="${SESSION:-r51}" exec bash benchmarks/gpu_session_r48.sh "$@" ;;
esac
session="${SESSION:-r51}"
# shellcheck disable=SC2206  # split on purpose: a list of paths
extra_tests=(${EXTRA_GPU_TESTS:-})
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

if [ "$step" = tests ]; then
  run "gpu_tests_compile_${gpu}_${session}" "$(share 55)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 4 \
    tests/gpu/test_compile_gpu.py
  run "gpu_tests_decode_${gpu}_${session}" "$(share 30)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 4 \
    tests/gpu/test_decode_gpu.py tests/gpu/test_subclassed_specs_gpu.py "${extra_tests[@]}"
  run "host_cost_${gpu}_${session}" "$(( $(left) - 5 ))" python3 benchmarks/host_cost.py --device cuda \
    --out "$out/host_cost_${gpu}_${session}.md"
  pack
  ls -la "$out"
  exit 0
fi
if [ "$step" = verify ]; then
  run "gpu_tests_decode_${gpu}_${session}" "$(share 35)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 4 \
    tests/gpu/test_decode_gpu.py tests/gpu/test_subclassed_specs_gpu.py "${extra_tests[@]}"
  run "decode_window_${gpu}_${session}" "$(share 30)" python3 benchmarks/decode_bench.py --window 4096 \
    --lens 32768 --batch 1,8,32 --routes decode_int,sdpa,flex,flex_graph \
    --md "$out/decode_window_${gpu}_${session}.md" --json "$out/decode_window_${gpu}_${session}.json"
  run "host_cost_${gpu}_${session}" "$(( $(left) - 5 ))" python3 benchmarks/host_cost.py --device cuda \
    --out "$out/host_cost_${gpu}_${session}.md"
  pack
  ls -la "$out"
  exit 0
fi

# fa4rows. The H200 sweep's fa4 rows of the band cases predate the replayed launches; the output
# generalization_h200.json is the committed sweep with these rows measured again (commit it as that).
band="${BAND:-dinov2_g_l1370_b8,llama32_3b_l2048_b4,gemma3_27b_l4096_b1,llama32_1b_l512_b64,llama3_8b_l512_b32,vit_l14_l577_b32,qwen2vl_vision_l4096_d80,gpt2_l1024_b16,bert_base_l512_b32}"
ffgen="${FFGEN:-alibi_bidir_l2048_b8_d64,alibi_mpt7b_l2048_b4,softcap50_l2048_b8_d128,prefix512_l2048_b8_d64,gemma2_2b_global_softcap_l4096_d256,paligemma_prefix256_l1024_b4_d256}"
cp benchmarks/results/generalization_h200.json "$out/generalization_h200.json"
run "generalization_band_${gpu}_${session}" "$(share 55)" python3 -m flexattn_zoo.bench generalization \
  --resume --rerun --out "$out/generalization_h200.json" --cases "$band" \
  --routes auto,auto_tuned,plain_sdpa,sdpa,sdpa_cudnn,sdpa_flash,flex,flex_flash,fa4 \
  --md "$out/generalization_band_${gpu}_${session}.md" --quiet --time-budget "$(( $(share 55) - 40 ))"
run "generalization_ffgen_${gpu}_${session}" "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
  --resume --rerun --out "$out/generalization_h200.json" --cases "$ffgen" \
  --routes auto,raw_flex,flex,flex_flash \
  --md "$out/generalization_ffgen_${gpu}_${session}.md" --quiet --time-budget "$(( $(left) - 60 ))"
pack
ls -la "$out"
