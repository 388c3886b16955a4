#!/usr/bin/env bash
# GPU steps of the thirtieth session (FA4 not needed). One step per argument, under its own time
# limit; outputs go into $OUT/r33/, packed into $OUT/r33_STEP.tar after every sub-step.
#
#   bash benchmarks/gpu_session_r33.sh host 560   # host layers and the host-gap profile after flex
#                                                 # bound calls stopped re-checking their signature;
#                                                 # a growing-cache decode; the document rows of the
#                                                 # benchmark config (host-bound or not, one fresh
#                                                 # process); the flex routes' GPU tests and the soak
set -uo pipefail
step="${1:?usage: $0 host [BUDGET_S]}"
budget="${2:-300}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r33
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  host)
    run host_layers_h200_r33 100 python3 benchmarks/host_layers_probe.py --device cuda
    run host_gap_h200_r33 90 python3 benchmarks/host_gap_probe.py --parts profile
    run decode_growing_probe_h200_r33 90 python3 benchmarks/decode_growing_probe.py \
      --batch 32 --start 8000 --steps 60 --routes sdpa
    run h200_documents_r33 120 python3 -m flexattn_zoo.bench h200 --no-fa4 --routes auto,flex,sdpa \
      --cases document_causal,document_causal_d64,document_causal_gqa --modes fwd \
      --out "$out/h200_documents_r33.json" --md "$out/h200_documents_r33.md" --quiet
    run gpu_tests_flex_r33 "$(( $(left) - 5 ))" python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/gpu/test_routes_gpu.py tests/gpu/test_soak_gpu.py -k "flex or soak" -x
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
