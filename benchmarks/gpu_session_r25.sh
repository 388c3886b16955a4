#!/usr/bin/env bash
# The twenty-fifth session's GPU measurements, one step per argument, each under its own time
# limit so a call of the device tool (10 minutes at most) always returns what it measured.
# Outputs go into $OUT/r25/ and are packed into $OUT/r25_STEP.tar after every sub-step (a call
# brings back few files, and one cut short by its limit still brings back what it finished).
#
#   bash benchmarks/gpu_session_r25.sh probe 520   # the flex routes on cache prefixes (test), the
#                                                  # cycling decode probe (B=32, B=8), the host
#                                                  # layers, then `auto` and `sdpa` over the
#                                                  # generalization sweep without FA4 (--no-fa4)
#                                                  # until the budget ends (/root/gen_nofa4_auto.json)
#   bash benchmarks/gpu_session_r25.sh auto 540    # FA4 importable: `auto` and `sdpa` measured again
#                                                  # over the whole sweep (/root/gen.json, seeded
#                                                  # from results/); run again to resume
#   bash benchmarks/gpu_session_r25.sh sweep 540   # FA4 importable: the other routes of the sweep's
#                                                  # missing cases, resumed from /root/gen.json
#   bash benchmarks/gpu_session_r25.sh tuned 300   # FA4 importable: `auto_tuned` (measured route
#                                                  # choice from an empty table) on the cases where
#                                                  # the static order was furthest from the fastest
set -uo pipefail
step="${1:?usage: $0 probe|auto|sweep|tuned [BUDGET_S]}"
budget="${2:-520}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r25
source benchmarks/gpu_session_lib.sh  # out, pack, run, left

sweep_rows() {  # sweep_rows JSON NAME [ARGS...]: the sweep resumed into JSON until the budget ends
  local json="$1" name="$2"
  shift 2
  local b
  b=$(( $(left) - 30 ))
  if [ "$b" -gt 60 ]; then
    run "$name" "$(( b + 20 ))" python3 -m flexattn_zoo.bench generalization --out "$json" --resume \
      --time-budget "$(( b - 40 ))" --quiet "$@"
  fi
  cp "$json" "$out/" 2>/dev/null
  pack
}

case "$step" in
  probe)
    run gpu_tests_r25_prefix 150 python3 -m pytest -m gpu -q -rfEs tests/gpu/test_dropin_gpu.py -k cache_prefixes
    bash "$0" probes
    sweep_rows /root/gen_nofa4_auto.json generalization_nofa4_auto_r25 --no-fa4 --routes auto,sdpa,plain_sdpa
    ;;
  probes)  # the probes import the checkout alone (without FA4: the flex routes are what they time)
    PYTHONPATH="$PWD" run cycling_host_probe_h200_b32 120 python3 benchmarks/cycling_host_probe.py --batch 32 --route flex
    PYTHONPATH="$PWD" run cycling_host_probe_h200_b8 100 python3 benchmarks/cycling_host_probe.py --batch 8 --route flex
    PYTHONPATH="$PWD" run host_layers_h200_r25 60 python3 benchmarks/host_layers_probe.py --device cuda
    ;;
  sweep)
    [ -f /root/gen.json ] || cp benchmarks/results/generalization_h200.json /root/gen.json
    sweep_rows /root/gen.json generalization_sweep_r25
    ;;
  auto)
    [ -f /root/gen.json ] || cp benchmarks/results/generalization_h200.json /root/gen.json
    # The rows of `auto` and `sdpa` measured with the rules of this tree; --rerun drops the old
    # ones first, so a run cut short leaves the rest missing (a later --resume adds them).
    [ -f /root/auto_rerun_started ] || {
      touch /root/auto_rerun_started
      sweep_rows /root/gen.json generalization_auto_r25 --rerun --routes auto,sdpa
      exit 0
    }
    sweep_rows /root/gen.json generalization_auto_r25 --routes auto,sdpa
    ;;
  tuned)
    [ -f /root/gen.json ] || cp benchmarks/results/generalization_h200.json /root/gen.json
    sweep_rows /root/gen.json generalization_tuned_r25 --routes auto_tuned --cases \
      llama2_13b_l4096_b1,decode_llama2_7b_b16_2k,alibi_bidir_l2048_b8_d64,bert_base_l512_b32,modernbert_l8192_local
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
ls -la "$out"
