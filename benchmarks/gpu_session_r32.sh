#!/usr/bin/env bash
# GPU steps prepared in the twenty-ninth session for the next one. One step per argument, under
# its own time limit; outputs go into $OUT/r32/, packed into $OUT/r32_STEP.tar after every
# sub-step.
#
#   bash benchmarks/gpu_session_r32.sh host 300   # (FA4 not needed) host layers after the bound
#                                                 # SDPA call stopped asking whether it is traced;
#                                                 # a growing-cache decode with the probe's cache
#                                                 # sized for every length, cProfile of a
#                                                 # re-planned step per backend (where a plan-cache
#                                                 # miss spends its host time on CUDA)
set -uo pipefail
step="${1:?usage: $0 host [BUDGET_S]}"
budget="${2:-300}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r32
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  host)
    run host_layers_h200_r32 90 python3 benchmarks/host_layers_probe.py --device cuda
    run decode_growing_probe_h200_r32 "$(( $(left) - 5 ))" python3 benchmarks/decode_growing_probe.py \
      --batch 32 --start 8000 --steps 100 --routes sdpa --profile 100 --top 30
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
