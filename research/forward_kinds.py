"""Long-lived kinds chosen under eviction: forward selection from everything past the window hidden.

``training.effect_roles`` costs each kind of token with every other token present. This probe asks whether costing
under the eviction a high ratio makes picks a set closer to the chain roles: starting with every token that has left
the window hidden (in every layer and head), it keeps, round by round, the kind whose keeping lowers the completions'
loss most per token, until the kept kinds hold ``--share`` of those tokens. The kinds are the effect roles' (k-means
of layer ``--layer``'s hidden state, prompt and completion apart), planned on the first quarter of the chains; the
set is scored against the chain roles on the second half, as ``role_scores.py --kinds`` scores the effect roles.

    .venv/bin/python research/forward_kinds.py [--kinds 32] [--share 0.25] [--n 48]
"""

from __future__ import annotations

import argparse
import json

import torch

from role_scores import against_roles, gated_model, held_out_chains, length_batches, long_lived_truth, reference_chains
from training.effect_roles import completion_losses, fit_kinds, frozen_pass, in_completion


@torch.no_grad()
def forward_kinds(model_dir: str, kinds: int, share: float, n: int, layer: int, window: int, seed: int) -> dict:
    model, tokenizer, handle = gated_model(model_dir, window)
    examples = reference_chains(tokenizer, n, 1, 20, seed)
    batches = length_batches(tokenizer, examples[: n // 4])
    hidden, olds, _ = frozen_pass(model, handle, batches, window, layer)
    roles = fit_kinds(hidden, batches, olds, layer, kinds, seed)
    of_kind = [roles.kinds(h, in_completion(b)) for h, b in zip(hidden, batches)]
    counts = sum(torch.bincount(k[old], minlength=kinds).float() for k, old in zip(of_kind, olds))

    def loss_keeping(kept: torch.Tensor) -> float:
        total = 0.0
        for batch, k, old in zip(batches, of_kind, olds):
            with handle.evicting(old & ~kept[k]):
                total += completion_losses(model(input_ids=batch.input_ids).logits, batch).sum().item()
        return total

    kept = torch.zeros(kinds, dtype=torch.bool)
    current, rounds = loss_keeping(kept), []
    while counts[kept].sum() < share * counts.sum():
        gains = {j: (current - loss_keeping(kept | (torch.arange(kinds) == j))) / counts[j].item()
                 for j in range(kinds) if not kept[j] and counts[j] > 0}
        best = max(gains, key=gains.get, default=None)
        if best is None or gains[best] <= 0:
            break
        kept[best] = True
        current -= gains[best] * counts[best].item()
        rounds.append({"kind": best, "gain_per_token": round(gains[best], 3),
                       "share": round(float(counts[kept].sum() / counts.sum()), 3)})
    chosen, truth = [], []
    for batch, hidden_states, old, regions in held_out_chains(model, handle, tokenizer, examples[n // 2:], window):
        chosen.append(kept[roles.kinds(hidden_states[layer + 1], in_completion(batch))[0]][old])
        truth.append(long_lived_truth(regions, old))
    return {"model": model_dir, "chains": n, "seed": seed, "window": window, "kinds": kinds, "layer": layer,
            "share": share, **against_roles(torch.cat(chosen), torch.cat(truth)), "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="checkpoints/chain-qwen3-base")
    parser.add_argument("--kinds", type=int, default=32)
    parser.add_argument("--share", type=float, default=0.25, help="stop once the kept kinds hold this share")
    parser.add_argument("--n", type=int, default=48, help="reference chains: a quarter plans, the last half scores")
    parser.add_argument("--layer", type=int, default=3)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(forward_kinds(args.model, args.kinds, args.share, args.n, args.layer, args.window, args.seed)))


if __name__ == "__main__":
    main()
