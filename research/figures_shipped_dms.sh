#!/usr/bin/env bash
# DMS on the shipped model against its base model, greedy, paired on the same fresh problems: 400 mixed problems
# (k 1..20) and 100 whose first operands reach at least 8 assignments back, with the training-free presses held to
# 8x on the far-back set. Each ratio's file is paired with vanilla's (research/paired_gain.py: the difference and
# its 95% bootstrap interval). Outputs: $OUT (JSON, PNG); kept threads in runs/.
#   BASE: the base model (vanilla); DMS: the served directory whose adapters are measured (CR 1 = its weights).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results/shipped}
BASE=${BASE:-checkpoints/chain-qwen3-base}
DMS=${DMS:-checkpoints/chain-qwen3}
N=${N:-400}
N_FAR=${N_FAR:-100}
TAG=${TAG:-shipped}
RATIOS=${RATIOS:-1 2 4 8}
STEPS=${STEPS:-all}  # all | vanilla | dms | farback
mkdir -p "$OUT" runs
TP=.venv/bin/thinkpool
[ -f runs/mixed400_3901.jsonl ] || $TP generate --n "$N" --k 1-20 --seed 3901 --output runs/mixed400_3901.jsonl
[ -f runs/farback100_3902.jsonl ] || $TP generate --n "$N_FAR" --k 12-20 --seed 3902 --reach 8 --output runs/farback100_3902.jsonl
if [ "$STEPS" = all ] || [ "$STEPS" = vanilla ]; then
  [ -f runs/mixed400_vanilla.jsonl ] || $TP eval --problems runs/mixed400_3901.jsonl --model "$BASE" --workers 0 --json \
    --output runs/mixed400_vanilla.jsonl > "$OUT/mixed400_vanilla.json"
  [ -f runs/farback100_vanilla.jsonl ] || $TP eval --problems runs/farback100_3902.jsonl --model "$BASE" --workers 0 \
    --json --output runs/farback100_vanilla.jsonl > "$OUT/farback100_vanilla.json"
fi
if [ "$STEPS" = all ] || [ "$STEPS" = dms ]; then
  for cr in $RATIOS; do
    $TP eval --problems runs/mixed400_3901.jsonl --model "$DMS" --cr "$cr" --workers 0 --json \
      --output "runs/mixed400_${TAG}_cr$cr.jsonl" > "$OUT/mixed400_${TAG}_cr$cr.json"
    .venv/bin/python research/paired_gain.py "400 mixed=runs/mixed400_${TAG}_cr$cr.jsonl,runs/mixed400_vanilla.jsonl" \
      --names "${cr}x" vanilla > "$OUT/paired_${TAG}_cr${cr}_vs_vanilla.json"
  done
fi
if [ "$STEPS" = all ] || [ "$STEPS" = farback ]; then
  for cr in 4 8; do
    $TP eval --problems runs/farback100_3902.jsonl --model "$DMS" --cr "$cr" --workers 0 --json \
      --output "runs/farback100_${TAG}_cr$cr.jsonl" > "$OUT/farback100_${TAG}_cr$cr.json"
    .venv/bin/python research/paired_gain.py "100 far back=runs/farback100_${TAG}_cr$cr.jsonl,runs/farback100_vanilla.jsonl" \
      --names "${cr}x" vanilla > "$OUT/paired_farback_${TAG}_cr${cr}_vs_vanilla.json"
  done
  [ -f "$OUT/farback100_presses_8x.json" ] || $TP eval --problems runs/farback100_3902.jsonl --model "$BASE" \
    --press window streaming tova h2o knorm snapkv --compression 8 --json > "$OUT/farback100_presses_8x.json"
fi
