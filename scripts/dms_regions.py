"""Where eviction costs the shipped model: teacher-forced scores of DMS settings, overall and by chain-of-thought region.

    .venv/bin/python scripts/dms_regions.py --adapters checkpoints/chain-qwen3-dms --ratios 2 8 --k 16-20
    .venv/bin/python scripts/dms_regions.py --adapters checkpoints/chain-qwen3-dms --ratios 8 --keep-layers 0 3
    .venv/bin/python scripts/dms_regions.py --keep prompt register --window 48 --k 18 --one-path

Fresh reference chains of thought of each difficulty in ``--k`` (numbers or ranges ``A-B``) run through:

- with ``--adapters DIR``: the base model (``vanilla``), DIR's weights without eviction (``cr1``), each
  ratio's deterministic decisions (what inference evicts at threshold 0), and with ``--keep-layers``, that
  ratio with one layer's gates switched to "keep everything" (does one layer's eviction cause the loss?);
- with ``--keep REGION ...``: a hand-written policy on the base model (or ``--model``): tokens of those
  regions are kept (in ``--heads``, default all), every other token leaves once ``--window`` tokens old. It
  asks whether the model could survive eviction at all if the gates knew exactly which tokens matter.

One JSON line per setting and difficulty: KL from the base model (nats per chain-of-thought token), argmax
agreement with it, the memory ratio (tokens processed / held at the end, all heads), and per region
(``training.chain_data.REGIONS``) the agreement and the loss of the reference token. A ``+``/``*``
header's first operand may be either one (both orders are valid), so its loss has a floor; its operator is
determined, so ``header_op`` is the cleanest read of a prompt lookup.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from contextlib import nullcontext

import torch
from torch import nn

from dms_runtime.adapters import adapter_path, load_gates
from dms_runtime.attach import DMSHandle, attach_dms
from training.chain_data import IGNORE, REGIONS, Batch, difficulty_batch, token_regions
from dms_runtime.config import DMSConfig
from dms_runtime.loading import default_model_path, load_model
from training.retrofit import left_window_mask


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
def measure(model, handle: DMSHandle | None, batch: Batch, teacher: torch.Tensor, labels: list[list[str]]) -> dict:
    """Scores of ``model`` (evicting through ``handle``'s deterministic decisions, if any) against ``teacher``'s logits."""
    with handle.mode("train") if handle else nullcontext():
        for module in handle.modules if handle else []:
            module.dms.noise = False
        student = model(input_ids=batch.input_ids).logits.float()
        alphas = torch.stack([a.float() for a in handle.alphas()]) if handle else None  # [layers, B, decisions, T]
    mask = batch.loss_mask
    t, s = torch.log_softmax(teacher[mask], -1), torch.log_softmax(student[mask], -1)
    agree = teacher.argmax(-1) == student.argmax(-1)  # [B, T]: the prediction made at t, of token t+1
    logp = torch.log_softmax(student[:, :-1], -1)
    nll = -logp.gather(-1, batch.labels[:, 1:].clamp(min=0)[..., None])[..., 0]  # [B, T-1]: of token t+1
    by_region: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])  # count, agreed, loss
    for row, row_labels in enumerate(labels):
        for pos in range(1, int(batch.lengths[row])):
            if batch.labels[row, pos] != IGNORE:
                tally = by_region[row_labels[pos]]
                tally[0] += 1
                tally[1] += int(agree[row, pos - 1])
                tally[2] += nll[row, pos - 1].item()
    memory_ratio = 1.0
    if alphas is not None:
        old = left_window_mask(batch.lengths, alphas.shape[-1], handle.config.window)  # what eviction can free by the end
        processed = batch.lengths.sum().item() * alphas.shape[0] * alphas.shape[2]  # token x layer x KV head
        memory_ratio = processed / (processed - (alphas * old[None, :, None, :]).sum().item())
    return {"kl": round((t.exp() * (t - s)).sum(-1).mean().item(), 4), "agreement": round(agree[mask].float().mean().item(), 4),
            "memory_ratio": round(memory_ratio, 2),
            "agreement_by_region": {r: round(v[1] / v[0], 3) for r, v in sorted(by_region.items())},
            "nll_by_region": {r: round(v[2] / v[0], 4) for r, v in sorted(by_region.items())}}


def difficulties(text: str) -> list[int]:
    low, _, high = text.partition("-")
    return list(range(int(low), int(high or low) + 1))


def settings(args, base):
    """(name, model, handle or None) for each setting to score; handles are attached while their setting runs."""
    if args.keep:
        student = load_model(args.model)[0] if args.model else base
        yield {"policy": "keep " + " ".join(args.keep), "heads": args.heads or "all", "window": args.window}, student, "keep"
        return
    model, _ = load_model(args.adapters)
    yield {"setting": "vanilla"}, base, None
    yield {"setting": "cr1"}, model, None
    for ratio in args.ratios:
        yield {"setting": f"{ratio:g}x"}, model, ratio
        for layer in args.keep_layers:
            yield {"setting": f"{ratio:g}x, layer {layer} kept", "layer": layer}, model, ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", help="a model directory with dms-<CR>x adapters")
    parser.add_argument("--ratios", type=float, nargs="+", default=[2, 4, 8])
    parser.add_argument("--keep-layers", type=int, nargs="*", default=[], help="with --adapters: layers to switch to "
                        "keep-everything, one at a time")
    parser.add_argument("--keep", nargs="+", choices=REGIONS, help="regions a hand-written policy keeps")
    parser.add_argument("--window", type=int, default=16, help="the hand-written policy's window")
    parser.add_argument("--model", help="with --keep: the weights that run under the policy (default: the base model)")
    parser.add_argument("--heads", type=int, nargs="+", help="with --keep: the KV heads (of every layer) that keep the "
                        "regions; the others keep only the window (default: all)")
    parser.add_argument("--base", default=str(default_model_path()), help="the vanilla model every setting is compared with")
    parser.add_argument("--k", type=difficulties, nargs="+", default=[[18]], help="difficulties or ranges, e.g. 8 18 or 16-20")
    parser.add_argument("--one-path", action="store_true", help="reference chains in the one-path order (the stage-1 model's)")
    parser.add_argument("--tokens", type=int, default=4000, help="tokens per difficulty")
    parser.add_argument("--seed", type=int, default=99)
    args = parser.parse_args()
    if not args.adapters and not args.keep:
        parser.error("give --adapters or --keep")
    base, tokenizer = load_model(args.base)
    batches = []
    for k in [k for group in args.k for k in group]:
        batch = difficulty_batch(tokenizer, random.Random(args.seed + k), k, k, args.tokens, any_order=not args.one_path)
        labels = [token_regions(tokenizer, ids[:n].tolist(), refs[:n].tolist())
                  for ids, refs, n in zip(batch.input_ids, batch.labels, batch.lengths.tolist())]
        with torch.no_grad():
            batches.append((k, batch, labels, base(input_ids=batch.input_ids).logits.float()))
    for setting, model, gates_from in settings(args, base):
        for k, batch, labels, teacher in batches:
            handle = None
            if gates_from == "keep":
                keep = torch.zeros(batch.input_ids.shape)
                for row, row_labels in enumerate(labels):
                    keep[row, : len(row_labels)] = torch.tensor([label in args.keep for label in row_labels], dtype=torch.float32)
                fixed = nn.ModuleList(FixedGate(keep, model.config.num_key_value_heads, args.heads)
                                      for _ in range(model.config.num_hidden_layers))
                handle = attach_dms(model, fixed, DMSConfig(window=args.window, per_head=True))
            elif gates_from is not None:
                gates, config = load_gates(model, adapter_path(args.adapters, gates_from))
                if "layer" in setting:
                    gates[setting["layer"]].register_forward_hook(lambda module, inputs, logits: logits - 1e4)
                handle = attach_dms(model, gates, config)
            print(json.dumps({**setting, "k": k, **measure(model, handle, batch, teacher, labels)}), flush=True)
            if handle:
                handle.detach()


if __name__ == "__main__":
    main()
