# Helpers shared by the gpu_session_rNN.sh step scripts (sourced, not run, from the repository
# root). The caller sets `session` (e.g. r28), `step`, `budget` (seconds) and `OUT`; `start`
# (epoch seconds) defaults to now. Outputs go into $OUT/$session/, packed into
# $OUT/${session}_${step}.tar after every sub-step (a device call brings back only a few files).
# `left` is the budget's seconds still left, `share PERCENT` that part of the whole budget.
out="${OUT:?set OUT}/${session:?set session}"
mkdir -p "$out"
start="${start:-$(date +%s)}"
# Results record the commit they measured (the device's copy of the tree has no .git).
export FLEXATTN_ZOO_GIT="${FLEXATTN_ZOO_GIT:-unknown}"
# This checkout first, keeping what the caller put on PYTHONPATH (FA4 installed under /tmp/fa4).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# The card, for result names (h100, h200, ...): lower-case model of GPU 0, "gpu" if unknown.
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h[0-9]+|b[0-9]+|a[0-9]+' | head -1 | tr 'A-Z' 'a-z')"
gpu="${gpu:-gpu}"

pack() { tar cf "${OUT}/${session}_${step}.tar" -C "$out" .; }
run() {  # run NAME LIMIT_S CMD...: stdout+stderr to $out/NAME.txt, exit status appended
  local name="$1" limit="$2"
  shift 2
  echo "\$ $*" > "$out/$name.txt"
  timeout "$limit" "$@" >> "$out/$name.txt" 2>&1
  echo "rc=$?" >> "$out/$name.txt"
  pack
}
left() { echo $(( budget - ($(date +%s) - start) )); }
share() { echo $(( budget * $1 / 100 )); }  # share PERCENT: that part of the budget, in seconds

# Steps more than one session ran (each session's script names them in its own usage line).
band2() {  # (FA4; an H200) the Llama-3.2-3B 4 x 2K and Gemma-3-27B 4K cases, every route beside
  # plain SDPA and auto_tuned, into a copy of the committed generalization_h200.json
  cp benchmarks/results/generalization_h200.json "$out/generalization_h200.json"
  run "generalization_band2_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench generalization \
    --resume --rerun --out "$out/generalization_h200.json" --cases llama32_3b_l2048_b4,gemma3_27b_l4096_b1 \
    --routes auto,auto_tuned,plain_sdpa,sdpa,sdpa_cudnn,sdpa_flash,flex,flex_flash,fa4 \
    --md "$out/generalization_band2_${gpu}_${session}.md" --quiet --time-budget "$(( $(left) - 35 ))"
}
zoo_sweep() {  # zoo_sweep SUFFIX [EXTRA ARGS...]: the zoo sweep on ROUTES (auto,raw_flex) and CASES
  # (every case) into /root/zoo_${gpu}${SUFFIX}_${session}.json, kept while the machine is warm so
  # that a second call resumes it
  local name="zoo_${gpu}$1_${session}"
  shift
  run "$name" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench zoo --routes "${ROUTES:-auto,raw_flex}" \
    --out "/root/$name.json" --md "$out/$name.md" --quiet --resume ${CASES:+--cases "$CASES"} \
    --time-budget "$(( $(left) - 35 ))" "$@"
  cp "/root/$name.json" "$out/"
}
zoo_nofa4() {  # the zoo without FA4 into zoo_GPU-nofa4_SESSION.json; a fresh machine resumes from
  # the committed rows of its card: benchmarks/results/zoo_GPU-nofa4_SESSION.json, else those of
  # the session RESUME_FROM names (e.g. r60)
  local name="zoo_${gpu}-nofa4_${session}" kept
  for kept in "benchmarks/results/$name.json" "benchmarks/results/zoo_${gpu}-nofa4_${RESUME_FROM:-none}.json"; do
    [ -f "/root/$name.json" ] || { [ -f "$kept" ] && cp "$kept" "/root/$name.json"; }
  done
  zoo_sweep "-nofa4" --no-fa4
}
short_beside_sdpa() {  # no FA4: the sweep's short, host-bound cases on auto beside plain SDPA and the
  # SDPA routes (the hand-written-calls view)
  run "generalization_short_${gpu}_${session}" "$(( $(left) - 5 ))" python3 -m flexattn_zoo.bench generalization \
    --out "$out/generalization_short_${gpu}_${session}.json" --no-fa4 \
    --cases bert_base_l128_b128,llama3_8b_l128_b64,vit_b16_l197_b64,bert_base_l512_b32,gpt2_l1024_b16,vit_h14_l257_b16_d80,decode_qwen25_7b_b64_1k,decode_llama3_70b_b8_4k \
    --routes auto,plain_sdpa,sdpa,sdpa_cudnn,sdpa_flash,sdpa_efficient \
    --md "$out/generalization_short_${gpu}_${session}.md" --quiet --time-budget "$(( $(left) - 35 ))"
}
verify() {  # verify [LIMIT_S]: the GPU tests matching TESTK (a pytest -k expression) into
  # $out/gpu_tests_GPU_SESSION.txt, within LIMIT_S seconds (default: the budget left)
  run "gpu_tests_${gpu}_${session}" "${1:-$(( $(left) - 5 ))}" python3 -m pytest -m gpu -q -rfE \
    -p no:cacheprovider -n 4 tests/gpu -k "${TESTK:?set TESTK}"
}
