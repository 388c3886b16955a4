#!/usr/bin/env bash
# GPU steps prepared by the thirty-seventh session. One step per argument, under its own time limit;
# outputs go into $OUT/r40/, packed into $OUT/r40_STEP.tar after every sub-step. Install FA4 first
# (three calls: .whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session) and transformers
# into /tmp/site (carry .whl).
#
#   bash benchmarks/gpu_session_r40.sh gemma2prefill 200   # compiled Gemma 2 prefill without FA4
#                    # (--no-fa4 hides it): HF flex_attention and flexattn_zoo side by side, the
#                    # one row of the compiled-model table never measured without FA4
set -uo pipefail
step="${1:?usage: $0 gemma2prefill [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r40
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  gemma2prefill)
    PYTHONPATH="/tmp/site:$PYTHONPATH" run compiled_models_gemma2_prefill_nofa4_r40 "$(( $(left) - 5 ))" \
      python3 benchmarks/compiled_models.py --models gemma2 --impls flex_attention,flexattn_zoo \
      --modes prefill --steps 10 --warmup 2 --no-fa4 --json "$out/compiled_models_gemma2_prefill_nofa4_r40.json" \
      --md "$out/compiled_models_gemma2_prefill_nofa4_r40.md" --time-budget "$(( $(left) - 30 ))"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
