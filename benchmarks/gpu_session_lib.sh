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
