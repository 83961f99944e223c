"""Choosing each thread's next token: per-row temperature and nucleus (top-p), per-thread random streams.

Every row draws from its own ``torch.Generator``, seeded from its thread's seed, so a thread's tokens do
not depend on which other threads share its batch: the same seed gives the same thread.
"""

from __future__ import annotations

import torch


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``logits [rows, vocab]``; rows with temperature 0 take the argmax."""
    greedy = temperature <= 0
    chosen = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return chosen
    scaled = logits.float() / temperature.clamp(min=1e-6)[:, None].to(logits.device)
    probs = torch.softmax(scaled, dim=-1)
    if bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p[:, None].to(probs.device)
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    # Inverse-CDF sampling: one uniform draw per row, from that row's own generator.
    uniform = torch.stack([torch.rand(1, generator=g) for g in generators]).to(probs.device)
    cdf = probs.cumsum(dim=-1)
    drawn = (cdf < uniform * cdf[:, -1:]).sum(dim=-1).clamp_max(probs.shape[-1] - 1)
    return torch.where(greedy.to(chosen.device), chosen, drawn)
