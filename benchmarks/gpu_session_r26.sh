#!/usr/bin/env bash
# GPU steps prepared in the twenty-fifth session for the next one (its changes not yet run on a
# GPU), one step per argument, each under its own time limit so one call of the device tool (10
# minutes at most) always returns what it measured. FA4 importable (PYTHONPATH as in
# benchmarks/README.md, "Re-running"). Outputs go into $OUT/r26/, packed into $OUT/r26_STEP.tar
# after every sub-step.
#
#   bash benchmarks/gpu_session_r26.sh probes 400   # (FA4 not needed) the host layers (static-shape
#                                                   # flex entry again), a flex entry's static
#                                                   # against its dynamic-shape graph, the decoding
#                                                   # row without FA4 under the new rule
#   bash benchmarks/gpu_session_r26.sh fa4tests 300 # the fa4 route's eager path (GPU tests of the
#                                                   # route, its compile / export / CUDA-graph tests,
#                                                   # the cache-prefix test with FA4)
#   bash benchmarks/gpu_session_r26.sh short 540    # the sweep's short, host-bound cases again with
#                                                   # every route, under the harness's time-filled
#                                                   # counts (/root/gen.json, seeded from results/)
#   bash benchmarks/gpu_session_r26.sh finish 540   # the sweep's cases still missing routes
#   bash benchmarks/gpu_session_r26.sh tuned 540    # auto_tuned on the pairs auto misses most
set -uo pipefail
step="${1:?usage: $0 probes|fa4tests|short|finish|tuned [BUDGET_S]}"
budget="${2:-520}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r26
source benchmarks/gpu_session_lib.sh  # out, pack, run, left

sweep_rows() {  # sweep_rows NAME [ARGS...]: the sweep resumed into /root/gen.json until the budget ends
  local name="$1"
  shift
  [ -f /root/gen.json ] || cp benchmarks/results/generalization_h200.json /root/gen.json
  local b
  b=$(( $(left) - 30 ))
  if [ "$b" -gt 90 ]; then
    run "$name" "$(( b + 20 ))" python3 -m flexattn_zoo.bench generalization --out /root/gen.json --resume \
      --time-budget "$(( b - 70 ))" --quiet "$@"
  fi
  cp /root/gen.json "$out/generalization_h200.json"
  pack
}

# Cases whose rows are short and host-bound (their 8-call medians swung by up to 1.7x between two
# rows of one route in the twenty-fifth session's sweep).
SHORT=llama3_8b_l128_b64,bert_base_l128_b128,bert_base_l512_b32,vit_b16_l197_b64,decode_llama3_8b_b1_32k,decode_llama2_7b_b16_2k,gpt2_l1024_b16,qwen25_05b_l1024_b16,vit_h14_l257_b16_d80,decode_qwen25_7b_b64_1k

case "$step" in
  fa4tests)
    run gpu_tests_r26_fa4 "$(left)" python3 -m pytest -m gpu -q -rfEs tests/gpu/test_routes_gpu.py \
      tests/gpu/test_compile_gpu.py tests/gpu/test_dropin_gpu.py -k "fa4 or cache_prefixes"
    ;;
  probes)
    PYTHONPATH="$PWD" run host_layers_h200_r26 60 python3 benchmarks/host_layers_probe.py --device cuda
    PYTHONPATH="$PWD" run static_dynamic_probe_h200 150 python3 benchmarks/static_dynamic_probe.py
    run run_h200_nofa4_decode 120 env OUT="$out" bash benchmarks/run_h200.sh nofa4 --resume --rerun \
      --routes auto,flex,sdpa,plain_sdpa --cases decode_gqa --quiet
    ;;
  short) sweep_rows generalization_short_r26 --rerun --cases "$SHORT" ;;
  finish) sweep_rows generalization_finish_r26 ;;
  tuned)
    sweep_rows generalization_tuned_r26 --routes auto_tuned --cases \
      gemma3_4b_local1024_l8192_d256,docs_llama3_8b_l16k,llama3_8b_l128_b64,vit_b16_l197_b64,decode_llama3_8b_b1_32k,bert_base_l128_b128
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
ls -la "$out"
