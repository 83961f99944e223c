#!/usr/bin/env bash
# The controller against fixed (ratio, threads) configurations on the shipped model: same fresh mixed problems, same
# KV pool (docs/controller.md).
# 1. the calibration profile at CR 1 and 8, 48 fresh problems per k bin, 8 sampled threads (about 25 minutes here);
# 2. every problem alone with the pool; 3. CONCURRENCY tasks at once sharing it (accuracy per engine-second).
# STEPS: all | calibrate | alone | together. The first shipped model's figures (docs/results/controller_vs_fixed_v1*,
# its checkpoints rebuilt first: bash research/rebuild_first_model.sh) came from the steps of that time with
# DMS=checkpoints/chain-qwen3-v1-dms PROFILE=configs/calibration_chain_v1_dms.json N=40 SEED=5001 FIXED="1x4 4x8 8x16"
# THINKPOOL_SAMPLING_TEMPERATURE=0.8 and a profile at CR 1, 2, 4 and 8 (16 problems per bin, 16 threads).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results/controller}
DMS=${DMS:-checkpoints/chain-qwen3}
PROFILE=${PROFILE:-$DMS/calibration-chain.json}
BUDGET=${BUDGET:-13.5MB}
N=${N:-100}
SEED=${SEED:-5101}
FIXED=${FIXED:-1x4 1x8 8x8 8x16}
CONCURRENCY=${CONCURRENCY:-8}
STEPS=${STEPS:-all}
# TEMPERATURE: the fixed configurations' sampled threads (unset: the settings' default; the controller plans its own)
TP=.venv/bin/thinkpool
mkdir -p "$OUT" runs
if [ "$STEPS" = all ] || [ "$STEPS" = calibrate ]; then
  $TP calibrate --model "$DMS" --cr 1 8 --per-bin 48 --threads 8 --workers 0 --output "$PROFILE"
fi
[ -f "runs/controller_k1-20_$SEED.jsonl" ] || $TP generate --n "$N" --k 1-20 --seed "$SEED" \
  --output "runs/controller_k1-20_$SEED.jsonl"
if [ "$STEPS" = all ] || [ "$STEPS" = alone ]; then
  $TP bench controller --problems "runs/controller_k1-20_$SEED.jsonl" --model "$DMS" --kv-budget "$BUDGET" \
    --profile "$PROFILE" --fixed $FIXED ${TEMPERATURE:+--temperature "$TEMPERATURE"} --json --plot "$OUT/alone.png" > "$OUT/alone.json"
fi
if [ "$STEPS" = all ] || [ "$STEPS" = together ]; then
  $TP bench controller --problems "runs/controller_k1-20_$SEED.jsonl" --model "$DMS" --kv-budget "$BUDGET" \
    --profile "$PROFILE" --fixed $FIXED ${TEMPERATURE:+--temperature "$TEMPERATURE"} --concurrency "$CONCURRENCY" --json --plot "$OUT/together.png" \
    > "$OUT/together.json"
fi
