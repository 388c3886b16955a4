#!/usr/bin/env bash
# GPU steps prepared by the thirty-seventh session. One step per argument, under its own time limit;
# outputs go into $OUT/r40/, packed into $OUT/r40_STEP.tar after every sub-step. Install FA4 first
# (three calls: .whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session) and transformers
# into /tmp/site (carry .whl).
#
#   bash benchmarks/gpu_session_r40.sh verify 570      # the zoo GPU tests (every family on
#                    # auto/flex/flex_flash eagerly, and compiled whole on auto, fwd+bwd), the export /
#                    # CUDA-graph / static-cache decoding compile tests, the pair-load probe (torch's
#                    # default tiles tried first), the host-cost table with the score-mod flex
#                    # cases, and the zoo sweep's pair-loaded rows
#   bash benchmarks/gpu_session_r40.sh decode 110     # the decoding GPU tests (paged block lists
#                    # leave out -1 table entries since the fortieth session)
#   bash benchmarks/gpu_session_r40.sh gemma2prefill 200   # compiled Gemma 2 prefill without FA4
#                    # (--no-fa4 hides it): HF flex_attention and flexattn_zoo side by side (the
#                    # committed no-FA4 row predates building the BlockMask once per forward)
#   bash benchmarks/gpu_session_r40.sh fa4host 60      # (FA4 installed) the fa4 route's host time
#                    # layer by layer next to FA4's own flash_attn_func
#   bash benchmarks/gpu_session_r40.sh noisy 120       # the two sweep cases whose route rows' noise
#                    # gives the worst regret (BERT-base 128 x 128, GPT-2 1K x 16), SDPA routes and
#                    # auto again with 50 timed calls each, into a copy of the sweep
#   bash benchmarks/gpu_session_r40.sh softcap 150     # soft-capping on Triton flex: libdevice tanh,
#                    # the hardware tanh, and a cheap odd polynomial on the FMA pipe
#   bash benchmarks/gpu_session_r40.sh llamaprefill 150    # (FA4 installed) compiled Llama prefill,
#                    # HF flex_attention and flexattn_zoo in one process
set -uo pipefail
step="${1:?usage: $0 verify|decode|gemma2prefill|fa4host|noisy|softcap|llamaprefill [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r40
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  verify)
    run gpu_tests_zoo_r40 "$(( $(left) - 390 ))" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 4 \
      tests/gpu/test_zoo_gpu.py
    PYTHONPATH="/tmp/site:$PYTHONPATH" run gpu_tests_compile_r40 "$(( $(left) - 270 ))" python3 -m pytest -m gpu \
      -q -rfE -p no:cacheprovider -n 4 tests/gpu/test_compile_gpu.py \
      -k "export or reduce_overhead or hf_generate or decode_steps_over or eager_call_replays"
    run pair_load_probe_h200_r40 "$(( $(left) - 170 ))" python3 benchmarks/pair_load_probe.py --head-dims 64
    run host_cost_h200_r40 "$(( $(left) - 80 ))" python3 benchmarks/host_cost.py --device cuda \
      --out "$out/host_cost_h200_r40.md"
    run zoo_pairload_r40 "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench zoo --routes auto,raw_flex \
      --cases zoo_graphormer,zoo_rel_pos_bias --out "$out/zoo_pairload_r40.json" \
      --md "$out/zoo_pairload_r40.md" --quiet --time-budget "$(( $(left) - 30 ))"
    ;;
  decode)
    run gpu_tests_decode_r40 "$(( $(left) - 5 ))" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 4 \
      tests/gpu/test_decode_gpu.py
    ;;
  fa4host)
    run fa4_host_probe_h200_r40 "$(( $(left) - 5 ))" python3 benchmarks/fa4_host_probe.py --rounds 20
    ;;
  noisy)
    [ -f "$out/generalization_h200.json" ] || cp benchmarks/results/generalization_h200.json "$out/generalization_h200.json"
    run generalization_noisy_r40 "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --iters 50 --routes auto,sdpa,sdpa_cudnn,sdpa_flash,sdpa_efficient,plain_sdpa \
      --cases bert_base_l128_b128,gpt2_l1024_b16 --out "$out/generalization_h200.json" \
      --md "$out/generalization_noisy_r40.md" --quiet --time-budget "$(( $(left) - 30 ))"
    ;;
  softcap)
    run softcap_tanh_probe_h200_r40 "$(( $(left) - 5 ))" python3 benchmarks/softcap_tanh_probe.py
    ;;
  llamaprefill)
    PYTHONPATH="/tmp/site:$PYTHONPATH" run compiled_models_llama_prefill_fa4_r40 "$(( $(left) - 5 ))" \
      python3 benchmarks/compiled_models.py --models llama --impls flex_attention,flexattn_zoo \
      --modes prefill --steps 10 --warmup 2 --json "$out/compiled_models_llama_prefill_fa4_r40.json" \
      --md "$out/compiled_models_llama_prefill_fa4_r40.md" --time-budget "$(( $(left) - 30 ))"
    ;;
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
