#!/usr/bin/env bash
# At equal KV memory, on the shipped pair: the vote of the 8x threads that fit against the vote of vanilla's, on
# 300 fresh hard problems (k 16..20, seed 4201), a 13.5 MB pool (about four vanilla threads of 1000 tokens),
# at most 1000 tokens a thread. Temperatures were chosen before this draw, on the 30-problem dev probe (seed 4101):
# 8x at 0.5, vanilla at 0.8 (DMS_T and VANILLA_T change them; the sides' thread files carry them, the summary's
# paired outputs do not: give each pair of temperatures its own OUT).
# Resumable: the problems run in chunks of $CHUNK, and a chunk whose kept threads exist is skipped, so a stopped run
# picks up where it left off. The two sides are independent: run SIDE=vanilla and SIDE=dms side by side, one per core,
# then SIDE=summary pairs them (research/paired_gain.py) and plots the vote curves. FROM and TO bound the problems a
# run takes (chunk-aligned), so one side can also be split over two cores: FROM=0 TO=75 beside FROM=75.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results/shipped_pair}
BASE=${BASE:-checkpoints/chain-qwen3-base}
DMS=${DMS:-checkpoints/chain-qwen3}
N=${N:-300}
CHUNK=${CHUNK:-25}
FROM=${FROM:-0}
TO=${TO:-$N}
SEED=${SEED:-4201}
BUDGET=${BUDGET:-13.5MB}
SIDE=${SIDE:?SIDE=vanilla, dms or summary}
DMS_T=${DMS_T:-0.5}
VANILLA_T=${VANILLA_T:-0.8}
DSIDE=cr8_T$DMS_T  # each side's name, in its files' names
VSIDE=vanilla_T$VANILLA_T
TAG=hard${N}_$SEED
TP=.venv/bin/thinkpool
mkdir -p "$OUT" runs/equal_memory
PROBLEMS=runs/equal_memory/$TAG.jsonl
[ -f "$PROBLEMS" ] || $TP generate --n "$N" --k 16-20 --seed "$SEED" --output "$PROBLEMS"

run_side() {  # name, then the eval's model and sampling arguments
  local name=$1; shift
  local start
  for ((start = FROM; start < TO; start += CHUNK)); do
    local part=runs/equal_memory/${TAG}_${name}_$start
    [ -f "$part.threads.jsonl" ] && continue
    sed -n "$((start + 1)),$((start + CHUNK))p" "$PROBLEMS" > "$part.problems.jsonl"
    echo "$(date +%T) $name: problems $start..$((start + CHUNK - 1))" >&2
    $TP eval --problems "$part.problems.jsonl" "$@" --kv-budget "$BUDGET" --samples fit --max-new-tokens 1000 \
      --workers 0 --json --output "$part.partial.jsonl" > "$part.json"
    mv "$part.partial.jsonl" "$part.threads.jsonl"  # only a finished chunk counts
  done
}

case "$SIDE" in
  vanilla) run_side "$VSIDE" --model "$BASE" --temperature "$VANILLA_T" ;;
  dms) run_side "$DSIDE" --model "$DMS" --cr 8 --temperature "$DMS_T" ;;
  summary)
    V=runs/equal_memory/${TAG}_$VSIDE.jsonl
    D=runs/equal_memory/${TAG}_$DSIDE.jsonl
    for side in $VSIDE $DSIDE; do  # every chunk must be done: the pairing is over all N problems
      for ((start = 0; start < N; start += CHUNK)); do
        [ -f "runs/equal_memory/${TAG}_${side}_$start.threads.jsonl" ] || { echo "$side: chunk $start not done" >&2; exit 1; }
      done
      cat runs/equal_memory/${TAG}_${side}_*.threads.jsonl > "runs/equal_memory/${TAG}_$side.jsonl"
    done
    .venv/bin/python research/paired_gain.py "$N hard (k 16..20, seed $SEED)=$D,$V" \
      --names "8x, T$DMS_T" "vanilla, T$VANILLA_T" --plot "$OUT/equal_memory_${TAG}_gain.png" > "$OUT/equal_memory_${TAG}_paired.json"
    .venv/bin/python research/vote_curve.py "8x T$DMS_T=$D" "vanilla T$VANILLA_T=$V" \
      --plot "$OUT/equal_memory_${TAG}_vote_curve.png" > "$OUT/equal_memory_${TAG}_vote_curve.json"
    .venv/bin/python research/vote_agreement.py "8x, T$DMS_T=$D" "vanilla, T$VANILLA_T=$V" > "$OUT/equal_memory_${TAG}_agreement.json"
    for side in $DSIDE $VSIDE; do  # the same threads under other votes (majority, confidence-weighted, ...)
      .venv/bin/python research/score_aggregations.py "runs/equal_memory/${TAG}_$side.jsonl" \
        > "$OUT/equal_memory_${TAG}_${side}_aggregations.json"
    done
    for side in $VSIDE $DSIDE; do  # the chunks' summaries, merged (threads, compression, time)
      .venv/bin/python - "$OUT/equal_memory_${TAG}_$side.json" "runs/equal_memory/${TAG}_$side.jsonl" \
        runs/equal_memory/${TAG}_${side}_*.json <<'EOF'
import json, sys
from evaluation.scoring import realized_cr_by_length
parts = [json.load(open(p)) for p in sys.argv[3:]]
n = sum(p["n"] for p in parts)
mean = lambda key: sum(p[key] * p["n"] for p in parts) / n
merged = {"method": parts[0]["method"], "n": n, "chunks": len(parts), "accuracy": mean("accuracy"),
          "mean_thread_accuracy": mean("mean_thread_accuracy"), "samples_per_problem": mean("samples_per_problem"),
          "realized_cr": mean("realized_cr"), "kv_cr": mean("kv_cr"),
          "kv_peak_bytes": max(p["kv_peak_bytes"] for p in parts), "kv_budget_bytes": parts[0]["kv_budget_bytes"],
          "tokens_generated": sum(p["tokens_generated"] for p in parts), "elapsed_s": sum(p["elapsed_s"] for p in parts),
          "preemptions": sum(p["preemptions"] for p in parts), "config": parts[0]["config"]}
merged["realized_cr_by_length"] = realized_cr_by_length([json.loads(line) for line in open(sys.argv[2])])
json.dump(merged, open(sys.argv[1], "w"), indent=1)
EOF
    done ;;
  *) echo "SIDE must be vanilla, dms or summary" >&2; exit 2 ;;
esac
