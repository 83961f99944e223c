"""Long-lived tokens for any task: the kinds of token whose eviction costs the frozen model most.

The role labels (``training.gate_labels.RoleLabels``) keep a long-lived set of tokens whole in as many (layer, KV
head) pairs as a ratio affords. On the chain task that set is known (the prompt and the register lines); any other
task needs it found. A gate decides a token's fate when the token is written, from its hidden state, so what it can
keep is a *kind* of token, and a kind is what this module scores:

1. kinds: k-means clusters of one layer's output hidden state in the frozen model, over the tokens that leave the
   window on calibration batches of the training text, the prompt's tokens and the completion's apart (every task
   has a prompt, and on the chain model a layer-3 letter of the question and a letter of the thinking share a
   cluster otherwise, though only the question's is needed later);
2. cost: per kind and batch, one pass with every token of that kind hidden from all queries more than the window
   later, in every layer and head (``DMSHandle.evicting``); per token hidden, the rise in the completions' loss
   (``nll``) or the divergence of the completions' next-token distributions from the frozen model's (``kl``: what
   the retrofit's distillation minimizes, and blind to which token a sampled completion happened to draw).
   Hiding a whole kind at once is the point: a value read long after it is written usually has several copies (where
   it was computed, where it was written down, where it was read before), so hiding one token costs little, and
   scores by attention or by one token's eviction mistake that redundancy for scratch (``docs/dms.md``);
3. long-lived: the kinds costliest per token that together carry ``mass`` of the total cost.

Nothing here knows the task: a model, its own completions and their loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F
from tqdm import tqdm

from training.chain_data import IGNORE, Batch
from training.gate_labels import left_window_mask


APART = 1e3  # the completion flag's scale among standardized features: no kind holds tokens of both sides


def in_completion(batch: Batch) -> torch.Tensor:
    """``[B, T]`` bool: the completion's tokens (the rest is prompt or padding)."""
    return batch.labels != IGNORE


def kmeans(points: torch.Tensor, kinds: int, iterations: int = 30, seed: int = 0) -> torch.Tensor:
    """``[kinds, d]`` centroids of ``points [n, d]`` (Lloyd's iterations from a seeded random choice of points)."""
    generator = torch.Generator().manual_seed(seed)
    centroids = points[torch.randperm(len(points), generator=generator)[:kinds]].clone()
    for _ in range(iterations):
        nearest = torch.cdist(points, centroids).argmin(1)
        sums = torch.zeros_like(centroids).index_add_(0, nearest, points)
        counts = torch.bincount(nearest, minlength=len(centroids))[:, None]
        centroids = torch.where(counts > 0, sums / counts.clamp(min=1), centroids)
    return centroids


@dataclass
class EffectRoles:
    """Token kinds (centroids of layer ``layer``'s standardized output hidden state, with a completion flag), the loss
    each kind's eviction adds per token hidden, and which kinds are long-lived."""

    layer: int
    mean: torch.Tensor  # [d]
    scale: torch.Tensor  # [d]
    centroids: torch.Tensor  # [kinds, d + 1]: the last feature is the completion flag (0 or APART)
    cost: torch.Tensor  # [kinds]: loss added per token hidden (0 for a kind no calibration token fell in)
    long_lived: torch.Tensor  # [kinds] bool

    def kinds(self, hidden: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
        """The kind of each hidden state ``[..., d]``, given whether it is the completion's (``[...]`` bool)."""
        return nearest(features(hidden, completion, self.mean, self.scale), self.centroids)

    def mask(self, hidden_states: tuple[torch.Tensor, ...], batch: Batch) -> torch.Tensor:
        """``[B, T]`` bool: a batch's long-lived tokens, from the frozen model's ``output_hidden_states`` on it."""
        hidden = hidden_states[self.layer + 1]
        kinds = self.kinds(hidden, in_completion(batch).to(hidden.device))
        real = torch.arange(kinds.shape[1], device=kinds.device)[None, :] < batch.lengths.to(kinds.device)[:, None]
        return self.long_lived.to(kinds.device)[kinds] & real

    def state(self) -> dict:
        return {"layer": self.layer, "mean": self.mean.tolist(), "scale": self.scale.tolist(),
                "centroids": self.centroids.tolist(), "cost": self.cost.tolist(), "long_lived": self.long_lived.tolist()}

    @classmethod
    def from_state(cls, state: dict) -> EffectRoles:
        return cls(state["layer"], torch.tensor(state["mean"]), torch.tensor(state["scale"]),
                   torch.tensor(state["centroids"]), torch.tensor(state["cost"]), torch.tensor(state["long_lived"]))


def features(hidden: torch.Tensor, completion: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[..., d + 1]``: the standardized hidden state and the completion flag."""
    standardized = (hidden.float() - mean.to(hidden.device)) / scale.to(hidden.device)
    return torch.cat([standardized, completion[..., None].float() * APART], dim=-1)


def nearest(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """The index of the centroid nearest each point ``[..., d]``."""
    flat = points.reshape(-1, points.shape[-1])
    return torch.cdist(flat, centroids.to(points.device)).argmin(1).reshape(points.shape[:-1])


def completion_losses(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``[B]``: each row's summed loss on its completion tokens."""
    mask = batch.loss_mask.to(logits.device)
    targets = torch.cat([batch.input_ids[:, 1:], batch.input_ids[:, :1]], dim=1).to(logits.device)
    nll = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
    return (nll * mask).sum(-1)


def completion_kl(logits: torch.Tensor, reference_logp: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``[B]``: each row's summed KL(reference || model) over the positions that predict its completion."""
    logp = F.log_softmax(logits.float(), dim=-1)
    kl = (reference_logp.exp() * (reference_logp - logp)).sum(-1)
    return (kl * batch.loss_mask.to(logits.device)).sum(-1).cpu()


def choose_long_lived(cost: torch.Tensor, counts: torch.Tensor, mass: float) -> torch.Tensor:
    """The kinds costliest per token that together carry ``mass`` of the total (positive) cost."""
    total = (cost.clamp(min=0) * counts).sum()
    chosen = torch.zeros_like(cost, dtype=torch.bool)
    carried = 0.0
    for kind in cost.argsort(descending=True).tolist():
        if cost[kind] <= 0 or carried >= mass * total:
            break
        chosen[kind] = True
        carried += float(cost[kind] * counts[kind])
    return chosen


@torch.no_grad()
def frozen_pass(model, handle, batches: list[Batch], window: int,
                layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per batch, with the gates off: layer ``layer``'s output hidden states, the tokens that leave the window and
    each row's completion loss."""
    device = next(model.parameters()).device
    hidden, olds, losses = [], [], []
    with handle.mode("off"):
        for batch in batches:
            output = model(input_ids=batch.input_ids.to(device), use_cache=False, output_hidden_states=True)
            hidden.append(output.hidden_states[layer + 1].float().cpu())
            olds.append(left_window_mask(batch.lengths, batch.input_ids.shape[1], window))
            losses.append(completion_losses(output.logits, batch).cpu())
    return hidden, olds, losses


def fit_kinds(hidden: list[torch.Tensor], batches: list[Batch], olds: list[torch.Tensor], layer: int, kinds: int,
              seed: int = 0) -> EffectRoles:
    """Kinds (not yet costed) of the tokens ``olds`` marks, from their hidden states (:func:`frozen_pass`)."""
    states = torch.cat([h[old] for h, old in zip(hidden, olds)])
    if len(states) < kinds:
        raise ValueError(f"effect roles: {len(states)} calibration tokens leave the window, fewer than {kinds} kinds")
    mean, scale = states.mean(0), states.std(0) + 1e-5
    points = torch.cat([features(h, in_completion(b), mean, scale)[old] for h, b, old in zip(hidden, batches, olds)])
    return EffectRoles(layer, mean, scale, kmeans(points, kinds, seed=seed), torch.zeros(kinds),
                       torch.zeros(kinds, dtype=torch.bool))


@torch.no_grad()
def plan_effect_roles(model, handle, batches: list[Batch], window: int, layer: int, kinds: int = 64,
                      mass: float = 0.8, seed: int = 0, cost: str = "nll", quiet: bool = True) -> EffectRoles:
    """Kinds, their costs (``cost``: ``nll`` or ``kl``, see the module) and the long-lived ones, measured on
    ``batches`` with ``model`` (the frozen weights, DMS ``handle`` attached; its mode is restored after)."""
    if cost not in ("nll", "kl"):
        raise ValueError(f"effect roles: cost {cost!r} is not 'nll' or 'kl'")
    device = next(model.parameters()).device
    hidden, olds, bases = frozen_pass(model, handle, batches, window, layer)
    roles = fit_kinds(hidden, batches, olds, layer, kinds, seed)
    added, counts = torch.zeros(kinds), torch.zeros(kinds)
    costed = tqdm(list(zip(batches, hidden, olds, bases)), desc="effect roles: costing kinds", disable=quiet)
    for batch, h, old, base in costed:
        ids = batch.input_ids.to(device)
        if cost == "kl":  # the frozen distribution again, one pass per batch: all batches' logits would not fit
            with handle.mode("off"):
                reference = F.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
        of_kind = roles.kinds(h, in_completion(batch))
        for kind in of_kind[old].unique().tolist():
            evicted = old & (of_kind == kind)
            with handle.evicting(evicted.to(device)):
                logits = model(input_ids=ids, use_cache=False).logits
            added[kind] += (completion_kl(logits, reference, batch) if cost == "kl"
                            else completion_losses(logits, batch).cpu() - base).sum()
            counts[kind] += evicted.sum()
    roles.cost = added / counts.clamp(min=1)
    roles.long_lived = choose_long_lived(roles.cost, counts, mass)
    return roles
