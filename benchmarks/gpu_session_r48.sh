#!/usr/bin/env bash
# GPU steps of the forty-eighth session. One step per argument, under its own time limit; outputs
# go into $OUT/$session/ (names carry the card and the session: r48 unless SESSION is set, as
# gpu_session_r49.sh sets it), packed into $OUT/${session}_STEP.tar after every sub-step.
# FA4: three calls (.whlA, .whlC, .whlB; benchmarks/README.md, thirty-seventh session).
#
#   bash benchmarks/gpu_session_r48.sh ffprobe 150  # (FA4 installed) flex_flash_replay_probe.py
#   bash benchmarks/gpu_session_r48.sh ffprofile 60  # (FA4 installed) flex_flash_host_profile.py
#   bash benchmarks/gpu_session_r48.sh replay2 200  # (FA4 installed) tests/gpu/test_fa4_replay_gpu.py
#   bash benchmarks/gpu_session_r48.sh ffgen 300    # (FA4 installed) flex_flash's cases, replayed
#   bash benchmarks/gpu_session_r48.sh replay 230   # (FA4 installed) the replay tests, the fa4 route's
#                    # layout tests and its compiled / exported / graphed op, then fa4_host.py
#   bash benchmarks/gpu_session_r48.sh fa4gen 540   # (FA4 installed) the cases between 2e9 and 6e10
#                    # of visible work that SDPA and FA4 both run, where the short-problem rules
#                    # decide between them, with replayed FA4 launches (CASES= to pick)
#   bash benchmarks/gpu_session_r48.sh tunedall 560 # (FA4 installed) the tuned cases, every route
#                    # and auto_tuned in one process (CASES=a,b to pick)
#   bash benchmarks/gpu_session_r48.sh host 400     # the host table twice, then host_path_probe.py
#   bash benchmarks/gpu_session_r48.sh compiletests 300  # (FA4 installed) the compile GPU suite
#   bash benchmarks/gpu_session_r48.sh gemma2fa4 540  # (FA4 installed; transformers under /tmp/site:
#                    # carry .whl with .whlC and run `python3 -m pip install -q --no-index --no-deps
#                    # --no-compile --target /tmp/site .whl/*.whl` there) the compiled Gemma-2
#                    # model, prefill then training, fz against HF flex_attention, FA4 launches replayed
set -uo pipefail
step="${1:?usage: $0 ffprobe|ffprofile|replay2|ffgen|replay|fa4gen|tunedall|host|compiletests|gemma2fa4 [BUDGET_S]}"
budget="${2:-200}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
session="${SESSION:-r48}"
source benchmarks/gpu_session_lib.sh  # the repository root is the working directory here

case "$step" in
  ffprobe)  # (FA4 installed) FA4 launches inside compiled FLASH-backend flex, replayed
    tpl="$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')/_inductor/kernel/flex/templates"
    grep -n "flash_attn\|_flash_attn_[fb]wd(" -A0 "$tpl"/flash_attention*.jinja > "$out/flash_templates_${gpu}_${session}.txt" 2>&1
    run "flex_flash_replay_probe_${gpu}_${session}" "$(( $(left) - 5 ))" python3 benchmarks/flex_flash_replay_probe.py
    ;;
  host)
    for run_id in a b; do
      run "host_cost_${gpu}_${session}${run_id}" "$(share 42)" python3 benchmarks/host_cost.py --device cuda \
        --out "$out/host_cost_${gpu}_${session}${run_id}.md"
    done
    run "host_path_probe_${gpu}_${session}" "$(( $(left) - 5 ))" python3 benchmarks/host_path_probe.py --device cuda
    ;;
  ffprofile)  # (FA4 installed) cProfile of compiled FLASH-backend flex calls
    run "flex_flash_host_profile_${gpu}_${session}" "$(( $(left) - 5 ))" python3 benchmarks/flex_flash_host_profile.py
    ;;
  replay2)  # (FA4 installed) the replay GPU tests alone (fa4 route and flex_flash's generated code)
    run "gpu_tests_fa4_replay2_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
      tests/gpu/test_fa4_replay_gpu.py
    ;;
  ffgen)  # (FA4 installed) the score-mod and prefix-LM cases flex_flash serves, its generated code's
    # FA4 launches replayed (CASES= to pick)
    cases="${CASES:-alibi_bidir_l2048_b8_d64,alibi_mpt7b_l2048_b4,softcap50_l2048_b8_d128,prefix512_l2048_b8_d64,gemma2_2b_global_softcap_l4096_d256,paligemma_prefix256_l1024_b4_d256}"
    cp benchmarks/results/generalization_h200.json "$out/generalization_ffreplay_${gpu}.json"
    run "generalization_ffreplay_${gpu}_${session}" "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --out "$out/generalization_ffreplay_${gpu}.json" --cases "$cases" \
      --routes auto,raw_flex,flex,flex_flash \
      --md "$out/generalization_ffreplay_${gpu}_${session}.md" --quiet --time-budget "$(( $(left) - 60 ))"
    ;;
  replay)  # the replay tests, the fa4 route's layout tests and its compiled / exported / graphed op
    run "gpu_tests_fa4_replay_${gpu}_${session}" "$(share 60)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
      tests/gpu/test_fa4_replay_gpu.py "tests/gpu/test_routes_gpu.py::test_fa4_layouts_with_lse_and_gqa" \
      "tests/gpu/test_routes_gpu.py::test_fa4_takes_projection_layout_and_scale" tests/gpu/test_compile_gpu.py -k "fa4 or replay"
    run "fa4_host_${gpu}_${session}" "$(( $(left) - 5 ))" python3 benchmarks/fa4_host.py --out "$out/fa4_host_${gpu}_${session}.md"
    ;;
  fa4gen)
    cases="${CASES:-llama3_8b_l128_b64,gpt2_medium_l1024_b8,bert_base_l512_b32,gpt2_l1024_b16,qwen25_05b_l1024_b16,vit_l14_l577_b32,llama32_1b_l512_b64,llama3_8b_l512_b32,dinov2_g_l1370_b8,llama32_3b_l2048_b4,gemma3_27b_l4096_b1,llama2_13b_l4096_b1,whisper_v3_enc_l1500_b16,modernbert_l8192_global}"
    cp benchmarks/results/generalization_h200.json "$out/generalization_fa4replay_${gpu}.json"
    run "generalization_fa4replay_${gpu}_${session}" "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --out "$out/generalization_fa4replay_${gpu}.json" --cases "$cases" \
      --routes auto,plain_sdpa,sdpa,flex_flash,fa4 \
      --md "$out/generalization_fa4replay_${gpu}_${session}.md" --quiet --time-budget "$(( $(left) - 60 ))"
    ;;
  compiletests)  # (FA4 installed) tests/gpu/test_compile_gpu.py
    run "gpu_tests_compile_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m pytest -m gpu -q -rfE \
      -p no:cacheprovider -n 4 tests/gpu/test_compile_gpu.py
    ;;
  tunedall)  # (FA4 installed) the tuned cases with every route and auto_tuned in one process, so
    # the tuning regret compares rows of one host (the tuned rows alone compare across sessions);
    # CASES overrides the list (lowest tuned ratios first)
    cases="${CASES:-vit_b16_l197_b64,bert_base_l512_b32,bert_base_l128_b128,gemma3_27b_l4096_b1,decode_llama3_8b_b1_32k,llama2_13b_l4096_b1,dinov2_g_l1370_b8,llama3_8b_l128_b64,docs_llama3_8b_l16k,alibi_bidir_l2048_b8_d64,decode_llama2_7b_b16_2k,gemma3_4b_local1024_l8192_d256,gpt2_l1024_b16,llama32_3b_l2048_b4,modernbert_l8192_local}"
    cp benchmarks/results/generalization_h200.json "$out/generalization_tunedall_${gpu}.json"
    run "generalization_tunedall_${gpu}_${session}" "$(( $(left) - 10 ))" python3 -m flexattn_zoo.bench generalization \
      --resume --rerun --out "$out/generalization_tunedall_${gpu}.json" --cases "$cases" \
      --routes auto,auto_tuned,plain_sdpa,raw_flex,sdpa_dense_mask,sdpa,sdpa_cudnn,sdpa_flash,sdpa_efficient,sdpa_split,varlen,flex,flex_flash,fa4 \
      --md "$out/generalization_tunedall_${gpu}_${session}.md" --quiet --time-budget "$(( $(left) - 60 ))"
    ;;
  gemma2fa4)
    PYTHONPATH="/tmp/site:$PYTHONPATH" run "compiled_models_gemma2_fa4_${gpu}_${session}" "$(( $(left) - 5 ))" \
      python3 benchmarks/compiled_models.py --models gemma2 --impls flexattn_zoo,flex_attention --modes prefill,train \
      --steps 6 --warmup 1 --json "$out/compiled_models_gemma2_fa4_${gpu}_${session}.json" \
      --md "$out/compiled_models_gemma2_fa4_${gpu}_${session}.md" --time-budget "$(( $(left) - 30 ))"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
pack
ls -la "$out"
