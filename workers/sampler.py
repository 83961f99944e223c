"""Choosing each thread's next token: per-row temperature, top-k, nucleus (top-p) and min-p, per-thread random
streams.

Every row draws from its own ``torch.Generator``, seeded from its thread's seed, so a thread's tokens do
not depend on which other threads share its batch: the same seed gives the same thread. The filters apply in
Hugging Face's order (temperature, top-k, top-p, min-p); each is skipped entirely when no row uses it, so rows
without them draw exactly what they drew before the filters existed.
"""

from __future__ import annotations

import torch


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, generators: list[torch.Generator],
                top_k: torch.Tensor | None = None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits [rows, vocab]``; rows with temperature 0 take the argmax. ``top_k`` (0: off)
    keeps a row's k most likely tokens, ``min_p`` (0: off) drops tokens under ``min_p`` times the most likely one."""
    greedy = temperature <= 0
    chosen = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return chosen
    scaled = logits.float() / temperature.clamp(min=1e-6)[:, None].to(logits.device)
    probs = torch.softmax(scaled, dim=-1)
    if top_k is not None and bool((top_k > 0).any()):
        probs = _top_k(probs, top_k.to(probs.device))
    if bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p[:, None].to(probs.device)
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    if min_p is not None and bool((min_p > 0).any()):
        floor = min_p.to(probs.device)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    # Inverse-CDF sampling: one uniform draw per row, from that row's own generator.
    uniform = torch.stack([torch.rand(1, generator=g) for g in generators]).to(probs.device)
    cdf = probs.cumsum(dim=-1)
    drawn = (cdf < uniform * cdf[:, -1:]).sum(dim=-1).clamp_max(probs.shape[-1] - 1)
    return torch.where(greedy.to(chosen.device), chosen, drawn)


def _top_k(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Each row's ``top_k`` most likely tokens, renormalised (rows with 0 keep all), so top-p then reads shares of
    what top-k kept, as in Hugging Face."""
    k = torch.where(top_k > 0, top_k, probs.shape[-1]).clamp(max=probs.shape[-1])
    kth = probs.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None].long())
    kept = probs.masked_fill(probs < kth, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)
