#!/usr/bin/env bash
# GPU steps of the forty-ninth session: `band` here; every other step is gpu_session_r48.sh's
# (see its header), run with this session's name on its outputs ($OUT/r49/, names ending _r49).
# FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
#
#   bash benchmarks/gpu_session_r49.sh band 400     # (FA4 installed; on an H200) the cases around
#                    # the fa4 band rule (2e10-4e10 of visible work) on the H200 sweep's own card
#   bash benchmarks/gpu_session_r49.sh decode 300   # the decode GPU tests, then decode steps under a
#                    # sliding window of 4096 (SDPA over the window vs the flex step vs plain SDPA)
#   bash benchmarks/gpu_session_r49.sh window 200  # one-query steps over a full 4096 window: SDPA's
#                    # kernels one by one (window_kernel_probe.py), decode_step vs plain SDPA again
#   bash benchmarks/gpu_session_r49.sh short 300    # the sweep's cases whose auto rows were host-bound
#                    # against plain SDPA, auto and the SDPA routes side by side in one process
#   bash benchmarks/gpu_session_r49.sh STEP BUDGET  # any step of gpu_session_r48.sh
set -uo pipefail
step="${1:?usage: $0 band|decode|short|window|STEP-of-gpu_session_r48.sh [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case "$step" in
  band|decode|short|window) ;;
  *) SESSION=r49 exec bash benchmarks/gpu_session_r48.sh "$@" ;;
esac
session=r49
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

if [ "$step" = decode ]; then
  run "gpu_tests_decode_${gpu}_r49" "$(share 45)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 4 \
    tests/gpu/test_decode_gpu.py
  run "decode_window_${gpu}_r49" "$(( $(left) - 5 ))" python3 benchmarks/decode_bench.py --window 4096 \
    --lens 8192,32768,131072 --batch 1,8,32 --routes decode_int,sdpa,flex,flex_graph \
    --md "$out/decode_window_${gpu}_r49.md" --json "$out/decode_window_${gpu}_r49.json"
  pack
  ls -la "$out"
  exit 0
fi
if [ "$step" = window ]; then
  run "window_kernel_probe_${gpu}_r49" "$(share 40)" python3 benchmarks/window_kernel_probe.py
  run "decode_window2_${gpu}_r49" "$(( $(left) - 5 ))" python3 benchmarks/decode_bench.py --window 4096 \
    --lens 32768 --batch 1,8,32 --routes decode_int,sdpa \
    --md "$out/decode_window2_${gpu}_r49.md" --json "$out/decode_window2_${gpu}_r49.json"
  pack
  ls -la "$out"
  exit 0
fi
if [ "$step" = short ]; then
  # Their rows in generalization_h200.json were measured before several cuts of host time.
  cases="${CASES:-bert_base_l128_b128,llama3_8b_l128_b64,gpt2_medium_l1024_b8,decode_llama3_70b_b8_4k,decode_qwen25_7b_b64_1k,vit_h14_l257_b16_d80,vit_b16_l197_b64,gpt2_l1024_b16,bert_base_l512_b32}"
  run "generalization_short_${gpu}_r49" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench generalization \
    --out "$out/generalization_short_${gpu}_r49.json" --cases "$cases" \
    --routes auto,plain_sdpa,sdpa,sdpa_cudnn,sdpa_flash,sdpa_efficient \
    --md "$out/generalization_short_${gpu}_r49.md" --quiet --time-budget "$(( $(left) - 40 ))"
  pack
  ls -la "$out"
  exit 0
fi

# The H200 sweep's fa4 rows of these cases predate the replayed launches. The output is
# generalization_h200.json with these rows measured again (commit it as that).
cases="${CASES:-dinov2_g_l1370_b8,llama32_3b_l2048_b4,gemma3_27b_l4096_b1,llama32_1b_l512_b64,llama3_8b_l512_b32,vit_l14_l577_b32,qwen2vl_vision_l4096_d80,gpt2_l1024_b16,bert_base_l512_b32}"
cp benchmarks/results/generalization_h200.json "$out/generalization_h200.json"
run "generalization_band_${gpu}_r49" "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
  --resume --rerun --out "$out/generalization_h200.json" --cases "$cases" \
  --routes auto,auto_tuned,plain_sdpa,sdpa,sdpa_cudnn,sdpa_flash,flex,flex_flash,fa4 \
  --md "$out/generalization_band_${gpu}_r49.md" --quiet --time-budget "$(( $(left) - 60 ))"
pack
ls -la "$out"
