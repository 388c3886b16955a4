#!/usr/bin/env bash
# Run the GPU test suite (`pytest -m gpu tests/gpu`) on a CUDA machine as three parallel pytest
# processes (correctness only, nothing is timed, so sharing the GPU is harmless), and write
#   $OUT/NAME.txt                   the pytest outputs in full (-rfEs: failures, every skip with
#                                   its reason; --durations: the slowest tests; part c with -s:
#                                   the soak's numbers)
#   $OUT/NAME-determinism.json      per route: accepted / refused with reasons, bitwise over 10 runs
#   $OUT/NAME-soak.json             the GPU soak's numbers: calls by kind and route, seconds and
#                                   compiles per round, RSS and device memory per round
#
#   benchmarks/gpu_tests.sh gpu_tests_nofa4                                  # FA4 not importable
#   PYTHONPATH=/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages:$PWD benchmarks/gpu_tests.sh gpu_tests_fa4
#
# Environment: OUT (default benchmarks/results), PYTHON (default python3), TEST_TIMEOUT seconds per
# process (default 540), PARTS (default "a b c d e": a = routes + determinism, b = fuzz + decode,
# c = the soak, tests/gpu/test_soak_gpu.py, whose knobs FLEXATTN_ZOO_SOAK_CALLS / _STREAMS pass through,
# d = fz.attention under torch.compile / CUDA graphs / export, tests/gpu/test_compile_gpu.py, in
# D_WORKERS pytest-xdist processes when set: its compiles are CPU-bound), e = the drop-in surfaces
# (tensor masks and biases, is_causal, layouts, varlen_attention, Dv != Dqk, paged pools),
# tests/gpu/test_dropin_gpu.py).
# Exit code: non-zero if any process failed or timed out.
set -uo pipefail
name="${1:?usage: $0 NAME}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
out="${OUT:-$root/benchmarks/results}"
limit="${TEST_TIMEOUT:-540}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-$root}" PYTHONUNBUFFERED=1
export FLEXATTN_ZOO_DETERMINISM_SUMMARY="$out/$name-determinism.json"
export FLEXATTN_ZOO_SOAK_SUMMARY="$out/$name-soak.json"
# find_spec('flash_attn.cute') raises when the flash_attn package itself is missing.
fa4=$("$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('flash_attn') is None or u.find_spec('flash_attn.cute') is None)" 2>/dev/null \
  && echo "FA4 importable" || echo "FA4 not importable")

run() {  # part, pytest args...
  local part=$1; shift
  timeout "$limit" "$py" -m pytest -m gpu -q -rfEs --durations=10 -p no:cacheprovider "$@" >"$logs/$part.log" 2>&1
  echo $? >"$logs/$part.rc"
}
logs="$(mktemp -d)"
parts="${PARTS:-a b c d e}"
start=$(date +%s)
for part in $parts; do
  case $part in
    a) run a tests/gpu/test_routes_gpu.py tests/gpu/test_determinism_gpu.py & ;;
    b) run b tests/gpu/test_fuzz_gpu.py tests/gpu/test_decode_gpu.py & ;;
    c) run c -s tests/gpu/test_soak_gpu.py & ;;
    d) run d ${D_WORKERS:+-n "$D_WORKERS"} tests/gpu/test_compile_gpu.py & ;;
    e) run e tests/gpu/test_dropin_gpu.py & ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
wait
rc=0
{
  echo "# pytest -m gpu tests/gpu on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $fa4"
  echo "# command: benchmarks/gpu_tests.sh $name ($(wc -w <<<"$parts") processes in parallel, $(( $(date +%s) - start )) s wall)"
  "$py" -c "import torch, triton; print('# torch', torch.__version__, 'triton', triton.__version__, 'cuDNN', torch.backends.cudnn.version())" 2>/dev/null
  for part in $parts; do
    echo; echo "## part $part: exit code $(cat "$logs/$part.rc") (124: stopped at TEST_TIMEOUT)"
    grep -v -E "^\s*$|DeprecationWarning|warnings.warn" "$logs/$part.log"
    [ "$(cat "$logs/$part.rc")" = 0 ] || rc=1
  done
} >"$out/$name.txt"
for part in $parts; do tail -n 3 "$logs/$part.log"; done
exit $rc
