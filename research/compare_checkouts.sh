#!/usr/bin/env bash
# Runs the headline commands from two checkouts side by side: the same greedy answers, and engine throughput
# over alternating runs (this machine is noisy: compare the ratio, not the figures).
# Usage: research/compare_checkouts.sh BASE_CHECKOUT HEAD_CHECKOUT OUT_DIR [RUNS]
#   (from the repository root, .venv built; checkouts: e.g. git worktree add /tmp/base COMMIT)
set -euo pipefail
BASE=$1; HEAD_DIR=$2; OUT=$3; RUNS=${4:-3}
mkdir -p "$OUT"
PY=.venv/bin/python
run() { PYTHONPATH="$1" "$PY" -m orchestrator.cli "${@:2}"; }
[ -f "$OUT/problems.jsonl" ] || run "$HEAD_DIR" generate --n 100 --k 1-20 --seed 3501 --output "$OUT/problems.jsonl"
for side in base head; do  # what is already measured in OUT is kept
  dir=$BASE; [ $side = head ] && dir=$HEAD_DIR
  [ -s "$OUT/solve_$side.txt" ] || run "$dir" solve "a=7;b=42;c=a+b;d=c*a;e=d-b;?e" > "$OUT/solve_$side.txt" 2>/dev/null
  [ -s "$OUT/greedy_$side.json" ] || run "$dir" eval --problems "$OUT/problems.jsonl" --workers 0 --json \
    --output "$OUT/greedy_$side.jsonl" > "$OUT/greedy_$side.json"
done
for i in $(seq "$RUNS"); do
  for side in base head; do
    dir=$BASE; [ $side = head ] && dir=$HEAD_DIR
    run "$dir" bench throughput --kv-budget 13.5MB --cr 1 8 --json \
      > "$OUT/throughput_${side}_$i.json"
  done
done
"$PY" - "$OUT" "$RUNS" <<'PY'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
def answers(side):
    return {r["id"]: r.get("answer") for r in map(json.loads, open(f"{out}/greedy_{side}.jsonl"))}
base, head = answers("base"), answers("head")
same = sum(base[i] == head.get(i) for i in base)
def tps(side):
    rows = {}
    for i in range(1, runs + 1):
        for run in json.load(open(f"{out}/throughput_{side}_{i}.json"))["runs"]:
            rows.setdefault(f"{run['method']} {run['cr']:g}x", []).append(run["tokens_per_s"])
    return rows
tb, th = tps("base"), tps("head")
summary = {"problems": len(base), "same_greedy_answers": same,
           "solve": {s: open(f"{out}/solve_{s}.txt").read().split("\n")[0] for s in ("base", "head")},
           "throughput_tokens_per_s": {m: {"base": tb[m], "head": th.get(m), "ratio_of_medians":
                                          statistics.median(th[m]) / statistics.median(tb[m])} for m in tb if m in th}}
print(json.dumps(summary, indent=1))
PY
