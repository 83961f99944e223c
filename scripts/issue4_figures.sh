#!/usr/bin/env bash
# What one KV budget buys: threads and tokens/s per method, and vote accuracy at equal memory.
# The budget holds about four vanilla threads of 1000 tokens (4 x 1100 tokens x 3072 bytes).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=docs/results
DMS=checkpoints/chain-qwen3-dms
BUDGET=${BUDGET:-13.5MB}
N_HARD=${N_HARD:-24}
mkdir -p "$OUT" runs
.venv/bin/thinkpool bench throughput --model "$DMS" --kv-budget "$BUDGET" --max-new-tokens 1000 --json \
  --plot "$OUT/throughput.png" > "$OUT/throughput.json"
.venv/bin/thinkpool bench overhead --samples 16 --max-new-tokens 600 --json > "$OUT/ray_overhead.json"
.venv/bin/thinkpool generate --n "$N_HARD" --k 16-20 --seed 4001 --output runs/equal_memory_k16-20.jsonl
for cr in 1 4 8; do
  .venv/bin/thinkpool eval --problems runs/equal_memory_k16-20.jsonl --model "$DMS" --cr "$cr" --kv-budget "$BUDGET" \
    --samples fit --max-new-tokens 1000 --workers 0 --json > "$OUT/equal_memory_cr$cr.json"
done
.venv/bin/thinkpool eval --problems runs/equal_memory_k16-20.jsonl --kv-budget "$BUDGET" --samples fit \
  --max-new-tokens 1000 --workers 0 --json > "$OUT/equal_memory_vanilla_base.json"
