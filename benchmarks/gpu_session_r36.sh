#!/usr/bin/env bash
# GPU steps prepared by the thirty-third session (its device time went to gpu_session_r35.sh).
# One step per argument, under its own time limit; outputs go into $OUT/r36/, packed into
# $OUT/r36_STEP.tar after every sub-step.
#
#   bash benchmarks/gpu_session_r36.sh docs 560   # packed documents on Triton flex, now spelled
#                                                 # start[q] <= kv <= q: the document rows without
#                                                 # FA4 (auto, flex, raw_flex; fwd and fwd+bwd; compare
#                                                 # results/h200_documents_r33.md), then the GPU
#                                                 # route and compile tests of document masks
#   bash benchmarks/gpu_session_r36.sh soak 560   # the soak at its default size without FA4: the
#                                                 # new object-count check and RSS per round
#   bash benchmarks/gpu_session_r36.sh fa4 560    # (FA4 installed) the FA4 compile tests r35 did
#                                                 # not reach (export, reduce-overhead), flex_flash's
#                                                 # document tests (label spelling kept there)
set -uo pipefail
step="${1:?usage: $0 docs|soak|fa4 [BUDGET_S]}"
budget="${2:-300}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r36
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  docs)
    run h200_documents_r36 "$(( $(left) * 3 / 5 ))" python3 -m flexattn_zoo.bench h200 --no-fa4 \
      --routes auto,flex,raw_flex --cases document_causal,document_causal_d64,document_causal_gqa \
      --out "$out/h200_documents_r36.json" --md "$out/h200_documents_r36.md" --quiet
    run gpu_tests_documents_r36 "$(( $(left) - 5 ))" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
      tests/gpu/test_routes_gpu.py tests/gpu/test_compile_gpu.py -k "document and not flex_flash and not fa4"
    ;;
  soak)
    FLEXATTN_ZOO_SOAK_SUMMARY="$out/soak_r36.json" run gpu_tests_soak_r36 "$(( $(left) - 5 ))" \
      python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_soak_gpu.py
    ;;
  fa4)
    run gpu_tests_fa4_rest_r36 "$(( $(left) / 2 ))" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
      tests/gpu/test_compile_gpu.py -k "fa4_export or fa4_reduce_overhead"
    run gpu_tests_flex_flash_documents_r36 "$(( $(left) - 5 ))" python3 -m pytest -q -p no:cacheprovider \
      -m gpu -rfE tests/gpu/test_routes_gpu.py -k "flex_flash and document"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
