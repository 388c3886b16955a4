#!/usr/bin/env bash
# GPU steps of the forty-seventh session. One step per argument, under its own time limit; outputs
# go into $OUT/r47/ (names carry the card), packed into $OUT/r47_STEP.tar after every sub-step.
# FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
#
#   bash benchmarks/gpu_session_r47.sh host 420     # the host table twice (two processes, one
#                    # host) after decode_step's step plans and the bare-spec copy, then the
#                    # hit's pieces (host_path_probe.py)
#   bash benchmarks/gpu_session_r47.sh tunedall 560 # (FA4 installed) the tuned cases, every route
#                    # and auto_tuned in one process (the lowest-ratio cases first; CASES=a,b to pick)
#   bash benchmarks/gpu_session_r47.sh hostone 150  # the host table once more
#   bash benchmarks/gpu_session_r47.sh compiletests 300  # (FA4 installed) the compile GPU suite
#   bash benchmarks/gpu_session_r47.sh replay 300   # (FA4 installed) the replayed FA4 launches: their
#                    # GPU tests, the fa4 route's tests, then fa4_host.py
#   bash benchmarks/gpu_session_r47.sh diag 200     # (FA4 installed) the replay GPU tests alone, then
#                    # fa4_replay_diag.py (programs kept, cProfile of replayed calls)
#   bash benchmarks/gpu_session_r47.sh fa4gen 400   # (FA4 installed) the cases where fa4 or auto's
#                    # FA4 choice decide, routes that matter, with replayed launches (CASES= to pick)
#   bash benchmarks/gpu_session_r47.sh ffforward 300 # (FA4 installed) can
#                    # flex's FLASH backend run forward-only graphs with q/k/v frozen or copied?
#   bash benchmarks/gpu_session_r47.sh fa4replay 200 # (FA4 installed) FA4's
#                    # forward host time against a replay of its recorded compiled call
set -uo pipefail
step="${1:?usage: $0 host|compiletests|replay|diag|fa4gen|tunedall|hostone|ffforward|fa4replay [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r47
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  host)
    for run_id in a b; do
      run "host_cost_${gpu}_r47${run_id}" "$(share 42)" python3 benchmarks/host_cost.py --device cuda \
        --out "$out/host_cost_${gpu}_r47${run_id}.md"
    done
    run "host_path_probe_${gpu}_r47" "$(( $(left) - 5 ))" python3 benchmarks/host_path_probe.py --device cuda
    ;;
  replay)  # the replay tests, the fa4 route's layout tests and its compiled / exported / graphed op
    run "gpu_tests_fa4_replay_${gpu}_r47" "$(share 60)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
      tests/gpu/test_fa4_replay_gpu.py "tests/gpu/test_routes_gpu.py::test_fa4_layouts_with_lse_and_gqa" \
      "tests/gpu/test_routes_gpu.py::test_fa4_takes_projection_layout_and_scale" tests/gpu/test_compile_gpu.py -k "fa4 or replay"
    run "fa4_host_${gpu}_r47" "$(( $(left) - 5 ))" python3 benchmarks/fa4_host.py --out "$out/fa4_host_${gpu}_r47.md"
    ;;
  diag)
    run "gpu_tests_fa4_replay_only_${gpu}_r47" "$(share 45)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
      tests/gpu/test_fa4_replay_gpu.py
    run "fa4_replay_diag_${gpu}_r47" "$(( $(left) - 5 ))" python3 benchmarks/fa4_replay_diag.py
    ;;
  fa4gen)
    cases="${CASES:-dinov2_g_l1370_b8,gemma3_27b_l4096_b1,llama32_3b_l2048_b4,gpt2_l1024_b16,llama3_8b_l128_b64,vit_b16_l197_b64,bert_base_l128_b128,docs_llama3_8b_l16k}"
    cp benchmarks/results/generalization_h200.json "$out/generalization_fa4replay_${gpu}.json"
    run "generalization_fa4replay_${gpu}_r47" "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --out "$out/generalization_fa4replay_${gpu}.json" --cases "$cases" \
      --routes auto,plain_sdpa,sdpa,flex_flash,fa4 \
      --md "$out/generalization_fa4replay_${gpu}_r47.md" --quiet --time-budget "$(( $(left) - 60 ))"
    ;;
  compiletests)  # (FA4 installed) tests/gpu/test_compile_gpu.py
    run "gpu_tests_compile_${gpu}_r47" "$(( $(left) - 5 ))" python3 -m pytest -m gpu -q -rfE \
      -p no:cacheprovider -n 4 tests/gpu/test_compile_gpu.py
    ;;
  tunedall)  # (FA4 installed) the tuned cases with every route and auto_tuned in one process, so
    # the tuning regret compares rows of one host (the tuned rows alone compare across sessions);
    # CASES overrides the list (lowest tuned ratios first)
    cases="${CASES:-vit_b16_l197_b64,bert_base_l512_b32,bert_base_l128_b128,gemma3_27b_l4096_b1,decode_llama3_8b_b1_32k,llama2_13b_l4096_b1,dinov2_g_l1370_b8,llama3_8b_l128_b64,docs_llama3_8b_l16k,alibi_bidir_l2048_b8_d64,decode_llama2_7b_b16_2k,gemma3_4b_local1024_l8192_d256,gpt2_l1024_b16,llama32_3b_l2048_b4,modernbert_l8192_local}"
    cp benchmarks/results/generalization_h200.json "$out/generalization_tunedall_${gpu}.json"
    run "generalization_tunedall_${gpu}_r47" "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --out "$out/generalization_tunedall_${gpu}.json" --cases "$cases" \
      --routes auto,auto_tuned,plain_sdpa,raw_flex,sdpa_dense_mask,sdpa,sdpa_cudnn,sdpa_flash,sdpa_efficient,sdpa_split,varlen,flex,flex_flash,fa4 \
      --md "$out/generalization_tunedall_${gpu}_r47.md" --quiet --time-budget "$(( $(left) - 60 ))"
    ;;
  ffforward)  # (FA4 installed) flex with BACKEND="FLASH" in forward-only compiled graphs
    run "flex_flash_forward_graph_probe_${gpu}_r47" "$(( $(left) - 5 ))" python3 \
      benchmarks/flex_flash_forward_graph_probe.py
    ;;
  fa4replay)  # (FA4 installed) FA4's forward host time against replaying its recorded kernel call
    run "fa4_replay_probe_${gpu}_r47" "$(share 50)" python3 benchmarks/fa4_replay_probe.py
    run "fa4_replay_probe_causal_${gpu}_r47" "$(( $(left) - 5 ))" python3 benchmarks/fa4_replay_probe.py --causal
    ;;
  hostone)
    run "host_cost_${gpu}_r47c" "$(( $(left) - 5 ))" python3 benchmarks/host_cost.py --device cuda \
      --out "$out/host_cost_${gpu}_r47c.md"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
