#!/usr/bin/env bash
# Quality figures of the shipped model on freshly generated problems (seeds never used in training:
# training draws its problems from random.Random(seed * 1000003 + step)).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=docs/results
N_FRESH=${N_FRESH:-400}
N_HARD=${N_HARD:-100}
mkdir -p "$OUT" runs
.venv/bin/thinkpool generate --n "$N_FRESH" --k 1-20 --seed 1001 --output runs/fresh_k1-20.jsonl
.venv/bin/thinkpool generate --n "$N_HARD" --k 16-20 --seed 1002 --output runs/hard_k16-20.jsonl
.venv/bin/thinkpool eval --problems runs/fresh_k1-20.jsonl --json --plot "$OUT/greedy_by_k.png" > "$OUT/greedy_k1-20.json"
.venv/bin/thinkpool eval --problems runs/hard_k16-20.jsonl --json > "$OUT/greedy_k16-20.json"
.venv/bin/thinkpool eval --problems runs/hard_k16-20.jsonl --samples 16 --batch-size 160 --json > "$OUT/vote16_k16-20.json"
