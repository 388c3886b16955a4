#!/usr/bin/env bash
# GPU steps prepared by the thirty-sixth session. One step per argument, under its own time limit;
# outputs go into $OUT/r39/, packed into $OUT/r39_STEP.tar after every sub-step. Install FA4 first
# (three calls: .whlA, .whl, .whlB; benchmarks/README.md, thirty-sixth session).
#
#   bash benchmarks/gpu_session_r39.sh auto 300   # (FA4 installed) the `auto` rows of the forward
#                    # cases between 3e10 and 4e10 visible work, whose route changed when the
#                    # short-problem rule's forward bound moved from 4e10 to 3e10 (and the two
#                    # below it that split), into a copy of the sweep; afterwards copy
#                    # $OUT/r39/generalization_h200.json over benchmarks/results/ and run regret.py
set -uo pipefail
step="${1:?usage: $0 auto [BUDGET_S]}"
budget="${2:-300}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r39
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

MOVED=gemma3_27b_l4096_b1,prefix512_l2048_b8_d64,alibi_bidir_l2048_b8_d64,alibi_mpt7b_l2048_b4,softcap50_l2048_b8_d128,dinov2_g_l1370_b8,llama32_3b_l2048_b4

case "$step" in
  auto)
    cp benchmarks/results/generalization_h200.json "$out/generalization_h200.json"
    run generalization_auto_r39 "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --routes auto --modes fwd --cases "$MOVED" --out "$out/generalization_h200.json" \
      --md "$out/generalization_auto_r39.md" --quiet --time-budget "$(( $(left) - 40 ))"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
