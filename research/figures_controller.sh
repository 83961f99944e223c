#!/usr/bin/env bash
# The controller against fixed (ratio, threads) configurations: same fresh mixed problems, same KV budget.
# 1. the calibration profile of the DMS model at every ratio; 2. the comparison (JSON + PNG).
# CAL_PROBLEMS: fresh problems per difficulty bin (16: about 25 minutes); FIXED: the fixed configurations.
# The figures in docs/results/ are the first shipped model's (docs/controller.md; its checkpoints rebuilt first:
# bash research/rebuild_first_model.sh): DMS=checkpoints/chain-qwen3-v1-dms PROFILE=configs/calibration_chain_v1_dms.json
# TAG=v1 THINKPOOL_SAMPLING_TEMPERATURE=0.8 (the default then: calibrate and the fixed configurations sample at the
# default temperature).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=docs/results
DMS=${DMS:-checkpoints/chain-qwen3-dms}
PROFILE=${PROFILE:-$DMS/calibration-chain.json}
TAG=${TAG:-v2}
BUDGET=${BUDGET:-13.5MB}
N=${N:-40}
mkdir -p "$OUT" runs
.venv/bin/thinkpool calibrate --model "$DMS" --cr 1 2 4 8 --per-bin "${CAL_PROBLEMS:-16}" --threads 16 \
  --max-new-tokens 1200 --workers 0 --output "$PROFILE"
.venv/bin/thinkpool generate --n "$N" --k 1-20 --seed 5001 --output runs/controller_k1-20.jsonl
.venv/bin/thinkpool bench controller --problems runs/controller_k1-20.jsonl --model "$DMS" --kv-budget "$BUDGET" \
  --profile "$PROFILE" --max-new-tokens 1200 --fixed ${FIXED:-1x4 4x8 8x16} --json --plot "$OUT/controller_vs_fixed_$TAG.png" \
  > "$OUT/controller_vs_fixed_$TAG.json"
