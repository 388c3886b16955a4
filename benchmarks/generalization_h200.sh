#!/usr/bin/env bash
# The generalization sweep (flexattn_zoo/bench/configs/generalization.yaml: attention shapes of real
# models) on one GPU, resumable: rows already in OUT_JSON are kept, and no new row starts after
# BUDGET seconds (exit 3), so a sweep longer than one session's command limit runs in several calls.
#
#   benchmarks/generalization_h200.sh benchmarks/results/generalization_h200.json 500
#   python benchmarks/regret.py benchmarks/results/generalization_h200.json     # the regret report
#
# With FA4 importable every route is measured in one process; the no-FA4 view is the same rows
# without fa4 / flex_flash (regret.py replays the dispatcher's order for it).
set -euo pipefail
out="${1:?usage: $0 OUT_JSON [BUDGET_S]}"
budget="${2:-500}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="${PYTHONPATH:-$PWD}"
export FLEXATTN_ZOO_BENCH_COMMAND="benchmarks/generalization_h200.sh $out $budget"
rc=0
python3 -m flexattn_zoo.bench generalization --out "$out" --resume --time-budget "$budget" --quiet || rc=$?
python3 - "$out" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
done = {(r["case"], r["mode"]) for r in rows}
print(f"{len(rows)} rows, {len(done)} (case, mode) pairs, {sum(r['status'] == 'ok' for r in rows)} ok")
PY
exit $rc
