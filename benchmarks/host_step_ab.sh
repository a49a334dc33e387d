#!/usr/bin/env bash
# host_step.py for two source trees in turn (A B A B ...), each run a fresh process, so that
# a slow spell of a shared machine falls on both; then each phase's median over the runs
# and the ratio B / A at each row count.
#
#   benchmarks/host_step_ab.sh PAIRS TREE_A TREE_B [host_step.py args...]
#
# A tree is a folder holding a minivllm package (e.g. `git archive COMMIT minivllm | tar -x
# -C /tmp/base`); this tree's host_step.py runs both. One JSON per run under $OUT.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
# Each tree runs from its parent folder: a relative PY (.venv/bin/python) is made absolute.
[[ "$PY" == */* && "$PY" != /* ]] && PY=$PWD/$PY
OUT=${OUT:-/tmp/minivllm-host-step-$(date +%H%M)}
pairs=$1 a=$2 b=$3
shift 3
mkdir -p "$OUT"
for i in $(seq 1 "$pairs"); do
  for side in a b; do
    tree=$a
    [ "$side" = b ] && tree=$b
    (cd /tmp && PYTHONPATH=$tree "$PY" "$ROOT/benchmarks/host_step.py" --json "$OUT/$side-$i.json" \
      "$@" > "$OUT/$side-$i.log" 2>&1)
    echo "$side-$i done"
  done
done
"$PY" - "$OUT" <<'PYEOF'
import glob, json, statistics, sys
out = sys.argv[1]
runs = {s: [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{s}-*.json"))] for s in "ab"}
for rows in runs["a"][0]:
    print(f"\n{rows} rows: median over {len(runs['a'])} runs each, us/step")
    print(f"{'phase':<16} {'A':>10} {'B':>10} {'B/A':>7}")
    for phase in runs["a"][0][rows]:
        a = statistics.median(r[rows][phase] for r in runs["a"]) * 1e6
        b = statistics.median(r[rows][phase] for r in runs["b"]) * 1e6
        print(f"{phase:<16} {a:>10.1f} {b:>10.1f} {b / a if a else float('nan'):>7.2f}")
print(f"OUT={out}")
PYEOF
