#!/usr/bin/env bash
# DMS against vanilla and the training-free baselines, greedy, on fresh problems.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=docs/results
mkdir -p "$OUT" runs
.venv/bin/thinkpool generate --n 200 --k 1-20 --seed 2001 --output runs/dms_k1-20.jsonl
.venv/bin/thinkpool generate --n 100 --k 12-20 --seed 2002 --reach 8 --output runs/farback_k12-20.jsonl
.venv/bin/thinkpool eval --problems runs/dms_k1-20.jsonl --cr 1 2 4 8 --json --plot "$OUT/dms_pareto.png" > "$OUT/dms_k1-20.json"
.venv/bin/thinkpool eval --problems runs/farback_k12-20.jsonl --cr 1 8 --press window streaming tova h2o knorm snapkv \
  --compression 8 --json --plot "$OUT/farback_8x.png" > "$OUT/farback_8x.json"
