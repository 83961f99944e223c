#!/usr/bin/env bash
# What one KV budget buys: threads and tokens/s per method, and vote accuracy at equal memory.
# The budget holds about four vanilla threads of 1000 tokens (4 x 1100 tokens x 3072 bytes).
# Measured on the first shipped model and its DMS retrofits (docs/workers.md, docs/history.md), which are no longer
# in the repository: bash research/rebuild_first_model.sh rebuilds them. THINKPOOL_MODEL makes the first model the
# vanilla default, and the sampling temperature of every run that names none is 0.8, the default then (1.0 now).
# Every thread is kept under runs/ (the vote curves and paired gains read them); docs/results/ gets the summaries.
set -euo pipefail
cd "$(dirname "$0")/.."
for m in checkpoints/chain-qwen3-v1 checkpoints/chain-qwen3-v1-dms checkpoints/chain-qwen3-v1-dms-8x-1h \
         checkpoints/chain-qwen3-v1-dms-8x-long; do
  [ -f "$m/model.safetensors" ] || { echo "$m is missing: bash research/rebuild_first_model.sh" >&2; exit 1; }
done
export THINKPOOL_MODEL=checkpoints/chain-qwen3-v1 THINKPOOL_SAMPLING_TEMPERATURE=0.8
OUT=docs/results
DMS=checkpoints/chain-qwen3-v1-dms
BUDGET=${BUDGET:-13.5MB}
N_HARD=${N_HARD:-24}
mkdir -p "$OUT" runs
.venv/bin/thinkpool bench throughput --model "$DMS" --kv-budget "$BUDGET" --max-new-tokens 1000 --json \
  --plot "$OUT/throughput_grown.png" > "$OUT/throughput_grown.json"
.venv/bin/thinkpool bench overhead --samples 16 --max-new-tokens 600 --json > "$OUT/ray_overhead.json"
.venv/bin/thinkpool generate --n "$N_HARD" --k 16-20 --seed 4001 --output runs/equal_memory_k16-20.jsonl
for cr in 1 4 8; do
  .venv/bin/thinkpool eval --problems runs/equal_memory_k16-20.jsonl --model "$DMS" --cr "$cr" --kv-budget "$BUDGET" \
    --samples fit --max-new-tokens 1000 --workers 0 --json > "$OUT/equal_memory_cr$cr.json"
done
.venv/bin/thinkpool eval --problems runs/equal_memory_k16-20.jsonl --kv-budget "$BUDGET" --samples fit \
  --max-new-tokens 1000 --workers 0 --json > "$OUT/equal_memory_vanilla_base.json"
# 8x trained for long reasoning (checkpoints/chain-qwen3-v1-dms-8x-long) against vanilla on three draws of hard
# problems (60 + 40 + 40), keeping every thread for research/vote_curve.py. About 1 h 40 min on 2 CPU cores.
LONG=checkpoints/chain-qwen3-v1-dms-8x-long
.venv/bin/thinkpool generate --n 60 --k 16-20 --seed 4001 --output runs/equal_memory_k16-20_60.jsonl
.venv/bin/thinkpool generate --n 40 --k 16-20 --seed 4002 --output runs/equal_memory_k16-20_fresh40.jsonl
.venv/bin/thinkpool generate --n 40 --k 16-20 --seed 4003 --output runs/equal_memory_k16-20_fresh40b.jsonl
# Reservations at each adapter's measured KV growth (stored in the shipped adapters; this re-measures them, seeded,
# and writes the same figures back): 39 threads per problem. The 25-thread runs (equal_memory_cr8_long_$set.json)
# were made before the adapters carried a measurement (git checkout 9f5714e reproduces them).
for model in "$DMS" checkpoints/chain-qwen3-v1-dms-8x-1h "$LONG"; do
  .venv/bin/thinkpool kv-growth --model "$model"
done
for set in 60 fresh40 fresh40b; do
  .venv/bin/thinkpool eval --problems "runs/equal_memory_k16-20_$set.jsonl" --model "$LONG" --cr 8 --kv-budget "$BUDGET" \
    --samples fit --max-new-tokens 1000 --workers 0 --json --output "runs/threads_cr8_long_grown_$set.jsonl" \
    > "$OUT/equal_memory_cr8_long_grown_$set.json"
done
# Vanilla on the 60 is in two files: its first 24 (equal_memory_vanilla_base.json, above) and the last 36 lines
# (equal_memory_vanilla_base_more36.json, the same command on them).
for set in fresh40 fresh40b; do
  .venv/bin/thinkpool eval --problems "runs/equal_memory_k16-20_$set.jsonl" --kv-budget "$BUDGET" --samples fit \
    --max-new-tokens 1000 --workers 0 --json --output "runs/threads_vanilla_$set.jsonl" > "$OUT/equal_memory_vanilla_$set.json"
done
# The 25-thread 8x-long run on the fresh 40b (runs/threads_cr8_long_fresh40b.jsonl) is this script at commit 9f5714e.
.venv/bin/python research/vote_curve.py "DMS 8x long, 25 threads=runs/threads_cr8_long_fresh40b.jsonl" \
  "vanilla, 4 threads=runs/threads_vanilla_fresh40b.jsonl" --plot "$OUT/vote_curve_fresh40b.png" > "$OUT/vote_curve_fresh40b.json"
cat runs/threads_cr8_long_grown_{60,fresh40,fresh40b}.jsonl > runs/threads_cr8_long_grown_140.jsonl
.venv/bin/python research/vote_curve.py "8x-long, 39 threads (measured growth)=runs/threads_cr8_long_grown_140.jsonl" \
  --plot "$OUT/vote_curve_grown_140.png" > "$OUT/vote_curve_grown_140.json"
# Sampling: a dev draw of 20 (seed 4101) at three settings, then all 140 greedy and at temperature 0.5.
.venv/bin/thinkpool generate --n 20 --k 16-20 --seed 4101 --output runs/dev_k16-20_4101.jsonl
for setting in "T0.5 --temperature 0.5" "T0.8 --temperature 0.8" "p0.9 --top-p 0.9"; do
  set -- $setting
  name=$1; shift
  .venv/bin/thinkpool eval --problems runs/dev_k16-20_4101.jsonl --kv-budget "$BUDGET" --samples fit --max-new-tokens 1000 \
    "$@" --workers 0 --json > "$OUT/dev_4101_vanilla_$name.json"
  .venv/bin/thinkpool eval --problems runs/dev_k16-20_4101.jsonl --model "$LONG" --cr 8 --kv-budget "$BUDGET" --samples fit \
    --max-new-tokens 1000 "$@" --workers 0 --json > "$OUT/dev_4101_cr8_$name.json"
done
cat runs/equal_memory_k16-20_{60,fresh40,fresh40b}.jsonl > runs/equal_memory_k16-20_140.jsonl
.venv/bin/thinkpool eval --problems runs/equal_memory_k16-20_140.jsonl --max-new-tokens 1000 --workers 0 --json \
  > "$OUT/greedy_vanilla_hard140.json"
.venv/bin/thinkpool eval --problems runs/equal_memory_k16-20_140.jsonl --model "$LONG" --cr 8 --max-new-tokens 1000 \
  --workers 0 --json > "$OUT/greedy_cr8_long_hard140.json"
.venv/bin/thinkpool eval --problems runs/equal_memory_k16-20_140.jsonl --kv-budget "$BUDGET" --samples fit --max-new-tokens 1000 \
  --temperature 0.5 --workers 0 --json --output runs/threads_vanilla_T05_140.jsonl > "$OUT/equal_memory_vanilla_T05_140.json"
.venv/bin/thinkpool eval --problems runs/equal_memory_k16-20_140.jsonl --model "$LONG" --cr 8 --kv-budget "$BUDGET" --samples fit \
  --max-new-tokens 1000 --temperature 0.5 --workers 0 --json --output runs/threads_cr8_long_T05_140.jsonl \
  > "$OUT/equal_memory_cr8_long_T05_140.json"
.venv/bin/python research/vote_curve.py "8x-long T0.5=runs/threads_cr8_long_T05_140.jsonl" "vanilla T0.5=runs/threads_vanilla_T05_140.jsonl" \
  --plot "$OUT/vote_curve_T05_140.png" > "$OUT/vote_curve_T05_140.json"
# Short token limits: reservations read each adapter's growth curve. Two hard problems at 150 tokens,
# the curve against the nominal 1/8 (the single long-run fraction is this command at commit e3297c7:
# short150_flat_e3297c7.json); then the first 8 of the 60 at 1000 tokens (41 threads).
head -2 runs/equal_memory_k16-20_60.jsonl > runs/short2.jsonl
for reserve in measured nominal; do
  name=$([ "$reserve" = measured ] && echo curve || echo nominal)
  .venv/bin/thinkpool eval --problems runs/short2.jsonl --model "$LONG" --cr 8 --kv-budget "$BUDGET" --samples fit \
    --max-new-tokens 150 --reserve "$reserve" --workers 0 --json > "$OUT/short150_$name.json"
done
head -8 runs/equal_memory_k16-20_60.jsonl > runs/long8.jsonl
.venv/bin/thinkpool eval --problems runs/long8.jsonl --model "$LONG" --cr 8 --kv-budget "$BUDGET" --samples fit \
  --max-new-tokens 1000 --workers 0 --json > "$OUT/long8_curve_1000.json"
# Ties and temperature. The vote breaks ties by confidence now (policies/voting.py); the runs above that kept their
# threads are re-scored with `research/score_aggregations.py FILE` ("majority"). Vanilla at 0.8 and 1.0 and
# the 8x-long model at 1.0 on the 140, then the check on 100 fresh problems (seed 4004) at each one's temperature.
for t in 0.8 1.0; do
  .venv/bin/thinkpool eval --problems runs/equal_memory_k16-20_140.jsonl --kv-budget "$BUDGET" --samples fit --max-new-tokens 1000 \
    --temperature "$t" --workers 0 --json --output "runs/threads_vanilla_T${t}_140.jsonl" > "$OUT/equal_memory_vanilla_T${t}_140.json"
done
.venv/bin/thinkpool eval --problems runs/equal_memory_k16-20_140.jsonl --model "$LONG" --cr 8 --kv-budget "$BUDGET" --samples fit \
  --max-new-tokens 1000 --temperature 1.0 --workers 0 --json --output runs/threads_cr8_long_T1.0_140.jsonl \
  > "$OUT/equal_memory_cr8_long_T1.0_140.json"
.venv/bin/python research/vote_curve.py "8x-long T1.0, 41 threads=runs/threads_cr8_long_T1.0_140.jsonl" \
  "8x-long T0.8, 39 threads=runs/threads_cr8_long_grown_140.jsonl" "vanilla T0.8, 4 threads=runs/threads_vanilla_T0.8_140.jsonl" \
  "vanilla T0.5, 4 threads=runs/threads_vanilla_T05_140.jsonl" --plot "$OUT/vote_curve_T10_140.png" > "$OUT/vote_curve_T10_140.json"
.venv/bin/thinkpool generate --n 100 --k 16-20 --seed 4004 --output runs/equal_memory_k16-20_fresh100.jsonl
for t in 0.8 0.5; do
  .venv/bin/thinkpool eval --problems runs/equal_memory_k16-20_fresh100.jsonl --kv-budget "$BUDGET" --samples fit --max-new-tokens 1000 \
    --temperature "$t" --workers 0 --json --output "runs/threads_vanilla_T${t}_fresh100.jsonl" > "$OUT/equal_memory_vanilla_T${t}_fresh100.json"
done
.venv/bin/thinkpool eval --problems runs/equal_memory_k16-20_fresh100.jsonl --model "$LONG" --cr 8 --kv-budget "$BUDGET" --samples fit \
  --max-new-tokens 1000 --temperature 1.0 --workers 0 --json --output runs/threads_cr8_long_T1.0_fresh100.jsonl \
  > "$OUT/equal_memory_cr8_long_T1.0_fresh100.json"
# A third draw, 200 fresh hard problems (seed 4005), each side at the temperature chosen before it
# (vanilla 0.8, its best on both earlier draws; 8x-long 1.0); then 8x-long at 1.2 on the 140 (exploration).
.venv/bin/thinkpool generate --n 200 --k 16-20 --seed 4005 --output runs/equal_memory_k16-20_fresh200.jsonl
.venv/bin/thinkpool eval --problems runs/equal_memory_k16-20_fresh200.jsonl --kv-budget "$BUDGET" --samples fit --max-new-tokens 1000 \
  --temperature 0.8 --workers 0 --json --output runs/threads_vanilla_T0.8_fresh200.jsonl > "$OUT/equal_memory_vanilla_T0.8_fresh200.json"
.venv/bin/thinkpool eval --problems runs/equal_memory_k16-20_fresh200.jsonl --model "$LONG" --cr 8 --kv-budget "$BUDGET" --samples fit \
  --max-new-tokens 1000 --temperature 1.0 --workers 0 --json --output runs/threads_cr8_long_T1.0_fresh200.jsonl \
  > "$OUT/equal_memory_cr8_long_T1.0_fresh200.json"
.venv/bin/python research/vote_curve.py "8x-long T1.0, 41 threads=runs/threads_cr8_long_T1.0_fresh200.jsonl" \
  "vanilla T0.8, 4 threads=runs/threads_vanilla_T0.8_fresh200.jsonl" --plot "$OUT/vote_curve_fresh200.png" > "$OUT/vote_curve_fresh200.json"
.venv/bin/thinkpool eval --problems runs/equal_memory_k16-20_140.jsonl --model "$LONG" --cr 8 --kv-budget "$BUDGET" --samples fit \
  --max-new-tokens 1000 --temperature 1.2 --workers 0 --json --output runs/threads_cr8_long_T1.2_140.jsonl \
  > "$OUT/equal_memory_cr8_long_T1.2_140.json"
.venv/bin/thinkpool eval --problems runs/equal_memory_k16-20_fresh200.jsonl --kv-budget "$BUDGET" --samples fit --max-new-tokens 1000 \
  --temperature 0.5 --workers 0 --json --output runs/threads_vanilla_T0.5_fresh200.jsonl > "$OUT/equal_memory_vanilla_T0.5_fresh200.json"
# The paired gain over all three draws (docs/workers.md's equal-memory table), from the kept threads.
.venv/bin/python research/paired_gain.py "140 (seeds 4001-4003)=runs/threads_cr8_long_T1.0_140.jsonl,runs/threads_vanilla_T0.8_140.jsonl" \
  "fresh 100 (4004)=runs/threads_cr8_long_T1.0_fresh100.jsonl,runs/threads_vanilla_T0.8_fresh100.jsonl" \
  "fresh 200 (4005)=runs/threads_cr8_long_T1.0_fresh200.jsonl,runs/threads_vanilla_T0.8_fresh200.jsonl" \
  --names "8x-long, 41 threads, T1.0" "vanilla, 4 threads, T0.8" --plot "$OUT/equal_memory_gain.png" > "$OUT/equal_memory_gain.json"
.venv/bin/python research/paired_gain.py "140 (seeds 4001-4003)=runs/threads_cr8_long_T1.0_140.jsonl,runs/threads_vanilla_T05_140.jsonl" \
  "fresh 100 (4004)=runs/threads_cr8_long_T1.0_fresh100.jsonl,runs/threads_vanilla_T0.5_fresh100.jsonl" \
  "fresh 200 (4005)=runs/threads_cr8_long_T1.0_fresh200.jsonl,runs/threads_vanilla_T0.5_fresh200.jsonl" \
  --names "8x-long, 41 threads, T1.0" "vanilla, 4 threads, T0.5" --plot "$OUT/equal_memory_gain_T05.png" > "$OUT/equal_memory_gain_T05.json"
