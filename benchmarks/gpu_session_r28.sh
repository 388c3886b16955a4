#!/usr/bin/env bash
# GPU steps prepared in the twenty-sixth session for the next one (its last changes not yet run on
# a GPU), one step per argument, each under its own time limit. Outputs go into $OUT/r28/, packed
# into $OUT/r28_STEP.tar after every sub-step.
#
#   bash benchmarks/gpu_session_r28.sh nofa4 300    # (FA4 not needed) the sdpa route's decoding of
#                                                   # a repeated shape (GPU test vs float64 with a
#                                                   # CUDA graph; the decode_gqa row without FA4),
#                                                   # the host layers after the entries' signature
#                                                   # change, the compile-counting GPU tests
#   bash benchmarks/gpu_session_r28.sh fa4rows 540  # (FA4 installed) the decode_gqa rows with FA4,
#                                                   # a growing-cache decode (B=32, 8K+ keys) per
#                                                   # route, then the fa4 rows of the sweep's cases
#                                                   # where auto or auto_tuned took fa4, on the
#                                                   # route's cheaper eager call
set -uo pipefail
step="${1:?usage: $0 nofa4|fa4rows [BUDGET_S]}"
budget="${2:-300}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r28
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  nofa4)
    run gpu_tests_r28_decode_repeat 120 python3 -m pytest -m gpu -q -rfEs tests/gpu/test_routes_gpu.py \
      -k "repeated_shape or no_recompiles or very_negative or causal_br_padded or route_coverage"
    run run_h200_nofa4_decode_r28 120 env OUT="$out" bash benchmarks/run_h200.sh nofa4 --resume --rerun \
      --routes auto,sdpa,plain_sdpa --cases decode_gqa --quiet
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" run host_layers_h200_r28 "$(( $(left) - 5 ))" python3 benchmarks/host_layers_probe.py --device cuda
    ;;
  fa4rows)
    run run_h200_fa4_decode_r28 150 env OUT="$out" bash benchmarks/run_h200.sh fa4 --resume --rerun \
      --routes auto,fa4,flex_flash,sdpa,plain_sdpa --cases decode_gqa --quiet
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" run decode_growing_probe_h200_r28 120 python3 benchmarks/decode_growing_probe.py \
      --batch 32 --start 8000 --steps 150 --routes sdpa,fa4
    [ -f /root/gen.json ] || cp benchmarks/results/generalization_h200.json /root/gen.json
    run generalization_fa4rows_r28 "$(( $(left) - 20 ))" python3 -m flexattn_zoo.bench generalization \
      --out /root/gen.json --resume --rerun --time-budget "$(( $(left) - 90 ))" --quiet --routes auto,fa4,sdpa \
      --cases llama2_13b_l4096_b1,gemma3_4b_local1024_l8192_d256,docs_llama3_8b_l16k,whisper_v3_enc_l1500_b16,modernbert_l8192_global,qwen25_7b_l4096_b2
    cp /root/gen.json "$out/generalization_h200.json"
    pack
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
ls -la "$out"
