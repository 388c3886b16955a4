#!/usr/bin/env bash
# GPU steps of the twenty-ninth session's second batch (FA4 installed, PYTHONPATH as in
# benchmarks/README.md, "Re-running"). One step per argument, under its own time limit; outputs go
# into $OUT/r31/, packed into $OUT/r31_STEP.tar after every sub-step.
#
#   bash benchmarks/gpu_session_r31.sh probe 420  # where a growing-cache decode's plan-cache miss
#                                                 # spends its host time (auto vs named routes); the
#                                                 # sweep's last missing route rows (softcap50); the
#                                                 # new rules' rows again, side by side
#   bash benchmarks/gpu_session_r31.sh tests 200  # the GPU fa4 tests r30 did not reach, then the
#                                                 # flex routes' GPU tests
set -uo pipefail
step="${1:?usage: $0 probe|tests [BUDGET_S]}"
budget="${2:-300}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r31
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  probe)
    run decode_growing_profile_h200_r31 120 python3 benchmarks/decode_growing_probe.py \
      --batch 32 --start 8000 --steps 60 --routes sdpa,fa4 --profile 100 --top 25
    cp benchmarks/results/generalization_h200.json /root/gen.json
    run generalization_softcap50_r31 140 python3 -m flexattn_zoo.bench generalization \
      --out /root/gen.json --resume --time-budget 110 --quiet --cases softcap50_l2048_b8_d128
    # The new rules' rows on this host, side by side in one process (their evidence rows were
    # host-bound on an earlier machine).
    run generalization_rules_recheck_r31 150 python3 -m flexattn_zoo.bench generalization \
      --out /root/gen.json --resume --rerun --time-budget 120 --quiet --routes flex,flex_flash,fa4,auto \
      --cases alibi_mpt7b_l2048_b4,alibi_bidir_l2048_b8_d64,docs_mixtral_l8192,docs_llama3_8b_l16k
    cp /root/gen.json "$out/generalization_h200.json"
    ;;
  tests)
    # The GPU fa4 tests after the first 44 (r30 ran those, then hit its time limit).
    python3 -m pytest --collect-only -q -p no:cacheprovider -m gpu tests/gpu -k fa4 2>/dev/null \
      | grep '::' | tail -n +45 > "$out/fa4_rest.txt"
    run gpu_tests_fa4_rest_r31 "$(( $(left) - 40 ))" xargs -a "$out/fa4_rest.txt" \
      python3 -m pytest -q -p no:cacheprovider -m gpu
    run gpu_tests_flex_r31 "$(( $(left) - 5 ))" python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/gpu/test_routes_gpu.py -k "flex and not fa4" -x
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
