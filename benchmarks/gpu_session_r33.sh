#!/usr/bin/env bash
# GPU steps of the thirtieth session (FA4 not needed). One step per argument, under its own time
# limit; outputs go into $OUT/r33/, packed into $OUT/r33_STEP.tar after every sub-step.
#
#   bash benchmarks/gpu_session_r33.sh host 560   # host layers and the host-gap profile after flex
#                                                 # bound calls stopped re-checking their signature;
#                                                 # a growing-cache decode; the document rows of the
#                                                 # benchmark config (host-bound or not, one fresh
#                                                 # process); the flex routes' GPU tests and the soak
#   bash benchmarks/gpu_session_r33.sh fa4 480    # (FA4 installed) flex_flash's bound call over
#                                                 # repeated calls against the float64 reference,
#                                                 # then flex_flash's GPU route tests
#   bash benchmarks/gpu_session_r33.sh ab 420     # host layers of this tree and of b2c7ff7 (the
#                                                 # session's start) alternately on one host; ab_old/
#                                                 # made beforehand by: mkdir ab_old && git archive
#                                                 # b2c7ff7 flexattn_zoo masks score_mods
#                                                 # benchmarks/host_layers_probe.py | tar -x -C ab_old
set -uo pipefail
step="${1:?usage: $0 host|fa4|ab [BUDGET_S]}"
budget="${2:-300}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session=r33
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  host)
    run host_layers_h200_r33 100 python3 benchmarks/host_layers_probe.py --device cuda
    run host_gap_h200_r33 90 python3 benchmarks/host_gap_probe.py --parts profile
    run decode_growing_probe_h200_r33 90 python3 benchmarks/decode_growing_probe.py \
      --batch 32 --start 8000 --steps 60 --routes sdpa
    run h200_documents_r33 120 python3 -m flexattn_zoo.bench h200 --no-fa4 --routes auto,flex,sdpa \
      --cases document_causal,document_causal_d64,document_causal_gqa --modes fwd \
      --out "$out/h200_documents_r33.json" --md "$out/h200_documents_r33.md" --quiet
    run gpu_tests_flex_r33 "$(( $(left) - 5 ))" python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/gpu/test_routes_gpu.py tests/gpu/test_soak_gpu.py -k "flex or soak" -x
    ;;
  fa4)
    run flex_flash_bound_r33 120 python3 -c "
import torch, flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.testing import reference_attention
spec = masks.SlidingWindow(left=255, right=0) & masks.Causal()
for grad in (False, True):
  for step in range(4):
    q, k, v = (torch.randn(2, 8, 1024, 128, device='cuda', dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    out = fz.attention(q, k, v, mask=spec, backend='flex_flash')
    ref = reference_attention(q.double(), k.double(), v.double(), mask=spec)
    err = (out.double() - ref).abs().max().item()
    msg = ''
    if grad:
        g = torch.autograd.grad(out.float().square().sum(), (q,))[0]
        qr = q.detach().double().requires_grad_()
        gr = torch.autograd.grad(reference_attention(qr, k.double(), v.double(), mask=spec).square().sum(), (qr,))[0]
        msg = f' dq err {(g.double() - gr).abs().max().item():.2e}'
    print(f'flex_flash grad={grad} step {step}: max err {err:.2e}' + msg)
"
    run gpu_tests_flex_flash_r33 "$(( $(left) - 5 ))" python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/gpu/test_routes_gpu.py -k flex_flash -x
    ;;
  ab)
    for round in 1 2; do
      for tree in ab_old .; do
        echo "## $tree (round $round)" >> "$out/ab_host_h200_r33.txt"
        (cd "$tree" && PYTHONPATH=$PWD timeout 100 python3 benchmarks/host_layers_probe.py --device cuda --rounds 15 \
          | grep -E "flex:|sdpa:|dispatcher: fz.attention, no-op|decode: " >> "$out/ab_host_h200_r33.txt")
      done
    done
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
