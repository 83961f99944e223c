"""What a DMS adapter keeps, by the role of each token in a chain of thought: of the tokens that have left the window
at a thread's end, the fraction each layer's KV heads still hold, for the two long-lived roles (the prompt, the
register lines) and for the scratch (everything else, dead a few tokens after it is written).

The chain recipe's labels keep the long-lived tokens whole in most (layer, head) pairs and drop the scratch; a
task-agnostic retrofit has to find that split on its own. This probe says whether it did: a pair that keeps ~100% of
the long-lived tokens and ~0% of the scratch has learned the roles, one that keeps the same fraction of both has not.

    .venv/bin/python research/kept_by_role.py --model checkpoints/chain-qwen3 --cr 8 [--k 16-20] [--n 24] [--seed 0]

Reads reference chains (``training.chain_data.encode_example``), each in one teacher-forced pass, which holds what
decoding it would have held (``training.thresholds.measure_teacher_forced``). A pair counts as keeping the
long-lived tokens ``whole`` when it holds at least 95% of both roles' tokens outside the window.

``--planned STATE`` also scores the adapter against the long-lived set a task-agnostic retrofit planned for itself
(``warmstart_labels: effect_roles``, in its ``retrofit_state-*.pt``; the kinds read off the hidden states of the
adapter's ``base_model``, the frozen model it planned with): the fraction of those tokens each pair keeps, and how many pairs the plan asked to keep
them whole at this ratio. It tells a plan the gates did not learn from a plan that was wrong.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from dms_runtime.adapters import adapter_path, load_adapter, read_adapter_metadata
from dms_runtime.loading import load_model
from tasks.chain import generate_problem
from training.chain_data import encode_example, pad_examples, token_regions
from training.gate_labels import left_window_mask
from training.retrofit import restore_role_labels

WHOLE = 0.95
ROLES = ("prompt", "register", "scratch")


@torch.inference_mode()
def kept_by_role(model_dir: str, cr: float, k_min: int, k_max: int, n: int, seed: int,
                 threshold: float | None = None, planned: str | None = None) -> dict:
    model, tokenizer = load_model(model_dir)
    adapter = read_adapter_metadata(adapter_path(model_dir, cr))
    plan = restore_role_labels(torch.load(planned, weights_only=False)["roles"]) if planned else None
    frozen_model = load_model(adapter["base_model"])[0] if plan is not None else None
    planned_counts = None  # [layers, kv heads, (kept, eligible)]
    handle = load_adapter(model, adapter_path(model_dir, cr), threshold=threshold)
    window = handle.config.window
    rng = random.Random(seed)
    layers = len(handle.modules)
    counts = None  # [layers, kv heads, role (ROLES), (kept, eligible)]
    for _ in range(n):
        ids, prompt_len = encode_example(tokenizer, generate_problem(rng, rng.randint(k_min, k_max)))
        batch = pad_examples([(ids, prompt_len)], tokenizer.pad_token_id)
        regions = token_regions(tokenizer, ids, batch.labels[0].tolist())
        role = torch.tensor([ROLES.index(r) if r in ROLES[:2] else ROLES.index("scratch") for r in regions])
        left_window = left_window_mask(batch.lengths, len(ids), window)[0]
        cache = handle.new_cache()
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        if plan is not None:
            hidden = frozen_model(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True).hidden_states
            planned_mask = plan.kinds.mask(hidden, batch)[0] & left_window
        for layer_index, layer in enumerate(cache.layers):
            held = torch.zeros(layer.pos.shape[1], len(ids), dtype=torch.bool)  # [heads, tokens]
            positions = layer.pos[0]
            for head in range(positions.shape[0]):
                kept = positions[head][positions[head] >= 0]
                held[head, kept] = True
            if counts is None:
                counts = torch.zeros(layers, held.shape[0], len(ROLES), 2)
            for index in range(len(ROLES)):
                mask = (role == index) & left_window
                counts[layer_index, :, index, 0] += held[:, mask].sum(-1).float()
                counts[layer_index, :, index, 1] += mask.sum().float()
            if plan is not None:
                if planned_counts is None:
                    planned_counts = torch.zeros(layers, held.shape[0], 2)
                planned_counts[layer_index, :, 0] += held[:, planned_mask].sum(-1).float()
                planned_counts[layer_index, :, 1] += planned_mask.sum().float()
    handle.detach()
    fractions = counts[..., 0] / counts[..., 1].clamp(min=1)  # [layers, heads, role]
    report = {"model": model_dir, "cr": cr, "threshold": handle.config.threshold, "k": [k_min, k_max], "problems": n,
              "seed": seed, "window": window,
              "pairs": int(fractions.shape[0] * fractions.shape[1]),
              "pairs_keeping_long_lived_whole": int((fractions[..., :2] >= WHOLE).all(-1).sum())}
    for index, name in enumerate(ROLES):  # overall, then per layer and KV head
        report[f"{name}_kept"] = round(float(counts[:, :, index, 0].sum() / counts[:, :, index, 1].sum()), 3)
    for index, name in enumerate(ROLES):
        report[f"{name}_kept_by_layer"] = [[round(float(f), 3) for f in layer] for layer in fractions[..., index]]
    if plan is not None:
        planned_fractions = planned_counts[..., 0] / planned_counts[..., 1].clamp(min=1)
        ratios = [float(r) for r in adapter["ratios_trained_together"]]  # the plan's thresholds are in this order
        ratio_index = ratios.index(float(cr))
        report |= {"planned": planned, "planned_long_lived_kept": round(float(planned_counts[..., 0].sum()
                                                                             / planned_counts[..., 1].sum()), 3),
                   "pairs_planned_whole": plan.kept_pairs(ratio_index),
                   "pairs_keeping_planned_whole": int((planned_fractions >= WHOLE).sum()),
                   "planned_kept_by_layer": [[round(float(f), 3) for f in layer] for layer in planned_fractions]}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model directory with dms-<cr>x adapters")
    parser.add_argument("--cr", type=float, required=True)
    parser.add_argument("--k", default="16-20", help="difficulty range of the reference chains, e.g. 16-20")
    parser.add_argument("--n", type=int, default=24, help="reference chains read")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", type=float, help="the gates' decision threshold (default: the adapter's own)")
    parser.add_argument("--planned", help="a retrofit's state file: also score the long-lived set it planned")
    args = parser.parse_args()
    k_min, _, k_max = args.k.partition("-")
    print(json.dumps(kept_by_role(args.model, args.cr, int(k_min), int(k_max or k_min), args.n, args.seed, args.threshold,
                                  args.planned)))


if __name__ == "__main__":
    main()
