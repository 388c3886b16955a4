#!/usr/bin/env bash
# GPU steps of the forty-ninth session: `band` here; every other step is gpu_session_r48.sh's
# (see its header), run with this session's name on its outputs ($OUT/r49/, names ending _r49).
# FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
#
#   bash benchmarks/gpu_session_r49.sh band 400     # (FA4 installed; on an H200) the cases around
#                    # the fa4 band rule (2e10-4e10 of visible work) on the H200 sweep's own card
#   bash benchmarks/gpu_session_r49.sh STEP BUDGET  # any step of gpu_session_r48.sh
set -uo pipefail
step="${1:?usage: $0 band|STEP-of-gpu_session_r48.sh [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "$step" != band ]; then
  SESSION=r49 exec bash benchmarks/gpu_session_r48.sh "$@"
fi
session=r49
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

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
