"""Can the shipped model's weights learn to live with eviction? Fine-tune them under a fixed keep policy.

    .venv/bin/python scripts/dms_policy_finetune.py --keep prompt register --window 48 --steps 200 --output /tmp/policy48
    .venv/bin/python scripts/dms_regions.py --keep prompt register --window 48 --model /tmp/policy48

Every token outside the ``--keep`` regions (see ``scripts/dms_regions.py``) leaves once it is ``--window``
tokens old, in every head; the weights train on the reference chain of thought (cross-entropy) under that
eviction. Separates the two halves of DMS: *which* tokens to keep (the gates' job) and a model that does
not need the rest (the weights' job).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dms_regions import FixedGate

from dms_runtime.attach import attach_dms
from training.chain_data import REGIONS, difficulty_batch
from training.chain_data import token_regions as regions
from dms_runtime.config import DMSConfig
from dms_runtime.loading import default_model_path, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", nargs="+", choices=REGIONS, required=True)
    parser.add_argument("--window", type=int, default=48)
    parser.add_argument("--heads", type=int, nargs="+", help="KV heads (of every layer) that keep the regions (default: all)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--tokens", type=int, default=3000, help="tokens per batch")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(str(default_model_path()))
    model.float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    layers, decisions = model.config.num_hidden_layers, model.config.num_key_value_heads
    for _ in (bar := tqdm(range(args.steps), desc="fine-tune under the policy")):
        batch = difficulty_batch(tokenizer, rng, 1, 20, args.tokens)
        keep = torch.tensor([[label in args.keep for label in regions(tokenizer, ids, labels)]
                             for ids, labels in zip(batch.input_ids.tolist(), batch.labels.tolist())], dtype=torch.float32)
        handle = attach_dms(model, nn.ModuleList(FixedGate(keep, decisions, args.heads) for _ in range(layers)),
                            DMSConfig(window=args.window, per_head=True))
        with handle.mode("train"):
            for module in handle.modules:
                module.dms.noise = False
            logits = model(input_ids=batch.input_ids).logits
        handle.detach()
        scored = batch.loss_mask[:, :-1]
        loss = nn.functional.cross_entropy(logits[:, :-1][scored].float(), batch.input_ids[:, 1:][scored])
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        bar.set_postfix(k=batch.k, loss=f"{loss.item():.4f}")
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)


if __name__ == "__main__":
    main()
