#!/usr/bin/env bash
# Quality figures of the shipped model on freshly generated problems (seeds never used in training:
# training draws its problems from random.Random(seed * 1000003 + step)).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=docs/results
mkdir -p "$OUT" runs
.venv/bin/thinkpool generate --n 400 --k 1-20 --seed 1001 --output runs/fresh_k1-20.jsonl
.venv/bin/thinkpool generate --n 100 --k 16-20 --seed 1002 --output runs/hard_k16-20.jsonl
.venv/bin/thinkpool eval --problems runs/fresh_k1-20.jsonl --json --plot "$OUT/greedy_by_k.png" > "$OUT/greedy_k1-20.json"
.venv/bin/thinkpool eval --problems runs/hard_k16-20.jsonl --json > "$OUT/greedy_k16-20.json"
.venv/bin/thinkpool eval --problems runs/hard_k16-20.jsonl --samples 16 --batch-size 128 --json > "$OUT/vote16_k16-20.json"
