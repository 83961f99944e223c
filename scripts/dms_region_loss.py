"""Teacher-forced loss of a DMS model by chain-of-thought region, and what keeping one layer whole changes.

    .venv/bin/python scripts/dms_region_loss.py checkpoints/chain-qwen3-dms --ratios 2 8 [--keep-layers 0 1 2 3 4 5]

Runs fresh hard batches (k 16..20, either operand order) through the vanilla base model, the DMS model
without eviction (CR 1), each ratio's deterministic training-mode eviction (what inference evicts at
threshold 0), and each ratio with one layer's gates switched to "keep everything". Prints one JSON line
per setting: per region (``dms_runtime.chain_data.REGIONS``), the mean negative log-likelihood of the
reference token. A header's first operand may be either one of a ``+``/``*`` line (both orders are valid),
so its loss has a floor; its operator is determined, so ``header_op`` is the cleanest read of a prompt lookup.
"""

from __future__ import annotations

import argparse
import collections
import json
import random

import torch

from dms_runtime.adapters import adapter_path, load_gates
from dms_runtime.attach import attach_dms
from dms_runtime.chain_data import IGNORE, difficulty_batch, token_regions
from dms_runtime.loading import SHIPPED_MODEL, load_model


def region_nll(model, batches, regions) -> dict[str, float]:
    total, count = collections.Counter(), collections.Counter()
    for batch, batch_regions in zip(batches, regions):
        logp = torch.log_softmax(model(input_ids=batch.input_ids).logits[:, :-1].float(), -1)
        targets = batch.labels[:, 1:]
        scored = targets != IGNORE
        nll = -logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        for row, col in scored.nonzero().tolist():
            region = batch_regions[row][col + 1]
            total[region] += nll[row, col].item()
            count[region] += 1
    return {region: round(total[region] / count[region], 4) for region in sorted(count)}


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a model directory with dms-<CR>x adapters")
    parser.add_argument("--base", default=str(SHIPPED_MODEL))
    parser.add_argument("--ratios", type=float, nargs="+", default=[2, 8])
    parser.add_argument("--keep-layers", type=int, nargs="*", default=[], help="layers to switch to keep-everything, one at a time")
    parser.add_argument("--tokens", type=int, default=3000, help="tokens per difficulty")
    parser.add_argument("--seed", type=int, default=500)
    args = parser.parse_args()
    base, tokenizer = load_model(args.base)
    model, _ = load_model(args.model)
    batches = [difficulty_batch(tokenizer, random.Random(args.seed + k), k, k, args.tokens, any_order=True) for k in range(16, 21)]
    regions = [[token_regions(tokenizer, ids[:n].tolist(), labels[:n].tolist())
                for ids, labels, n in zip(b.input_ids, b.labels, b.lengths.tolist())] for b in batches]
    print(json.dumps({"setting": "vanilla", "nll": region_nll(base, batches, regions)}), flush=True)
    print(json.dumps({"setting": "cr1", "nll": region_nll(model, batches, regions)}), flush=True)
    for ratio in args.ratios:
        gates, config = load_gates(model, adapter_path(args.model, ratio))
        handle = attach_dms(model, gates, config)
        with handle.mode("train"):
            for module in handle.modules:
                module.dms.noise = False
            print(json.dumps({"setting": f"{ratio:g}x", "nll": region_nll(model, batches, regions)}), flush=True)
            for layer in args.keep_layers:
                hook = gates[layer].register_forward_hook(lambda module, inputs, logits: logits - 1e4)
                print(json.dumps({"setting": f"{ratio:g}x, layer {layer} kept", "nll": region_nll(model, batches, regions)}), flush=True)
                hook.remove()
        handle.detach()


if __name__ == "__main__":
    main()
