#!/usr/bin/env bash
# The whole GPU suite twice at once on one CUDA machine: without FA4 (flash_attn not on the path) and
# with it (FA4 installed under /tmp/fa4 by ../shared/device/fa4_wheels.sh's install line), each as
# benchmarks/gpu_tests.sh's three parallel pytest processes (the third is the soak). Correctness only:
# nothing is timed.
#
#   OUT=$OUT TEST_TIMEOUT=520 benchmarks/gpu_tests_both.sh NAME
#   -> $OUT/NAME_nofa4.txt, $OUT/NAME_fa4.txt and their -determinism.json and -soak.json files
#
# Exit code: non-zero if either suite failed or timed out.
set -uo pipefail
name="${1:?usage: $0 NAME}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
fa4="${FA4_PATH:-/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages}"
env -u PYTHONPATH "$here/gpu_tests.sh" "${name}_nofa4" &
nofa4=$!
PYTHONPATH="$fa4:$root" "$here/gpu_tests.sh" "${name}_fa4" &
with_fa4=$!
rc=0
wait "$nofa4" || rc=1
wait "$with_fa4" || rc=1
exit $rc
