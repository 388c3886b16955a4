#!/usr/bin/env bash
# The twenty-fourth session's GPU measurements, one step per argument, each under its own time
# limit so a call of the device tool (10 minutes at most) always returns what it measured.
# FA4 must be importable (PYTHONPATH as in benchmarks/README.md, "Re-running"); every output goes
# into $OUT/r24/ and is packed into $OUT/r24_STEP.tar at the end (a call brings back few files).
#
#   bash benchmarks/gpu_session_r24.sh verify      # GPU tests of the code not yet run on a GPU,
#                                                  # auto re-measured on mla_d192 / decode_gqa,
#                                                  # host layers, decode probes
#   bash benchmarks/gpu_session_r24.sh sweep 470   # the generalization sweep, resumed from
#                                                  # /root/gen.json (seeded from results/)
#   bash benchmarks/gpu_session_r24.sh final 200   # the flex routes on cache prefixes (test, probe),
#                                                  # three noisy sweep cases again at 30 iterations,
#                                                  # then the sweep resumed
set -uo pipefail
step="${1:?usage: $0 verify|sweep|final [BUDGET_S]}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export FLEXATTN_ZOO_GIT="${FLEXATTN_ZOO_GIT:-unknown}"
session=r24 budget=0 start=$(date +%s)
source benchmarks/gpu_session_lib.sh  # out, pack, run (left: unused here)

case "$step" in
  verify)
    run gpu_tests_r24 240 python3 -m pytest -m gpu -q -rfEs tests/gpu/test_dropin_gpu.py \
      tests/gpu/test_decode_gpu.py -k "fa4_value_head_dim or fa4_head_dims or long_caches or every_layout"
    OUT="$out" run run_h200_fa4 90 bash benchmarks/run_h200.sh fa4 --resume --rerun --routes auto \
      --cases mla_d192,decode_gqa --quiet
    OUT="$out" run run_h200_nofa4 90 bash benchmarks/run_h200.sh nofa4 --resume --rerun --routes auto \
      --cases mla_d192,decode_gqa --quiet
    run host_layers_h200_r24 60 python3 benchmarks/host_layers_probe.py --device cuda
    run decode_kernel_probe_h200_r24 60 python3 benchmarks/decode_kernel_probe.py --rounds 3 --steps 100 \
      --only flash,sdpa,decode_step,flex,fa4 --shapes 32:32:8:8192:128,8:32:8:8192:128
    ;;
  final)  # after the cache-prefix layout of the flex routes and the noisy rows' re-run
    run gpu_tests_r24_prefix 150 python3 -m pytest -m gpu -q -rfEs tests/gpu/test_dropin_gpu.py -k cache_prefixes
    run decode_kernel_probe_h200_r24_prefix 60 python3 benchmarks/decode_kernel_probe.py --rounds 3 --steps 100 \
      --only flash,sdpa,decode_step,flex --shapes 32:32:8:8192:128,8:32:8:8192:128
    run decode_gqa_routes_r24 90 python3 -m flexattn_zoo.bench flexattn_zoo/bench/configs/h200.yaml \
      --cases decode_gqa --routes auto,fa4,fa4_direct,flex,flex_flash,plain_sdpa --iters 50 \
      --out "$out/decode_gqa_routes_r24.json" --md "$out/decode_gqa_routes_r24.md" --quiet
    [ -f /root/gen.json ] || cp benchmarks/results/generalization_h200.json /root/gen.json
    run generalization_rerun_r24 120 python3 -m flexattn_zoo.bench generalization --out /root/gen.json --resume \
      --rerun --iters 30 --cases modernbert_l8192_local,llama2_13b_l4096_b1,bert_base_l512_b32 --quiet
    run generalization_sweep_r24 "${2:-200}" python3 -m flexattn_zoo.bench generalization \
      --out /root/gen.json --resume --time-budget "$(( ${2:-200} - 60 ))" --quiet
    cp /root/gen.json "$out/generalization_h200.json"
    ;;
  sweep)
    [ -f /root/gen.json ] || cp benchmarks/results/generalization_h200.json /root/gen.json
    run generalization_sweep_r24 "${2:-470}" python3 -m flexattn_zoo.bench generalization \
      --out /root/gen.json --resume --time-budget "$(( ${2:-470} - 60 ))" --quiet
    cp /root/gen.json "$out/generalization_h200.json"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
tar cf "${OUT}/r24_${step}.tar" -C "$out" .
ls -la "$out"
