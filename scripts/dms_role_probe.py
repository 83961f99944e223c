"""Can a gate know a token's role when it is written? A linear probe per layer, on the shipped model.

    .venv/bin/python scripts/dms_role_probe.py

A DMS gate is linear in the (normalised) input of its layer at the position after the token it decides
about. This fits the same kind of classifier, one per layer, to say whether that token is long-lived
(prompt or register line, ``training.chain_data.LONG_LIVED``), on frozen hidden states of chain-task
batches, and prints its held-out accuracy and long-lived recall as JSON lines. It backs the retrofit's
``cot_roles`` labels: where the probe fails (the first layer, which sees one token's embedding), no
gate can keep by role.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from training.chain_data import difficulty_batch, long_lived_mask
from dms_runtime.loading import default_model_path, load_model


@torch.no_grad()
def features(model, tokenizer, seed: int, batches: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per layer, the normalised layer input at position t+1 of every token t; and whether t is long-lived."""
    per_layer: list[list[torch.Tensor]] = [[] for _ in range(model.config.num_hidden_layers)]
    targets = []
    for index in range(batches):
        batch = difficulty_batch(tokenizer, random.Random(seed + index), 1, 20, 3000)
        hidden = model(input_ids=batch.input_ids, output_hidden_states=True).hidden_states
        decided = torch.arange(batch.input_ids.shape[1] - 1)[None, :] < (batch.lengths[:, None] - 1)  # has a next token
        for layer, rows in enumerate(per_layer):
            rows.append(model.model.layers[layer].input_layernorm(hidden[layer])[:, 1:][decided])
        targets.append(long_lived_mask(tokenizer, batch)[:, :-1][decided])
    return [torch.cat(rows) for rows in per_layer], torch.cat(targets).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(default_model_path()))
    parser.add_argument("--batches", type=int, default=12, help="training batches (3,000 tokens each); 4 more are held out")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    train_x, train_y = features(model, tokenizer, 1, args.batches)
    test_x, test_y = features(model, tokenizer, 10_000, 4)
    print(json.dumps({"long_lived_share": round(test_y.mean().item(), 3)}))
    for layer, (x, held_out) in enumerate(zip(train_x, test_x)):
        weight = torch.zeros(x.shape[1], requires_grad=True)
        bias = torch.zeros(1, requires_grad=True)
        optimizer = torch.optim.Adam([weight, bias], lr=0.01)
        for _ in range(args.steps):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ weight + bias, train_y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            keep = (held_out @ weight + bias) > 0
        print(json.dumps({"layer": layer, "accuracy": round((keep.float() == test_y).float().mean().item(), 3),
                          "long_lived_recall": round(keep[test_y.bool()].float().mean().item(), 3)}))


if __name__ == "__main__":
    main()
