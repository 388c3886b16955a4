#!/usr/bin/env bash
# GPU steps of the fifty-third session: `verify` here; every other step is gpu_session_r51.sh's
# (`fa4rows`, `tests`, or any step of gpu_session_r48.sh; see their headers), run with this
# session's name on its outputs ($OUT/r53/) and tests/gpu/test_spec_functions_probed_gpu.py beside
# the decode and subclass GPU tests.
# FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
#
#   bash benchmarks/gpu_session_r53.sh verify 420   # whether torch's compiled CUDA flex runs a
#                    # search of a sorted tensor in a mod (searchsorted, bucketize: CPU flex fails
#                    # to lower both), then gpu_session_r51.sh verify (the decode, subclass and
#                    # spec-function GPU tests, the window decode steps, the host table)
#   bash benchmarks/gpu_session_r53.sh STEP BUDGET  # any other step of gpu_session_r51.sh
set -uo pipefail
step="${1:?usage: $0 verify|STEP-of-gpu_session_r51.sh [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "$step" = verify ]; then
  session=r53
  source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here
  for mod in searchsorted bucketize floor_divide remainder where_scalars to_float full_like score_table_one_index; do
    run "flex_mod_hazards_${mod}_${gpu}_r53" 40 python3 benchmarks/flex_mod_hazards_probe.py --device cuda --only "$mod"
  done
  budget=$(left)
fi
SESSION=r53 EXTRA_GPU_TESTS="tests/gpu/test_spec_functions_probed_gpu.py" start="" \
  exec bash benchmarks/gpu_session_r51.sh "$step" "$budget"
