#!/usr/bin/env bash
# GPU steps of the fifty-second session: `probe` here; every other step is gpu_session_r51.sh's
# (`verify`, `fa4rows`, `tests`, or any step of gpu_session_r48.sh; see their headers), run with
# this session's name on its outputs ($OUT/r52/) and tests/gpu/test_spec_functions_probed_gpu.py
# beside the decode and subclass GPU tests.
# FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
#
#   bash benchmarks/gpu_session_r52.sh probe 270    # which mods written for flex's 0-d indices
#                    # torch's compiled CUDA flex runs (benchmarks/flex_mod_hazards_probe.py), then
#                    # the flex-index spec, subclass and decode GPU tests
#   bash benchmarks/gpu_session_r52.sh verify 400   # gpu_session_r51.sh verify, with the tests above
#   bash benchmarks/gpu_session_r52.sh STEP BUDGET  # any other step of gpu_session_r51.sh
set -uo pipefail
step="${1:?usage: $0 probe|STEP-of-gpu_session_r51.sh [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "$step" != probe ]; then
  SESSION=r52 EXTRA_GPU_TESTS="tests/gpu/test_spec_functions_probed_gpu.py" \
    exec bash benchmarks/gpu_session_r51.sh "$@"
fi
session=r52
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

run "flex_mod_hazards_${gpu}_r52" "$(share 40)" python3 benchmarks/flex_mod_hazards_probe.py --device cuda
run "gpu_tests_probe_${gpu}_r52" "$(( $(left) - 5 ))" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 4 \
  tests/gpu/test_spec_functions_probed_gpu.py tests/gpu/test_subclassed_specs_gpu.py tests/gpu/test_decode_gpu.py
pack
ls -la "$out"
