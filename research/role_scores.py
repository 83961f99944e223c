"""How well task-agnostic token scores find a chain of thought's long-lived tokens (the prompt and the register lines,
which later lines read long after they are written) among the scratch: the AUC of each score, on reference chains
read by the frozen model. A score any task can compute that ranks them near-perfectly is a candidate for the
retrofit's warm-start labels; the far-attention labels the task-agnostic recipe uses score 0.78 here.

    .venv/bin/python research/role_scores.py [--model checkpoints/chain-qwen3-base] [--k 1-20] [--n 48] [--window 32]

Scores, per token that has left the window, the largest over layers 1.. and KV heads (layer 0 cannot tell a token's
role, ``docs/dms.md``):

- ``far_attention``: the most weight any query more than ``window`` positions later gives it (the current labels);
- ``far_reads``: how many (layer, query head, far query) give it at least 0.05;
- ``far_copy``: the most weight a far query gives it while about to emit the same token (a copy read: attention
  a query pays to structure rather than to a value does not count);
- ``loss_gradient``: how much the model's loss on the text would rise, to first order, if its far queries saw it
  less: minus the gradient of the loss with respect to an additive bias on its scores from those queries, which is
  the signal a DMS gate learns from when nothing is evicted yet (attention weighted by what the value changes).

``--kinds N`` also scores the task-agnostic long-lived set the retrofit can plan (``training.effect_roles``): N
kinds of token (k-means clusters of one layer's hidden state) found on the first half of the chains, each costed by
the loss its eviction adds per token hidden (``--cost kl``: the divergence from the frozen model's next-token
distributions instead); reported are the AUC of that cost on the other half and the precision and recall of the
long-lived kinds chosen (``kinds``). ``--plan-on sampled|greedy`` plans them on the model's own completions of the
first half's problems instead of their reference chains, as the retrofit does on a problem file.

A gate reads a token's hidden state, so it can only learn what is linearly readable there. ``readout_auc`` fits a
linear read-out (logistic regression) of each layer's output hidden state on the first half of the chains and scores
it on the other half: trained on the far-read labels (each chain's most-read quarter, the labels a gate would be
given) it says how far a gate could clean up their noise; trained on the true roles it is the ceiling.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from dms_runtime.attention import _base_mask, _explicit_attention
from dms_runtime.loading import load_model
from tasks.chain import generate_problem
from training.chain_data import IGNORE, LONG_LIVED, encode_example, pad_examples, token_regions
from training.gate_labels import left_window_mask

READ_WEIGHT = 0.05
HIDDEN = -1e4  # a bias that takes a key out of a softmax
READ_LABEL_QUANTILE = 0.75  # the far-read labels: each chain's most-read quarter


class Probe:
    """Per layer: a zero bias on every (KV head, key) that far queries add to their scores, and what was seen."""

    def __init__(self, window: int):
        self.window = window
        self.bias: dict[int, torch.Tensor] = {}
        self.far_max: dict[int, torch.Tensor] = {}
        self.far_reads: dict[int, torch.Tensor] = {}
        self.evicted: torch.Tensor | None = None  # [B, k] bool: keys hidden from far queries in every layer
        self.copies: torch.Tensor | None = None  # [B, q, k] bool: key k holds the token query q is about to emit
        self.far_copy: dict[int, torch.Tensor] = {}

    def attention(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        q_len, k_len = query.shape[2], key.shape[2]
        allowed = _base_mask(attention_mask, q_len, k_len, query.device)
        query_pos = torch.arange(k_len - q_len, k_len)[:, None]
        beyond = (query_pos - torch.arange(k_len)[None, :]) > self.window  # [q, k]
        if self.evicted is not None:  # eviction_effect's passes: only the output matters
            bias = (self.evicted[:, None, :] * HIDDEN).expand(-1, key.shape[1], -1)
            return _explicit_attention(query, key, value, allowed, scaling, bias[:, :, None, :] * beyond)[0], None
        bias = torch.zeros(key.shape[0], key.shape[1], k_len, requires_grad=True)  # [B, kv_heads, k]
        self.bias[module.layer_idx] = bias
        out, probs = _explicit_attention(query, key, value, allowed, scaling, bias[:, :, None, :] * beyond)
        far = probs.detach() * beyond  # [B, heads, q, k]
        self.far_max[module.layer_idx] = far.amax(2)  # [B, heads, k]
        self.far_reads[module.layer_idx] = (far >= READ_WEIGHT).sum(2).float()
        if self.copies is not None:
            self.far_copy[module.layer_idx] = (far * self.copies[:, None, -q_len:, :k_len]).amax(2)
        return out, None


def auc(positive: torch.Tensor, negative: torch.Tensor) -> float:
    """P(a positive outscores a negative), ties counted half (Mann-Whitney)."""
    greater = (positive[:, None] > negative[None, :]).float().mean()
    ties = (positive[:, None] == negative[None, :]).float().mean()
    return float(greater + ties / 2)


@torch.no_grad()
def eviction_effect(model, probe: Probe, ids: list[int], labels: torch.Tensor, old: torch.Tensor,
                    rows: int = 16) -> torch.Tensor:
    """Per old token: how much the loss on the completion rises when that token alone is hidden from every query
    more than the window later, in every layer (one teacher-forced pass per token, ``rows`` at a time)."""
    scored = labels != IGNORE
    targets = labels.clamp(min=0)

    def losses(evicted: torch.Tensor) -> torch.Tensor:
        probe.evicted = evicted
        logits = model(input_ids=torch.tensor([ids] * len(evicted)), use_cache=False).logits.float()[:, :-1]
        nll = F.cross_entropy(logits.transpose(1, 2), targets[None].expand(len(evicted), -1), reduction="none")
        return (nll * scored).sum(-1)

    positions = old.nonzero().flatten()
    base = losses(torch.zeros(1, len(ids), dtype=torch.bool))
    effects = []
    for start in range(0, len(positions), rows):
        chunk = positions[start:start + rows]
        evicted = torch.zeros(len(chunk), len(ids), dtype=torch.bool)
        evicted[torch.arange(len(chunk)), chunk] = True
        effects.append(losses(evicted) - base)
    probe.evicted = None
    return torch.cat(effects) if effects else torch.zeros(0)


def linear_readout(features: torch.Tensor, labels: torch.Tensor, held_out: torch.Tensor, steps: int = 300) -> torch.Tensor:
    """Logits of a logistic regression fitted on (``features``, ``labels``), for ``held_out`` (standardized alike)."""
    mean, scale = features.mean(0), features.std(0) + 1e-5
    features, held_out = (features - mean) / scale, (held_out - mean) / scale
    weight = torch.zeros(features.shape[1], requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.Adam([weight, bias], lr=0.05)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(features @ weight + bias, labels.float()) + 1e-3 * weight.pow(2).sum()
        loss.backward()
        optimizer.step()
    return (held_out @ weight + bias).detach()


def role_scores(model_dir: str, k_min: int, k_max: int, n: int, window: int, seed: int,
                with_eviction_effect: bool = False) -> dict:
    model, tokenizer = load_model(model_dir, dtype=torch.float32)
    probe = Probe(window)
    AttentionInterface.register("role_probe", probe.attention)
    model.config._attn_implementation = "role_probe"
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    rng = random.Random(seed)
    scores: dict[str, list[torch.Tensor]] = {"far_attention": [], "far_reads": [], "loss_gradient": [], "far_copy": []}
    long_lived: list[torch.Tensor] = []
    hidden: list[list[torch.Tensor]] = []  # per chain, per layer: the old tokens' output hidden states
    for _ in range(n):
        ids, prompt_len = encode_example(tokenizer, generate_problem(rng, rng.randint(k_min, k_max)))
        batch = pad_examples([(ids, prompt_len)], tokenizer.pad_token_id)
        token = torch.tensor(ids)
        probe.copies = (token[None, :] == torch.cat([token[1:], torch.tensor([-1])])[:, None])[None]
        output = model(input_ids=batch.input_ids, use_cache=False, output_hidden_states=True)
        logits = output.logits.float()
        labels = batch.labels[0, 1:]
        F.cross_entropy(logits[0, :-1][labels != IGNORE], labels[labels != IGNORE]).backward()
        layers = sorted(probe.bias)[1:]  # layer 0 cannot tell a token's role
        old = left_window_mask(batch.lengths, len(ids), window)[0]  # tokens some far query reads
        scores["far_attention"].append(torch.stack([probe.far_max[l][0] for l in layers]).amax((0, 1))[old])
        scores["far_reads"].append(torch.stack([probe.far_reads[l][0] for l in layers]).sum((0, 1))[old])
        scores["far_copy"].append(torch.stack([probe.far_copy[l][0] for l in layers]).amax((0, 1))[old])
        scores["loss_gradient"].append(torch.stack([-probe.bias[l].grad[0] for l in layers]).amax((0, 1))[old])
        regions = token_regions(tokenizer, ids, batch.labels[0].tolist())
        long_lived.append(torch.tensor([region in LONG_LIVED for region in regions])[old])
        if with_eviction_effect:
            scores.setdefault("eviction_effect", []).append(eviction_effect(model, probe, ids, labels, old))
        hidden.append([state[0].detach()[old] for state in output.hidden_states[1:]])
    roles = torch.cat(long_lived)
    report = {"model": model_dir, "k": [k_min, k_max], "chains": n, "seed": seed, "window": window,
              "tokens": int(roles.numel()), "long_lived_share": round(float(roles.float().mean()), 3), "auc": {}}
    for name, values in scores.items():
        pooled = torch.cat(values)
        report["auc"][name] = round(auc(pooled[roles], pooled[~roles]), 3)
    report["readout_auc"] = readout_aucs(hidden, scores["far_reads"], long_lived)
    return report


def gated_model(model_dir: str, window: int):
    """The frozen model, its tokenizer and (untrained) DMS gates attached: ``handle.evicting`` runs planned evictions."""
    from dms_runtime.attach import attach_dms
    from dms_runtime.config import DMSConfig
    from dms_runtime.gates import build_gates

    model, tokenizer = load_model(model_dir, dtype=torch.float32)
    config = DMSConfig(window=window)
    return model, tokenizer, attach_dms(model, build_gates(model, config), config)


def reference_problems(n: int, k_min: int, k_max: int, seed: int) -> list:
    rng = random.Random(seed)
    return [generate_problem(rng, rng.randint(k_min, k_max)) for _ in range(n)]


def reference_chains(tokenizer, n: int, k_min: int, k_max: int, seed: int) -> list[tuple[list[int], int]]:
    return [encode_example(tokenizer, problem) for problem in reference_problems(n, k_min, k_max, seed)]


def own_chains(model_dir: str, problems: list, temperature: float | None, seed: int) -> list[tuple[list[int], int]]:
    """The model's own completions of ``problems`` as the retrofit samples them (``training.completions``; its own
    sampling, or ``temperature``, 0 greedy), as (token ids, prompt length)."""
    from training.completions import complete_problems

    rows = [{"id": f"plan-{i}", "prompt": p.text, "answer": p.answer} for i, p in enumerate(problems)]
    with tempfile.TemporaryDirectory() as cache:
        completions = complete_problems(model_dir, rows, cache, max_new_tokens=1536, seed=seed,
                                        temperature=temperature, quiet=True)
    return [(c.prompt_ids + c.completion_ids, len(c.prompt_ids)) for c in completions]


def length_batches(tokenizer, examples: list[tuple[list[int], int]], per_batch: int = 4) -> list:
    """Batches of ``per_batch`` examples, neighbours in length together (little padding)."""
    ordered = sorted(examples, key=lambda e: len(e[0]))
    return [pad_examples(ordered[i:i + per_batch], tokenizer.pad_token_id) for i in range(0, len(ordered), per_batch)]


@torch.no_grad()
def held_out_chains(model, handle, tokenizer, examples: list[tuple[list[int], int]], window: int):
    """Per chain, what a long-lived set is scored on: its batch, the frozen model's hidden states, the tokens that left
    the window and the roles' region of every token."""
    with handle.mode("off"):
        for ids, prompt_len in examples:
            batch = pad_examples([(ids, prompt_len)], tokenizer.pad_token_id)
            hidden = model(input_ids=batch.input_ids, use_cache=False, output_hidden_states=True).hidden_states
            yield (batch, hidden, left_window_mask(batch.lengths, len(ids), window)[0],
                   token_regions(tokenizer, ids, batch.labels[0].tolist()))


def long_lived_truth(regions: list[str], old: torch.Tensor) -> torch.Tensor:
    return torch.tensor([region in LONG_LIVED for region in regions])[old]


def against_roles(kept: torch.Tensor, truth: torch.Tensor) -> dict:
    """A long-lived set ``kept`` against the roles' long-lived tokens ``truth`` (both over the same tokens)."""
    return {"kept_share": round(float(kept.float().mean()), 3),
            "precision": round(float(truth[kept].float().mean()), 3) if kept.any() else None,
            "recall": round(float(kept[truth].float().mean()), 3)}


def retrofit_batches(model_dir: str, tokenizer, problems_file: str, batches: int, seed: int) -> list:
    """The calibration batches a retrofit on ``problems_file`` plans its effect roles on: its model's sampled
    completions (cached beside the file), ``batches`` of four spread over every length."""
    from training.completions import sample_completions
    from training.retrofit_data import ProblemText

    cache = Path(problems_file).with_name(Path(problems_file).stem + "-completions")
    completions = sample_completions(model_dir, problems_file, cache, max_new_tokens=1536, seed=seed, quiet=True)
    text = ProblemText.from_completions(completions, seed, tokens_per_batch=0, pad_id=tokenizer.pad_token_id or 0)
    return text.spread_batches(batches)


def kind_scores(model_dir: str, k_min: int, k_max: int, n: int, window: int, seed: int, kinds: int, layer: int,
                mass: float, planned_in: str | None = None, cost_by: str = "nll", plan_on: str = "reference",
                plan_problems: str | None = None, plan_batches: int = 16) -> dict:
    """The effect roles planned on the first half of ``n`` problems (``plan_on``: their reference chains, or the
    model's ``sampled`` or ``greedy`` completions of them, as the retrofit's text), or on the calibration batches a
    retrofit on ``plan_problems`` would make, or those a retrofit planned (read from its state file
    ``planned_in``); scored against the roles on the other half's reference chains."""
    from training.effect_roles import in_completion, plan_effect_roles
    from training.retrofit import restore_role_labels

    model, tokenizer, handle = gated_model(model_dir, window)
    examples = reference_chains(tokenizer, n, k_min, k_max, seed)
    if planned_in:
        roles = restore_role_labels(torch.load(planned_in, weights_only=False)["roles"]).kinds
        kinds, layer, mass = len(roles.centroids), roles.layer, None
    else:
        if plan_problems:
            batches = retrofit_batches(model_dir, tokenizer, plan_problems, plan_batches, seed)
        else:
            planned = examples[: n // 2] if plan_on == "reference" else own_chains(
                model_dir, reference_problems(n, k_min, k_max, seed)[: n // 2], 0.0 if plan_on == "greedy" else None,
                seed)
            batches = length_batches(tokenizer, planned)
        roles = plan_effect_roles(model, handle, batches, window, layer, kinds, mass, seed, cost_by)
    cost, kept, truth = [], [], []
    by_kind: dict[int, Counter] = {}  # kind -> the roles' regions of its held-out tokens
    for batch, hidden, old, regions in held_out_chains(model, handle, tokenizer, examples[n // 2:], window):
        of_kind = roles.kinds(hidden[layer + 1], in_completion(batch))[0]
        cost.append(roles.cost[of_kind][old])
        kept.append(roles.mask(hidden, batch)[0][old])
        truth.append(long_lived_truth(regions, old))
        for position in old.nonzero().flatten().tolist():
            by_kind.setdefault(int(of_kind[position]), Counter())[regions[position]] += 1
    cost, kept, truth = torch.cat(cost), torch.cat(kept), torch.cat(truth)
    table = [{"kind": kind, "cost": round(float(roles.cost[kind]), 3), "long_lived": bool(roles.long_lived[kind]),
              "regions": dict(by_kind[kind].most_common(3))}
             for kind in roles.cost.argsort(descending=True).tolist() if kind in by_kind]
    return {"model": model_dir, "k": [k_min, k_max], "chains": n, "seed": seed, "window": window, "kinds": kinds,
            "layer": layer, "mass": mass, "planned_in": planned_in, "cost_by": None if planned_in else cost_by,
            "plan_on": None if planned_in else f"{plan_problems} ({plan_batches} batches)" if plan_problems else plan_on,
            "auc": round(auc(cost[truth], cost[~truth]), 3),
            "long_lived_kinds": int(roles.long_lived.sum()), **against_roles(kept, truth), "by_kind": table}


def readout_aucs(hidden: list[list[torch.Tensor]], reads: list[torch.Tensor], long_lived: list[torch.Tensor]) -> dict:
    """Per layer, the held-out AUC (against the roles) of a linear read-out of its hidden state trained on the
    far-read labels (``from_far_reads``) or on the roles themselves (``from_roles``, the ceiling)."""
    half = len(hidden) // 2
    read_labels = [r >= r.quantile(READ_LABEL_QUANTILE) if r.numel() else r.bool() for r in reads]
    test_roles = torch.cat(long_lived[half:])
    out: dict[str, list[float]] = {"from_far_reads": [], "from_roles": []}
    for layer in range(len(hidden[0])):
        train = torch.cat([chain[layer] for chain in hidden[:half]])
        test = torch.cat([chain[layer] for chain in hidden[half:]])
        for name, labels in (("from_far_reads", read_labels), ("from_roles", long_lived)):
            logits = linear_readout(train, torch.cat(labels[:half]), test)
            out[name].append(round(auc(logits[test_roles], logits[~test_roles]), 3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="checkpoints/chain-qwen3-base", help="the frozen model the labels come from")
    parser.add_argument("--k", default="1-20", help="difficulty range of the reference chains")
    parser.add_argument("--n", type=int, default=48, help="reference chains read")
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eviction-effect", action="store_true",
                        help="also score each token by the loss its eviction adds (one pass per token: slow)")
    parser.add_argument("--kinds", type=int, default=0, help="also score the effect roles with this many kinds")
    parser.add_argument("--layer", type=int, default=3, help="the effect roles' layer")
    parser.add_argument("--mass", type=float, default=0.8, help="the effect roles' share of the eviction cost")
    parser.add_argument("--kinds-from", help="score the effect roles a retrofit planned (its retrofit_state-*.pt)")
    parser.add_argument("--cost", choices=["nll", "kl"], default="nll", help="the effect roles' cost of a kind")
    parser.add_argument("--plan-on", choices=["reference", "sampled", "greedy"], default="reference",
                        help="the text the effect roles are planned on: reference chains or the model's completions")
    parser.add_argument("--plan-problems", help="plan the effect roles on the calibration batches a retrofit on this "
                        "problem file makes (its model's sampled completions) instead")
    parser.add_argument("--plan-batches", type=int, default=16, help="with --plan-problems: how many batches")
    args = parser.parse_args()
    k_min, _, k_max = args.k.partition("-")
    if args.kinds or args.kinds_from:
        print(json.dumps(kind_scores(args.model, int(k_min), int(k_max or k_min), args.n, args.window, args.seed,
                                     args.kinds, args.layer, args.mass, args.kinds_from, args.cost, args.plan_on,
                                     args.plan_problems, args.plan_batches)))
        return
    print(json.dumps(role_scores(args.model, int(k_min), int(k_max or k_min), args.n, args.window, args.seed,
                                 args.eviction_effect)))


if __name__ == "__main__":
    main()
