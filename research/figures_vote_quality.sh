#!/usr/bin/env bash
# Greedy and vote quality of the chain models on freshly generated problems (seeds never used in training:
# training draws its problems from random.Random(seed * 1000003 + step)), in the order they were measured
# (docs/chain_model.md, docs/history.md). The first blocks measure the first shipped model, checkpoints/chain-qwen3-v1
# ("shipped" in their file names; THINKPOOL_MODEL below makes it the default for every command and probe), which
# is no longer in the repository: bash research/rebuild_first_model.sh rebuilds it. From the reversed-minus block on,
# $RM is the base of the model shipped now (checkpoints/chain-qwen3-base; "rm" in the file names).
# Every thread is kept under runs/ (the paired gains and vote curves read them); docs/results/ gets the summaries.
# The probes these figures used (header_probe, vote_forecast, error_anatomy, rewrite_probe, operator_read_whatif)
# were removed once their findings were written down; probe() below restores each from the commit that last had
# it, into runs/probes/, the first time it is needed.
# Set N_FRESH=400 to add greedy accuracy by k over k = 1..20 (about 10 more minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
V1=checkpoints/chain-qwen3-v1
[ -f "$V1/model.safetensors" ] || { echo "$V1 is missing: bash research/rebuild_first_model.sh" >&2; exit 1; }
probe() {  # probe NAME ARGS...: run a removed probe, restored from git history
  local name=$1 dir=runs/probes
  shift
  mkdir -p "$dir"
  local needs=("$name")
  case $name in vote_forecast) needs+=(header_probe) ;; operator_read_whatif) needs+=(header_probe vote_forecast) ;; esac
  for n in "${needs[@]}"; do
    local from=scripts/$n.py
    [ "$n" = operator_read_whatif ] && from=docs/results/forecast/$n.py
    [ -f "$dir/$n.py" ] || git show "b66c1ac:$from" | sed "s#sys.path.insert(0, \"scripts\")#sys.path.insert(0, \"$dir\")#" > "$dir/$n.py"
  done
  PYTHONPATH=research .venv/bin/python "$dir/$name.py" "$@"
}
export THINKPOOL_MODEL=$V1
OUT=docs/results
N_FRESH=${N_FRESH:-0}
N_HARD=${N_HARD:-100}
mkdir -p "$OUT" runs/anyorder600 runs/forecast runs/reversed_minus runs/rewrites
.venv/bin/thinkpool generate --n 60 --k 1-6 --seed 998 --output runs/easy60_998.jsonl
.venv/bin/thinkpool generate --n "$N_HARD" --k 16-20 --seed 1005 --output runs/hard100_1005.jsonl
.venv/bin/thinkpool eval --problems runs/easy60_998.jsonl --workers 0 --json > "$OUT/greedy_easy60_998.json"
.venv/bin/thinkpool eval --problems runs/hard100_1005.jsonl --workers 0 --json --output "runs/threads_greedy_hard100_1005.jsonl" \
  > "$OUT/greedy_hard100_1005.json"
.venv/bin/thinkpool eval --problems runs/hard100_1005.jsonl --samples 16 --temperature 0.8 --batch-size 160 --workers 0 \
  --json --output runs/threads_vote16_hard100_1005.jsonl > "$OUT/vote16_hard100_1005.json"
if [ "$N_FRESH" -gt 0 ]; then
  .venv/bin/thinkpool generate --n "$N_FRESH" --k 1-20 --seed 1001 --output runs/fresh_k1-20.jsonl
  .venv/bin/thinkpool eval --problems runs/fresh_k1-20.jsonl --workers 0 --json --plot "$OUT/greedy_by_k.png" \
    > "$OUT/greedy_k1-20.json"
fi
# Exploration for the next model: vote@16 at temperature 1.0 on the first 100 of the equal-memory 140 (seeds 4001,
# 4002: the dev 100), against greedy on the same 100. To be checked on a fresh draw.
.venv/bin/thinkpool generate --n 60 --k 16-20 --seed 4001 --output runs/dev60_4001.jsonl
.venv/bin/thinkpool generate --n 40 --k 16-20 --seed 4002 --output runs/dev40_4002.jsonl
cat runs/dev60_4001.jsonl runs/dev40_4002.jsonl > runs/dev100_of_140.jsonl
.venv/bin/thinkpool eval --problems runs/dev100_of_140.jsonl --samples 16 --temperature 1.0 --batch-size 160 --workers 0 \
  --json --output runs/threads_vote16_T1.0_dev100.jsonl > "$OUT/vote16_T1.0_dev100.json"
.venv/bin/thinkpool eval --problems runs/dev100_of_140.jsonl --workers 0 --json --output "runs/threads_greedy_dev100.jsonl" \
  > "$OUT/greedy_dev100.json"
# The check of that lead on a fresh draw (200 problems, seed 1006, generated after the setting was chosen) and
# temperature 1.0 on the headline 100 of seed 1005; greedy threads are kept above for paired intervals.
.venv/bin/thinkpool generate --n 200 --k 16-20 --seed 1006 --output runs/hard200_1006.jsonl
.venv/bin/thinkpool eval --problems runs/hard200_1006.jsonl --workers 0 --json --output "runs/threads_greedy_hard200_1006.jsonl" \
  > "$OUT/greedy_hard200_1006.json"
.venv/bin/thinkpool eval --problems runs/hard200_1006.jsonl --samples 16 --temperature 1.0 --batch-size 160 --workers 0 \
  --json --output "runs/threads_vote16_T1.0_hard200_1006.jsonl" > "$OUT/vote16_T1.0_hard200_1006.json"
.venv/bin/thinkpool eval --problems runs/hard100_1005.jsonl --samples 16 --temperature 1.0 --batch-size 160 --workers 0 \
  --json --output "runs/threads_vote16_T1.0_hard100_1005.jsonl" > "$OUT/vote16_T1.0_hard100_1005.json"
# Pooled over the three draws at temperature 1.0 (400 distinct problems), paired by problem.
.venv/bin/python research/paired_gain.py --names "vote@16 T1.0" greedy --plot "$OUT/vote16_T1.0_gain.png" \
  "seed 1005=runs/threads_vote16_T1.0_hard100_1005.jsonl,runs/threads_greedy_hard100_1005.jsonl" \
  "dev 100=runs/threads_vote16_T1.0_dev100.jsonl,runs/threads_greedy_dev100.jsonl" \
  "fresh 200 (1006)=runs/threads_vote16_T1.0_hard200_1006.jsonl,runs/threads_greedy_hard200_1006.jsonl" \
  > "$OUT/vote16_T1.0_gain.json"
.venv/bin/python research/vote_curve.py --plot "$OUT/vote16_curve.png" \
  "T1.0, fresh 200 (1006)=runs/threads_vote16_T1.0_hard200_1006.jsonl" "T1.0, seed 1005=runs/threads_vote16_T1.0_hard100_1005.jsonl" \
  "T0.8, seed 1005=runs/threads_vote16_hard100_1005.jsonl" > "$OUT/vote16_curve.json"
# Does the vote gain grow with a better-trained stage 2? The same fine-tune with a cosine over 600 steps, its
# step-450 snapshot against the first shipped model's 300 steps, on the dev 100 (greedy, header probe, vote@16 at T 1.0).
mkdir -p runs/anyorder600 "$OUT/anyorder600"
printf 'base: ../../configs/train_anyorder.yaml\noutput_dir: runs/anyorder600/model\noptim:\n  steps: 600\nexport_at_step: 450\n' \
  > runs/anyorder600/train.yaml
.venv/bin/thinkpool train --config runs/anyorder600/train.yaml
.venv/bin/thinkpool eval --model runs/anyorder600/model --problems runs/dev100_of_140.jsonl --workers 0 --json \
  --output "runs/anyorder600/threads_greedy_dev100_chain-qwen3-anyorder600-step450.jsonl" > "$OUT/anyorder600/greedy_dev100_step450.json"
probe header_probe --model runs/anyorder600/model --problems runs/dev100_of_140.jsonl --limit 40 \
  > "$OUT/anyorder600/header_probe_dev40_step450.json"
probe header_probe --problems runs/dev100_of_140.jsonl --limit 40 > "$OUT/header_probe_dev40_shipped.json"
.venv/bin/thinkpool eval --model runs/anyorder600/model --problems runs/dev100_of_140.jsonl --samples 16 --temperature 1.0 \
  --batch-size 160 --workers 0 --json --output "runs/anyorder600/threads_vote16_T1.0_dev100_step450.jsonl" \
  > "$OUT/anyorder600/vote16_T1.0_dev100_step450.json"
.venv/bin/python research/paired_gain.py --names "vote@16 T1.0" greedy --plot "$OUT/anyorder600/vote16_T1.0_gain_dev100.png" \
  "450 of 600 steps=runs/anyorder600/threads_vote16_T1.0_dev100_step450.jsonl,runs/anyorder600/threads_greedy_dev100_chain-qwen3-anyorder600-step450.jsonl" \
  "shipped (300 steps)=runs/threads_vote16_T1.0_dev100.jsonl,runs/threads_greedy_dev100.jsonl" > "$OUT/anyorder600/vote16_T1.0_gain_dev100.json"
probe error_anatomy --problems runs/dev100_of_140.jsonl --model runs/anyorder600/model --samples 16 \
  --temperature 1.0 > "$OUT/anyorder600/error_anatomy_dev100_step450.json"
# The vote forecast (the vote_forecast probe) and what caps the gain; the one vote measured to check it (T 0.5).
F="$OUT/forecast"; mkdir -p "$F"
probe header_probe --problems runs/dev100_of_140.jsonl --limit 40 --histories 12 > "$F/header_probe_dev40_histories12.json"
.venv/bin/thinkpool eval --problems runs/dev100_of_140.jsonl --samples 16 --temperature 0.5 --batch-size 160 --workers 0 \
  --json --output "runs/forecast/threads_vote16_T0.5_dev100.jsonl" > "$F/vote16_T0.5_dev100.json"
.venv/bin/python research/paired_gain.py --names "vote@16 T0.5" greedy \
  "dev 100=runs/forecast/threads_vote16_T0.5_dev100.jsonl,runs/threads_greedy_dev100.jsonl" > "$F/vote16_T0.5_gain_dev100.json"
probe vote_forecast --problems runs/dev100_of_140.jsonl --temperatures 0.5,0.7,0.8,1.0,1.2 \
  --plot "$F/forecast_shipped_dev100.png" --measured 0.5=0.67 1.0=0.72 > "$F/forecast_shipped_dev100.json"
probe vote_forecast --problems runs/hard200_1006.jsonl --temperatures 0.8,1.0 \
  --plot "$F/forecast_shipped_hard200_1006.png" --measured 1.0=0.715 > "$F/forecast_shipped_hard200_1006.json"
for u in all operator operands; do
  probe vote_forecast --problems runs/dev100_of_140.jsonl --temperatures 1.0 --unshared $u \
    > "$F/forecast_shipped_dev100_unshared_$u.json"
done
probe vote_forecast --problems runs/dev100_of_140.jsonl --model runs/anyorder600/model \
  --temperatures 1.0 > "$F/forecast_step450_dev100.json"
probe vote_forecast --problems runs/dev100_of_140.jsonl --model checkpoints/chain-qwen3-onepath \
  --temperatures 1.0 > "$F/forecast_onepath_dev100.json"
for s in 150 300; do  # the same cosine-over-600 stage 2, stopped earlier
  printf 'base: ../../configs/train_anyorder.yaml\noutput_dir: runs/anyorder600/step%s\noptim:\n  steps: 600\nexport_at_step: %s\n' \
    $s $s > runs/anyorder600/train_step$s.yaml
  .venv/bin/thinkpool train --config runs/anyorder600/train_step$s.yaml
  probe vote_forecast --problems runs/dev100_of_140.jsonl --model runs/anyorder600/step$s \
    --temperatures 1.0 > "$F/forecast_step${s}of600_dev100.json"
done
probe operator_read_whatif runs/dev100_of_140.jsonl | grep boost > runs/forecast/operator_read_whatif_dev100.jsonl
# A prospective check: a fresh draw forecast first (the forecast was committed before the vote was run), then measured.
.venv/bin/thinkpool generate --n 100 --k 16-20 --seed 1007 --output runs/hard100_1007.jsonl
probe vote_forecast --problems runs/hard100_1007.jsonl --temperatures 1.0,0.8 > "$F/forecast_shipped_hard100_1007.json"
.venv/bin/thinkpool eval --problems runs/hard100_1007.jsonl --workers 0 --json --output "runs/forecast/threads_greedy_hard100_1007.jsonl" \
  > "$F/greedy_hard100_1007.json"
.venv/bin/thinkpool eval --problems runs/hard100_1007.jsonl --samples 16 --temperature 1.0 --batch-size 160 --workers 0 --json \
  --output "runs/forecast/threads_vote16_T1.0_hard100_1007.jsonl" > "$F/vote16_T1.0_hard100_1007.json"
# Pooled over the four draws voted at temperature 1.0 (500 distinct problems).
.venv/bin/python research/paired_gain.py --names "vote@16 T1.0" greedy --plot "$F/vote16_T1.0_gain_4draws.png" \
  "seed 1005=runs/threads_vote16_T1.0_hard100_1005.jsonl,runs/threads_greedy_hard100_1005.jsonl" \
  "dev 100=runs/threads_vote16_T1.0_dev100.jsonl,runs/threads_greedy_dev100.jsonl" \
  "fresh 200 (1006)=runs/threads_vote16_T1.0_hard200_1006.jsonl,runs/threads_greedy_hard200_1006.jsonl" \
  "fresh 100 (1007)=runs/forecast/threads_vote16_T1.0_hard100_1007.jsonl,runs/forecast/threads_greedy_hard100_1007.jsonl" \
  > "$F/vote16_T1.0_gain_4draws.json"
# The reversed-minus model (configs/train_reversed_minus.yaml, 40 minutes; a candidate then, shipped now) against the
# first shipped model on a fresh draw, forecast first (committed before either vote), then greedy on 200 and the vote on 100.
R=docs/results/reversed_minus
RM=checkpoints/chain-qwen3-base
mkdir -p "$R"
.venv/bin/thinkpool generate --n 200 --k 16-20 --seed 1008 --output runs/hard200_1008.jsonl
head -100 runs/hard200_1008.jsonl > runs/hard100_1008.jsonl
for m in rm shipped; do
  model=$([ $m = rm ] && echo $RM || echo $V1)
  probe vote_forecast --problems runs/hard100_1008.jsonl --model $model --temperatures 0.8,1.0 \
    > "$R/forecast_${m}_fresh100_1008.json"
  .venv/bin/thinkpool eval --problems runs/hard200_1008.jsonl --model $model --batch-size 200 --workers 0 --json \
    --output "runs/reversed_minus/threads_greedy_${m}_hard200_1008.jsonl" > "$R/greedy_${m}_hard200_1008.json"
  head -100 "runs/reversed_minus/threads_greedy_${m}_hard200_1008.jsonl" > "runs/greedy_${m}_hard100_1008.jsonl"
  .venv/bin/thinkpool eval --problems runs/hard100_1008.jsonl --model $model --samples 16 --temperature 1.0 \
    --batch-size 160 --workers 0 --json --output "runs/reversed_minus/threads_vote16_T1.0_${m}_hard100_1008.jsonl" \
    > "$R/vote16_T1.0_${m}_hard100_1008.json"
  probe header_probe --problems runs/dev100_of_140.jsonl --limit 40 --model $model \
    > "$R/header_probe_${m}_dev40.json"
done
probe vote_forecast --problems runs/dev100_of_140.jsonl --model $RM --temperatures 0.8,1.0 \
  > "$R/forecast_rm_dev100.json"
.venv/bin/python research/paired_gain.py --names "reversed minus" shipped --plot "$R/vote16_T1.0_rm_vs_shipped.png" \
  "greedy, fresh 100 (1008)=runs/greedy_rm_hard100_1008.jsonl,runs/greedy_shipped_hard100_1008.jsonl" \
  "vote@16, fresh 100 (1008)=runs/reversed_minus/threads_vote16_T1.0_rm_hard100_1008.jsonl,runs/reversed_minus/threads_vote16_T1.0_shipped_hard100_1008.jsonl" \
  > "$R/vote16_T1.0_rm_vs_shipped.json"
# The first shipped model's vote gain pooled over the five draws voted at temperature 1.0 (600 distinct problems).
.venv/bin/python research/paired_gain.py --names "vote@16 T1.0" greedy --plot "$F/vote16_T1.0_gain_5draws.png" \
  "seed 1005=runs/threads_vote16_T1.0_hard100_1005.jsonl,runs/threads_greedy_hard100_1005.jsonl" \
  "dev 100=runs/threads_vote16_T1.0_dev100.jsonl,runs/threads_greedy_dev100.jsonl" \
  "fresh 200 (1006)=runs/threads_vote16_T1.0_hard200_1006.jsonl,runs/threads_greedy_hard200_1006.jsonl" \
  "fresh 100 (1007)=runs/forecast/threads_vote16_T1.0_hard100_1007.jsonl,runs/forecast/threads_greedy_hard100_1007.jsonl" \
  "fresh 100 (1008)=runs/reversed_minus/threads_vote16_T1.0_shipped_hard100_1008.jsonl,runs/greedy_shipped_hard100_1008.jsonl" \
  > "$F/vote16_T1.0_gain_5draws.json"
# Equivalent rewrites of the dev 100 (operands of + and * swapped at random), greedy on each (first shipped model).
W="$OUT/rewrites"; mkdir -p "$W"
probe rewrite_probe write --problems runs/dev100_of_140.jsonl --rewrites 8 --output runs/dev100_x8.jsonl
.venv/bin/thinkpool eval --problems runs/dev100_x8.jsonl --batch-size 160 --workers 0 --json \
  --output "runs/rewrites/threads_greedy_dev100_x8.jsonl" > /dev/null
probe rewrite_probe score "runs/rewrites/threads_greedy_dev100_x8.jsonl" > "$W/rewrite_probe_dev100_x8.json"
# The same rewrites, two threads each sampled at T 1.0: a vote of 16 threads spread over 8 texts.
.venv/bin/thinkpool eval --problems runs/dev100_x8.jsonl --samples 2 --temperature 1.0 --batch-size 160 --workers 0 --json \
  --output "runs/rewrites/threads_T1.0_2x_dev100_x8.jsonl" > /dev/null
probe rewrite_probe score "runs/rewrites/threads_T1.0_2x_dev100_x8.jsonl" > "$W/rewrite_probe_T1.0_2x_dev100_x8.json"
# The reversed-minus model's greedy and vote on the dev 100, and its gain pooled with the fresh 100 of seed 1008.
.venv/bin/thinkpool eval --problems runs/dev100_of_140.jsonl --model $RM --workers 0 --json \
  --output runs/reversed_minus/threads_greedy_rm_dev100.jsonl > "$R/greedy_rm_dev100.json"
.venv/bin/thinkpool eval --problems runs/dev100_of_140.jsonl --model $RM --samples 16 --temperature 1.0 --batch-size 160 \
  --workers 0 --json --output "runs/reversed_minus/threads_vote16_T1.0_rm_dev100.jsonl" > "$R/vote16_T1.0_rm_dev100.json"
.venv/bin/python research/paired_gain.py --names "vote@16 T1.0" greedy --plot "$R/vote16_T1.0_rm_gain_2draws.png" \
  "dev 100=runs/reversed_minus/threads_vote16_T1.0_rm_dev100.jsonl,runs/reversed_minus/threads_greedy_rm_dev100.jsonl" \
  "fresh 100 (1008)=runs/reversed_minus/threads_vote16_T1.0_rm_hard100_1008.jsonl,runs/greedy_rm_hard100_1008.jsonl" \
  > "$R/vote16_T1.0_rm_gain_2draws.json"
# The reversed-minus model on two more fresh 100s (forecasts committed before the runs), and its gain over all four draws.
for s in 1009 1010; do
  .venv/bin/thinkpool generate --n 100 --k 16-20 --seed $s --output runs/hard100_$s.jsonl
  probe vote_forecast --problems runs/hard100_$s.jsonl --model $RM --temperatures 0.8,1.0 \
    > "$R/forecast_rm_fresh100_$s.json"
  .venv/bin/thinkpool eval --problems runs/hard100_$s.jsonl --model $RM --batch-size 200 --workers 0 --json \
    --output "runs/reversed_minus/threads_greedy_rm_hard100_$s.jsonl" > "$R/greedy_rm_hard100_$s.json"
  .venv/bin/thinkpool eval --problems runs/hard100_$s.jsonl --model $RM --samples 16 --temperature 1.0 \
    --batch-size 160 --workers 0 --json --output "runs/reversed_minus/threads_vote16_T1.0_rm_hard100_$s.jsonl" \
    > "$R/vote16_T1.0_rm_hard100_$s.json"
done
.venv/bin/python research/paired_gain.py --names "vote@16 T1.0" greedy --plot "$R/vote16_T1.0_rm_gain_4draws.png" \
  "dev 100=runs/reversed_minus/threads_vote16_T1.0_rm_dev100.jsonl,runs/reversed_minus/threads_greedy_rm_dev100.jsonl" \
  "fresh 100 (1008)=runs/reversed_minus/threads_vote16_T1.0_rm_hard100_1008.jsonl,runs/greedy_rm_hard100_1008.jsonl" \
  "fresh 100 (1009)=runs/reversed_minus/threads_vote16_T1.0_rm_hard100_1009.jsonl,runs/reversed_minus/threads_greedy_rm_hard100_1009.jsonl" \
  "fresh 100 (1010)=runs/reversed_minus/threads_vote16_T1.0_rm_hard100_1010.jsonl,runs/reversed_minus/threads_greedy_rm_hard100_1010.jsonl" \
  > "$R/vote16_T1.0_rm_gain_4draws.json"
# The reversed-minus model's greedy on easy problems: the first model's easy set (seed 998, written at the top) and a fresh one.
.venv/bin/thinkpool generate --n 100 --k 1-6 --seed 1011 --output runs/easy100_1011.jsonl
for f in easy60_998 easy100_1011; do
  .venv/bin/thinkpool eval --problems runs/$f.jsonl --model $RM --batch-size 100 --workers 0 --json \
    --output "runs/reversed_minus/threads_greedy_rm_$f.jsonl" > "$R/greedy_rm_$f.json"
done
