"""Eviction labels for the gate warm start and for gate supervision: which KV entries each ratio should drop.

Two schemes. ``far_attention_labels`` evicts the keys the frozen model reads least from beyond the window, a
fixed fraction of them per batch. ``RoleLabels`` (chain-task models) knows which tokens hold values that are
read long after they are written (the prompt and the register lines: "long-lived") and gives every
(layer, head) pair from layer 1 on its own band for them, so a ratio keeps them whole in as many pairs as
its memory allows; its thresholds are fixed before training, on calibration batches, so that the labels
realize the ratio as eval measures it (a mean over threads, layers and heads of tokens processed / tokens
held), not a uniform fraction: heads then evict unequally, and the trained gates need no threshold fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

LabelSample = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # scores [layers, B, kv, T], eligible (same), lengths [B]


def left_window_mask(lengths: torch.Tensor, width: int, window: int) -> torch.Tensor:
    """``[n, width]``: the tokens of each row that have left the window by the row's end (eviction can free them)."""
    return torch.arange(width, device=lengths.device)[None, :] < (lengths[:, None] - 1 - window)


def eligible_mask(scores: torch.Tensor, lengths: torch.Tensor, window: int) -> torch.Tensor:
    """``scores``' shape ``[layers, B, kv, T]``: the keys that left the window by their row's end."""
    return left_window_mask(lengths.to(scores.device), scores.shape[-1], window)[None, :, None, :].expand_as(scores)


def threshold_labels(scores: torch.Tensor, lengths: torch.Tensor, window: int,
                     threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labels ``[layers, B, kv, T]`` (1 = evict: scores under ``threshold``, among keys that left the window),
    their weights and that mask. A key labelled "keep" weighs its score over the threshold (up to 100):
    losing a key the model reads heavily costs more than losing one near the line."""
    eligible = eligible_mask(scores, lengths, window)
    threshold = max(threshold, 1e-6)
    return ((scores < threshold) & eligible).float(), (scores / threshold).clamp(1.0, 100.0), eligible


def sampled_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q``-quantile of ``values``, estimated on at most a million of them (``torch.quantile``'s limit)."""
    return torch.quantile(values[torch.randperm(len(values), device=values.device)[:1_000_000]].float(), q)


def far_attention_labels(far: list[torch.Tensor], lengths: torch.Tensor, window: int, fraction: float,
                         per_token: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labels as :func:`threshold_labels`, evicting the ``fraction`` of keys (that left the window) that get the
    least far attention, over all layers and heads together.

    ``per_token``: a token's score is the most far attention it gets in any layer and head, so every head
    gets the same label for it: a token is kept everywhere if anything reads it far later."""
    stacked = torch.stack(far)  # [layers, B, kv, T]
    if per_token:
        stacked = stacked.amax(dim=(0, 2), keepdim=True).expand_as(stacked)
    eligible = eligible_mask(stacked, lengths, window)
    if not eligible.any():
        return torch.zeros_like(stacked), torch.ones_like(stacked), eligible
    return threshold_labels(stacked, lengths, window, sampled_quantile(stacked[eligible], fraction).item())


def pair_bonus(reads: torch.Tensor) -> torch.Tensor:
    """``[layers, kv]`` bands for long-lived tokens from ``reads`` (each pair's mean far attention to them): the
    pairs of layer 1 on, ranked by how much they read, get ``P, P - 1, ..., 1`` (P pairs); the first layer
    gets none, because its gates see one token's embedding and cannot tell a token's role (a linear probe on
    the shipped model: 79% where "all scratch" scores 77%; from layer 1 on 96-99%)."""
    bonus = torch.zeros_like(reads, dtype=torch.float32)
    order = reads[1:].flatten().argsort(descending=True)
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(len(order))
    bonus[1:] = (len(order) - ranks).float().view_as(reads[1:])
    return bonus


def label_ratio(samples: list[LabelSample], threshold: float) -> float:
    """The labels' realized ratio at ``threshold``: tokens processed / tokens held, averaged over the rows, layers
    and heads of each sample, then over samples (the eval metric, window included). Give one sample per
    difficulty: eval weighs problems equally, and a batch of short problems has many more rows."""
    means = []
    for scores, eligible, lengths in samples:
        evicted = ((scores < threshold) & eligible).sum(-1)  # [layers, B, kv]
        processed = lengths.to(evicted.device)[None, :, None]
        means.append((processed / (processed - evicted).clamp(min=1)).float().mean().item())
    return sum(means) / len(means)


def fit_label_threshold(samples: list[LabelSample], ratio: float, top_band: int) -> float:
    """The score threshold whose labels realize ``ratio``. Below 1 (scratch only) it is bisected; from 1 on it
    is the band floor (a whole number) that comes closest, so each pair keeps its long-lived tokens whole: a
    gate knows a token's role when the token is written, not which long-lived tokens will be read least."""
    if ratio <= label_ratio(samples, 1.0):
        low, high = 0.0, 1.0
        for _ in range(30):
            middle = (low + high) / 2
            low, high = (middle, high) if label_ratio(samples, middle) < ratio else (low, middle)
        return high
    return float(min(range(1, top_band + 2), key=lambda band: abs(math.log(label_ratio(samples, band) / ratio))))


@dataclass
class RoleLabels:
    """The role labels of every ratio: long-lived tokens score their pair's band plus their far attention, any
    other token its far attention alone (at most 1); ratio ``r`` evicts what scores under ``thresholds[r]``."""

    bonus: torch.Tensor  # [layers, kv]
    thresholds: list[float]
    kinds: Any = None  # training.effect_roles.EffectRoles where the long-lived set is planned (else the chain task's)

    def scores(self, far: list[torch.Tensor], long_lived: torch.Tensor) -> torch.Tensor:
        """``[layers, B, kv, T]`` keep priorities from per-layer far attention ``[B, kv, T]`` and ``long_lived``
        ``[B, T]``."""
        stacked = torch.stack(far)
        bonus = self.bonus.to(stacked.device)[:, None, :, None]
        return stacked + long_lived.to(stacked.device)[None, :, None, :] * bonus

    def labels(self, scores: torch.Tensor, lengths: torch.Tensor, window: int,
               ratio_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return threshold_labels(scores, lengths, window, self.thresholds[ratio_index])

    def kept_pairs(self, ratio_index: int) -> int:
        """How many (layer, head) pairs keep their long-lived tokens at this ratio."""
        return int((self.bonus >= max(self.thresholds[ratio_index], 1e-6)).sum().item())

    @classmethod
    def plan(cls, probes: list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]], ratios: list[float],
             window: int) -> RoleLabels:
        """Bands and thresholds from calibration probes: (per-layer far attention, long-lived mask, lengths)."""
        stacked = [torch.stack(far) for far, _, _ in probes]  # [layers, B, kv, T] each
        long_lived = [mask.to(s.device)[None, :, None, :].expand_as(s) for s, (_, mask, _) in zip(stacked, probes)]
        read = sum((s * m).sum(dim=(1, 3)) for s, m in zip(stacked, long_lived))
        count = sum(m.sum(dim=(1, 3)) for m in long_lived)
        bonus = pair_bonus(read / count.clamp(min=1))
        plan = cls(bonus, [])
        samples = []
        for far, mask, lengths in probes:
            scores = plan.scores(far, mask)
            samples.append((scores, eligible_mask(scores, lengths, window), lengths))
        plan.thresholds = [fit_label_threshold(samples, ratio, int(bonus.max().item())) for ratio in ratios]
        return plan

    def state(self) -> dict:
        return {"bonus": self.bonus.tolist(), "thresholds": self.thresholds,
                "kinds": self.kinds.state() if self.kinds is not None else None}

    @classmethod
    def from_state(cls, state: dict, kinds: Any = None) -> RoleLabels:
        """``kinds``: the effect roles restored from ``state["kinds"]``, where there are any."""
        return cls(torch.tensor(state["bonus"]), list(state["thresholds"]), kinds)
