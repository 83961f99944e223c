#!/usr/bin/env bash
# DMS against vanilla and the training-free baselines, greedy, on fresh problems (docs/dms.md).
# Vanilla is the base model ($BASE); the DMS ratios run on its retrofit, the shipped model (checkpoints/chain-qwen3,
# where CR 1 is its fine-tuned weights without eviction). Outputs: docs/results/v2/. The first shipped model's
# figures, in docs/results/ (its checkpoints rebuilt first: bash research/rebuild_first_model.sh):
#   BASE=checkpoints/chain-qwen3-v1 DMS=checkpoints/chain-qwen3-v1-dms OUT=docs/results bash research/figures_dms.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results/v2}
N=${N:-200}
N_FAR=${N_FAR:-40}
BASE=${BASE:-checkpoints/chain-qwen3-base}
DMS=${DMS:-checkpoints/chain-qwen3}
mkdir -p "$OUT" runs
.venv/bin/thinkpool generate --n "$N" --k 1-20 --seed 2001 --output runs/dms_k1-20.jsonl
.venv/bin/thinkpool generate --n "$N_FAR" --k 12-20 --seed 2002 --reach 8 --output runs/farback_k12-20.jsonl
.venv/bin/thinkpool eval --problems runs/dms_k1-20.jsonl --model "$BASE" --workers 0 --json > "$OUT/vanilla_k1-20.json"
.venv/bin/thinkpool eval --problems runs/dms_k1-20.jsonl --model "$DMS" --cr 1 2 4 8 --workers 0 --json \
  --plot "$OUT/dms_pareto.png" > "$OUT/dms_k1-20.json"
.venv/bin/thinkpool eval --problems runs/farback_k12-20.jsonl --model "$BASE" --workers 0 --json \
  > "$OUT/farback_vanilla.json"
.venv/bin/thinkpool eval --problems runs/farback_k12-20.jsonl --model "$DMS" --cr 8 --workers 0 --json > "$OUT/farback_dms8.json"
.venv/bin/thinkpool eval --problems runs/farback_k12-20.jsonl --model "$DMS" --cr 4 --workers 0 --json > "$OUT/farback_dms4.json"
.venv/bin/thinkpool eval --problems runs/farback_k12-20.jsonl --model "$BASE" \
  --press window streaming tova h2o knorm snapkv \
  --compression 8 --json > "$OUT/farback_presses_8x.json"
# One far-back plot of every method: vanilla, DMS 4x/8x and the presses against realized compression.
.venv/bin/python - "$OUT" <<'PY'
import json
import sys
from evaluation.plots import plot_pareto
out = sys.argv[1]
runs = [json.load(open(f"{out}/{name}.json")) for name in ("farback_vanilla", "farback_dms4", "farback_dms8")]
presses = json.load(open(f"{out}/farback_presses_8x.json"))
runs += presses.get("runs", [presses])
plot_pareto(runs, f"{out}/farback_8x.png", title="farback_k12-20.jsonl: accuracy against KV compression")
PY
