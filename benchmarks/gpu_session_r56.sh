#!/usr/bin/env bash
# GPU steps of the fifty-sixth session (outputs in $OUT/r56/, packed into $OUT/r56_STEP.tar).
# FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
# transformers 5.24 and its dependencies: one call carrying .whl (benchmarks/README.md, "Whole HF
# models under torch.compile"), `python3 -m pip install -q --no-index --no-deps --no-compile
# --target /tmp/site .whl/*.whl` before the step.
#
#   bash benchmarks/gpu_session_r56.sh band2 300     # (FA4 installed; on an H200) the two band
#                    # cases the fifty-fifth session did not reach, into generalization_h200.json
#   bash benchmarks/gpu_session_r56.sh flexex 240    # any card: every family's examples on the
#                    # (Triton) flex route (tests/gpu/test_examples_flex_routes_gpu.py -k "not
#                    # flex_flash"; the flex_flash half ran on an H100 this session)
#   bash benchmarks/gpu_session_r56.sh compiled 560  # (FA4 and /tmp/site) compiled Llama and
#                    # Mistral (window 2048) with FA4: HF sdpa / flex_attention / flexattn_zoo,
#                    # train and prefill, one process; rerun to resume
#   bash benchmarks/gpu_session_r56.sh host 200      # the eager host-cost table
set -uo pipefail
step="${1:?usage: $0 band2|flexex|compiled|host [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r56
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here
case "$step" in
  band2) band2 ;;
  flexex)
    run "gpu_tests_examples_flex_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m pytest -m gpu -q -rfE \
      -p no:cacheprovider -n 6 tests/gpu/test_examples_flex_routes_gpu.py -k "not flex_flash"
    ;;
  compiled)
    PYTHONPATH="/tmp/site:$PYTHONPATH" run "compiled_models_fa4_${gpu}_${session}" "$(( $(left) - 5 ))" \
      python3 benchmarks/compiled_models.py --models llama,mistral_swa --impls flexattn_zoo,flex_attention,sdpa \
      --modes train,prefill --steps 10 --warmup 2 --resume --json "/root/compiled_models_fa4_${gpu}_${session}.json" \
      --md "$out/compiled_models_fa4_${gpu}_${session}.md" --time-budget "$(( $(left) - 30 ))"
    # the JSON stays in /root (kept while the machine is warm) so a second call resumes it
    cp "/root/compiled_models_fa4_${gpu}_${session}.json" "$out/"
    ;;
  host)
    run "host_cost_${gpu}_${session}" "$(( $(left) - 5 ))" python3 benchmarks/host_cost.py --device cuda \
      --out "$out/host_cost_${gpu}_${session}.md"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
