"""Teacher-forced quality of DMS adapters: KL to the base model and argmax agreement, per ratio.

    .venv/bin/python scripts/dms_kl.py checkpoints/chain-qwen3-dms --ratios 2 4 8 --k 8 18

For each adapter beside MODEL, runs fresh chain-task batches of each difficulty through the training-mode
attention with deterministic decisions (what inference evicts) and prints, as JSON lines: the KL from
the base model (nats per chain-of-thought token), the share of tokens whose argmax matches the base
model's, the eviction fraction of tokens that left the window, and the mean per-head realized ratio.
A chain of thought of 500 tokens needs agreement well above 99.9% to keep its answer.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from dms_runtime.adapters import adapter_path, load_gates
from dms_runtime.attach import attach_dms
from dms_runtime.chain_data import difficulty_batch
from dms_runtime.loading import SHIPPED_MODEL, load_model
from dms_runtime.retrofit import evicted_fraction


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a model directory with dms-<CR>x adapters")
    parser.add_argument("--base", default=str(SHIPPED_MODEL), help="the vanilla model to compare against")
    parser.add_argument("--ratios", type=float, nargs="+", default=[2, 4, 8])
    parser.add_argument("--k", type=int, nargs="+", default=[8, 18], help="difficulties of the batches")
    parser.add_argument("--tokens", type=int, default=4000, help="tokens per batch")
    parser.add_argument("--seed", type=int, default=77)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    base, _ = load_model(args.base)
    for ratio in args.ratios:
        gates, config = load_gates(model, adapter_path(args.model, ratio))
        handle = attach_dms(model, gates, config)
        for k in args.k:
            batch = difficulty_batch(tokenizer, random.Random(args.seed + k), k, k, args.tokens)
            mask = batch.loss_mask
            teacher = torch.log_softmax(base(input_ids=batch.input_ids).logits[mask], -1)
            with handle.mode("train"):
                for module in handle.modules:
                    module.dms.noise = False
                student = torch.log_softmax(model(input_ids=batch.input_ids).logits[mask], -1)
                fraction, mean_ratio = evicted_fraction(handle.alphas(), batch.lengths, config.window)
            print(json.dumps({
                "cr": ratio, "k": k, "kl": round((teacher.exp() * (teacher - student)).sum(-1).mean().item(), 4),
                "argmax_agreement": round((student.argmax(-1) == teacher.argmax(-1)).float().mean().item(), 4),
                "evicted_fraction": round(fraction.item(), 3), "mean_head_ratio": round(mean_ratio.item(), 2),
            }), flush=True)
        handle.detach()


if __name__ == "__main__":
    main()
