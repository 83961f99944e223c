#!/usr/bin/env bash
# Rebuilds the first shipped model and its DMS retrofits, which are no longer in the repository, from their configs
# (docs/history.md), at the paths the docs' commands and the figure scripts use. A step whose result exists is
# skipped, and each is resumable (stop any time, run again).
#   checkpoints/chain-qwen3-v1              configs/train_anyorder.yaml                    about 8 minutes
#   checkpoints/chain-qwen3-v1-dms          configs/retrofit_chain_v1.yaml (800 steps), then
#                                           configs/retrofit_chain_continue.yaml (1300) and
#                                           configs/retrofit_chain_2000.yaml (2000)        about 2.5 hours
#   checkpoints/chain-qwen3-v1-dms-8x-1h    configs/retrofit_chain_1h.yaml                 about 40 minutes
#   checkpoints/chain-qwen3-v1-dms-8x-long  configs/retrofit_chain_8x_long.yaml            about 55 minutes
# (times on a 2-core CPU with AVX-512 BF16). Training is deterministic on one kind of CPU, but the three-ratio
# retrofit was first run before the fused CPU training attention: replayed now, it is a different run (same data,
# other rounding), and its figures can differ from docs/history.md's by a point or two.
set -euo pipefail
cd "$(dirname "$0")/.."
TP=.venv/bin/thinkpool
V1=checkpoints/chain-qwen3-v1
DMS=checkpoints/chain-qwen3-v1-dms

steps() {  # distillation steps of a retrofit's 8x adapter (0 when there is none)
  .venv/bin/python -c 'import json, sys; print(json.load(open(sys.argv[1])).get("train_steps", 0))' "$1/dms-8x.json" \
    2>/dev/null || echo 0
}

[ -f "$V1/model.safetensors" ] || $TP train --config configs/train_anyorder.yaml
[ "$(steps "$DMS")" -ge 800 ] || $TP retrofit --config configs/retrofit_chain_v1.yaml
if [ "$(steps "$DMS")" -lt 1300 ]; then
  $TP retrofit --config configs/retrofit_chain_continue.yaml
  cp -r runs/chain-qwen3-v1-dms-continued/. "$DMS/"
fi
if [ "$(steps "$DMS")" -lt 2000 ]; then
  $TP retrofit --config configs/retrofit_chain_2000.yaml
  cp -r runs/chain-qwen3-v1-dms-2000/. "$DMS/"
fi
for name in 1h 8x_long; do
  out=$([ $name = 1h ] && echo chain-qwen3-v1-dms-8x-1h || echo chain-qwen3-v1-dms-8x-long)
  if [ ! -f "checkpoints/$out/dms-8x.safetensors" ]; then
    $TP retrofit --config "configs/retrofit_chain_$name.yaml"  # writes runs/$out
    mkdir -p "checkpoints/$out" && cp -r "runs/$out/." "checkpoints/$out/"
  fi
done
