#!/usr/bin/env bash
# GPU steps of the sixty-first session (outputs in $OUT/r61/, packed into $OUT/r61_STEP.tar).
# FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
#
#   bash benchmarks/gpu_session_r61.sh probe 560   # (FA4 installed) the global-tokens path under
#                    # Inductor options of its dense parts (benchmarks/global_tokens_launch_probe.py:
#                    # none, then cpp_wrapper), the GPU tests -k
#                    # global_tokens, then the global-window case of global_tokens_bound.yaml on fa4,
#                    # flex_flash and hand-written flex
#   bash benchmarks/gpu_session_r61.sh dense 580   # no FA4 needed: the compiled dense parts alone
#                    # (benchmarks/global_tokens_dense_probe.py: none, then cpp_wrapper), the GPU tests
#                    # -k global_tokens (those needing FA4 skip), then on the rest of the budget, halved,
#                    # the zoo without FA4 (resumed from r60's rows of the card: an H100's; an H200
#                    # starts afresh) and the short cases beside SDPA
#   bash benchmarks/gpu_session_r61.sh verify 200  # GPU tests: TESTK, the -k expression
set -uo pipefail
step="${1:?usage: $0 probe|dense|verify [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r61
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here
case "$step" in
  probe)
    run "global_tokens_launch_${gpu}_${session}_none" "$(share 16)" python3 -u benchmarks/global_tokens_launch_probe.py
    run "global_tokens_launch_${gpu}_${session}_cpp_wrapper" "$(share 22)" \
      python3 -u benchmarks/global_tokens_launch_probe.py cpp_wrapper
    TESTK=global_tokens verify "$(share 32)"
    run "global_tokens_bound_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench \
      benchmarks/global_tokens_bound.yaml --cases global_window_cls_w512 --routes fa4,flex_flash,raw_flex \
      --out "$out/global_tokens_bound_${gpu}_${session}.json" --md "$out/global_tokens_bound_${gpu}_${session}.md" \
      --quiet --time-budget "$(( $(left) - 35 ))"
    ;;
  dense)
    run "global_tokens_dense_${gpu}_${session}_none" "$(share 12)" python3 -u benchmarks/global_tokens_dense_probe.py
    run "global_tokens_dense_${gpu}_${session}_cpp_wrapper" "$(share 15)" \
      python3 -u benchmarks/global_tokens_dense_probe.py cpp_wrapper
    TESTK=global_tokens verify "$(share 20)"
    whole=$budget
    budget=$(( whole - $(left) / 2 ))
    RESUME_FROM=r60 zoo_nofa4
    budget=$whole
    short_beside_sdpa
    ;;
  verify) verify ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
