#!/usr/bin/env bash
# GPU steps of the fifty-seventh session (outputs in $OUT/r57/, packed into $OUT/r57_STEP.tar).
# FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
# transformers 5.24 and its dependencies: one call carrying .whl (benchmarks/README.md, "Whole HF
# models under torch.compile"), `python3 -m pip install -q --no-index --no-deps --no-compile
# --target /tmp/site .whl/*.whl` before the step.
#
#   bash benchmarks/gpu_session_r57.sh band2 300     # (FA4 installed; on an H200) the two band
#                    # cases no session since the fifty-fourth reached, into generalization_h200.json
#   bash benchmarks/gpu_session_r57.sh flexex 240    # any card: every family's examples on the
#                    # (Triton) flex route (tests/gpu/test_examples_flex_routes_gpu.py -k "not
#                    # flex_flash"; both halves passed on an H100 in the fifty-sixth)
#   bash benchmarks/gpu_session_r57.sh compiled 560  # (FA4 and /tmp/site) compiled Llama and
#                    # Mistral (window 2048) with FA4: HF sdpa / flex_attention / flexattn_zoo,
#                    # train and prefill, one process; rerun to resume
#   bash benchmarks/gpu_session_r57.sh host 200      # the eager host-cost table
#   bash benchmarks/gpu_session_r57.sh compile 200   # any card (FA4 installed: more routes run):
#                    # tests/gpu/test_compile_gpu.py on the tree with the traced-walk fix
#   bash benchmarks/gpu_session_r57.sh dilated 300   # (FA4 installed) the strided (dilated) fa4
#                    # layout's GPU tests and the dilated zoo case on auto/raw_flex/flex_flash/fa4
#                    # (TESTK: the tests' -k expression; MODES: the zoo case's modes)
#   bash benchmarks/gpu_session_r57.sh zoo 300       # (FA4 installed) the zoo rows below the 1.3x
#                    # goal again, into a copy of zoo_h200.json on an H200 (CASES and ROUTES
#                    # override the cases and routes)
set -uo pipefail
step="${1:?usage: $0 compile|dilated|band2|flexex|compiled|host|zoo [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r57
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here
case "$step" in
  compile)
    run "gpu_tests_compile_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m pytest -m gpu -q -rfE \
      -p no:cacheprovider -n 6 tests/gpu/test_compile_gpu.py
    ;;
  dilated)
    # FA4 installed: the strided layout's GPU tests, then the dilated zoo case on every fast route
    run "gpu_tests_dilated_${gpu}_${session}" "$(share 45)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
      -n 4 tests/gpu/test_routes_gpu.py tests/gpu/test_compile_gpu.py tests/gpu/test_zoo_gpu.py \
      -k "${TESTK:-fa4_layouts or dilated}"
    run "zoo_dilated_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench zoo \
      --routes auto,raw_flex,flex_flash,fa4 --cases zoo_dilated_sliding_window --modes "${MODES:-fwd,fwdbwd}" \
      --out "$out/zoo_dilated_${gpu}_${session}.json" --md "$out/zoo_dilated_${gpu}_${session}.md" --quiet \
      --time-budget "$(( $(left) - 35 ))"
    ;;
  zoo)
    cases="${CASES:-zoo_dilated_sliding_window,zoo_flamingo_cross,zoo_global_window,zoo_rel_pos_bias,zoo_block_select,zoo_graphormer,zoo_tree}"
    # H200 rows join the committed H200 sweep; another card's start a file of their own.
    [ "$gpu" = h200 ] && cp benchmarks/results/zoo_h200.json "$out/zoo_${gpu}_${session}.json"
    run "zoo_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench zoo --routes "${ROUTES:-auto,raw_flex}" \
      --out "$out/zoo_${gpu}_${session}.json" --md "$out/zoo_${gpu}_${session}.md" --quiet --resume --rerun \
      --cases "$cases" --time-budget "$(( $(left) - 35 ))"
    ;;
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
