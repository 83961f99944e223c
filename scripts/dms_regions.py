"""Where eviction breaks the shipped model: teacher-forced agreement with the base model, by chain-of-thought region.

    .venv/bin/python scripts/dms_regions.py --adapters checkpoints/chain-qwen3-dms --ratios 2 8
    .venv/bin/python scripts/dms_regions.py --keep prompt register --window 48

With ``--adapters``, each trained adapter evicts (deterministic decisions, as at inference). With
``--keep``, a hand-written policy runs on the base model itself: tokens of the listed regions are kept in
every head, every other token leaves once it is ``--window`` tokens old. It asks whether the base model
could survive eviction at all if the gates knew exactly which tokens matter. Prints one JSON line per
setting: KL (nats per completion token), argmax agreement overall and per region of the predicted token,
and the memory ratio (tokens processed / tokens held at the end, all heads).
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict

import torch
from torch import nn

from dms_runtime.adapters import adapter_path, load_gates
from dms_runtime.attach import attach_dms
from dms_runtime.chain_data import IGNORE, REGIONS, difficulty_batch
from dms_runtime.chain_data import token_regions as regions
from dms_runtime.config import DMSConfig
from dms_runtime.loading import SHIPPED_MODEL, load_model
from dms_runtime.retrofit import left_window_mask


class FixedGate(nn.Module):
    """A gate whose logits are given: +/-50 decides evict/keep for each token (decided one position later).
    KV heads outside ``heads`` (default: all) keep nothing once it leaves the window."""

    def __init__(self, keep: torch.Tensor, decisions: int, heads: list[int] | None = None):
        super().__init__()
        self.query_channels: list[int] = []  # attach_dms's interface: no query channel to zero
        evict = torch.where(keep.bool(), -50.0, 50.0)  # [B, T]: about token t
        shifted = torch.cat([torch.full_like(evict[:, :1], -50.0), evict[:, :-1]], dim=1)  # logit at t+1 decides t
        logits = shifted[:, :, None].repeat(1, 1, decisions)
        for head in set(range(decisions)) - set(range(decisions) if heads is None else heads):
            logits[:, 1:, head] = 50.0
        self.register_buffer("logits", logits)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits


@torch.no_grad()
def measure(model, handle, batch, teacher: torch.Tensor, labels: list[list[str]], window: int, setting: dict) -> dict:
    with handle.mode("train"):
        for module in handle.modules:
            module.dms.noise = False
        student = model(input_ids=batch.input_ids).logits
        alphas = torch.stack([a.float() for a in handle.alphas()])  # [layers, B, decisions, T]
    mask = batch.loss_mask
    t, s = torch.log_softmax(teacher[mask], -1), torch.log_softmax(student[mask], -1)
    agree = teacher.argmax(-1) == student.argmax(-1)  # [B, T]: the prediction made at t, of token t+1
    by_region: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for row, row_labels in enumerate(labels):
        for pos in range(1, int(batch.lengths[row])):
            if batch.labels[row, pos] != IGNORE:
                by_region[row_labels[pos]][0] += 1
                by_region[row_labels[pos]][1] += int(agree[row, pos - 1])
    old = left_window_mask(batch.lengths, alphas.shape[-1], window)  # [B, T]: what eviction can free by the end
    processed = batch.lengths.sum().item() * alphas.shape[0] * alphas.shape[2]  # token x layer x KV head
    held = processed - (alphas * old[None, :, None, :]).sum().item()
    return {**setting, "kl": round((t.exp() * (t - s)).sum(-1).mean().item(), 4),
            "agreement": round(agree[mask].float().mean().item(), 4), "memory_ratio": round(processed / held, 2),
            "agreement_by_region": {r: round(v[1] / v[0], 3) for r, v in sorted(by_region.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", help="a model directory with dms-<CR>x adapters")
    parser.add_argument("--ratios", type=float, nargs="+", default=[2, 4, 8])
    parser.add_argument("--keep", nargs="+", choices=REGIONS, help="regions a hand-written policy keeps (base model)")
    parser.add_argument("--window", type=int, default=16, help="the hand-written policy's window")
    parser.add_argument("--model", help="with --keep: the weights that run under the policy (default: the base model)")
    parser.add_argument("--heads", type=int, nargs="+", help="with --keep: the KV heads (of every layer) that keep the "
                        "regions; the others keep only the window (default: all)")
    parser.add_argument("--k", type=int, default=18)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=99)
    args = parser.parse_args()
    if not args.adapters and not args.keep:
        parser.error("give --adapters or --keep")
    base, tokenizer = load_model(str(SHIPPED_MODEL))
    batch = difficulty_batch(tokenizer, random.Random(args.seed + args.k), args.k, args.k, args.tokens)
    labels = [regions(tokenizer, batch.input_ids[r].tolist(), batch.labels[r].tolist()) for r in range(len(batch.lengths))]
    with torch.no_grad():
        teacher = base(input_ids=batch.input_ids).logits
    if args.keep:
        student = load_model(args.model)[0] if args.model else base
        keep = torch.tensor([[label in args.keep for label in row] for row in labels], dtype=torch.float32)
        decisions = student.config.num_key_value_heads
        gates = nn.ModuleList(FixedGate(keep, decisions, args.heads) for _ in range(student.config.num_hidden_layers))
        handle = attach_dms(student, gates, DMSConfig(window=args.window, per_head=True))
        print(json.dumps(measure(student, handle, batch, teacher, labels, args.window,
                                 {"policy": "keep " + " ".join(args.keep), "heads": args.heads or "all", "window": args.window, "k": args.k,
                                  "model": args.model or str(SHIPPED_MODEL)})), flush=True)
        handle.detach()
        return
    model, _ = load_model(args.adapters)
    for ratio in args.ratios:
        gates, config = load_gates(model, adapter_path(args.adapters, ratio))
        handle = attach_dms(model, gates, config)
        print(json.dumps(measure(model, handle, batch, teacher, labels, config.window,
                                 {"cr": ratio, "window": config.window, "k": args.k})), flush=True)
        handle.detach()


if __name__ == "__main__":
    main()
