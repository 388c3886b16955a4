#!/usr/bin/env bash
# GPU steps of the twenty-sixth session's second machine: the flex entries' static graphs for
# their first shapes (flexattn_zoo.compile.STATIC_SHAPES) on the GPU. FA4 not needed. Outputs go
# into $OUT/r27/, packed into $OUT/r27_STEP.tar after every sub-step.
#
#   bash benchmarks/gpu_session_r27.sh static 480   # the static / two-length / dynamic probe, and
#                                                   # the GPU tests that count compiles over lengths
set -uo pipefail
step="${1:?usage: $0 static [BUDGET_S]}"
budget="${2:-480}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r27
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  static)
    PYTHONPATH="$PWD" run static_dynamic_probe_h200_r27 260 python3 benchmarks/static_dynamic_probe.py
    run gpu_tests_r27_static "$(( $(left) - 10 ))" python3 -m pytest -m gpu -q -rfEs \
      tests/gpu/test_routes_gpu.py tests/gpu/test_dropin_gpu.py tests/gpu/test_decode_gpu.py \
      -k "no_recompiles or unfused or cache_prefixes or decode"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
ls -la "$out"
