"""Per-row sampling: each row has its own temperature, top-k, top-p and min-p, and its own random stream.

A thread's random stream is counter-based: its ``k``-th draw is a hash of its seed and ``k`` mapped to a uniform
(:func:`counter_uniforms`), computed on the device for every row at once. So a thread's tokens do not depend on which
other threads share its batch, on how the batch is ordered, or on a preemption (it resumes at its own token count),
and drawing never leaves the device. The filters apply in Hugging Face's order (temperature, top-k, top-p, min-p);
each is skipped entirely when no row uses it (:class:`Filters`, known on the host), so rows without them draw
exactly what they drew before the filters existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for ``x`` in [0, 2**32), without int64 overflow (16-bit halves)."""
    low, high = x & 0xFFFF, x >> 16
    return (low * constant + (((high * constant) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Per row, a uniform in (0, 1) (float64) that depends only on the row's seed (int64, non-negative) and its draw
    counter: draw ``k`` of seed ``s`` is the same on any device and in any batch."""
    seeds, counters = seeds.long(), counters.long()
    x = _mix32((counters & _MASK32) ^ 0x9E3779B9)
    x = _mix32(x ^ (seeds & _MASK32))
    x = _mix32(x ^ ((seeds >> 32) & _MASK32))
    return (x.double() + 0.5) / 2.0**32


@dataclass(frozen=True)
class Filters:
    """Which parts of sampling any row uses: a host fact, so that skipping the rest needs no read of the device."""

    sampled: bool = True  # any row with temperature > 0 (else: argmax for all)
    top_k: bool = True
    top_p: bool = True
    min_p: bool = True

    @classmethod
    def of(cls, temperature, top_p, top_k=None, min_p=None) -> "Filters":
        """From the rows' parameters (host tensors or lists)."""
        def any_(values, test) -> bool:
            return values is not None and any(test(float(v)) for v in values)
        return cls(any_(temperature, lambda t: t > 0), any_(top_k, lambda k: k > 0), any_(top_p, lambda p: p < 1),
                   any_(min_p, lambda m: m > 0))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                draws: torch.Tensor | list[torch.Generator], top_k: torch.Tensor | None = None,
                min_p: torch.Tensor | None = None, filters: Filters | None = None) -> torch.Tensor:
    """One token per row of ``logits [rows, vocab]``; rows with temperature 0 take the argmax. ``top_k`` (0: off)
    keeps a row's k most likely tokens, ``min_p`` (0: off) drops tokens under ``min_p`` times the most likely one.
    ``draws``: each row's uniform (e.g. :func:`counter_uniforms`), or a generator per row to draw it from.
    ``filters``: what any row uses (default: read from the parameters)."""
    filters = filters or Filters.of(temperature.tolist(), top_p.tolist(), None if top_k is None else top_k.tolist(),
                                    None if min_p is None else min_p.tolist())
    chosen = logits.argmax(dim=-1)
    if not filters.sampled:
        return chosen
    device = logits.device
    scaled = logits.float() / temperature.to(device).clamp(min=1e-6)[:, None]
    probs = torch.softmax(scaled, dim=-1)
    if filters.top_k and top_k is not None:
        probs = _top_k(probs, top_k.to(device))
    if filters.top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p.to(device)[:, None]
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    if filters.min_p and min_p is not None:
        floor = min_p.to(device)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    # Inverse-CDF sampling: one uniform per row.
    if isinstance(draws, list):
        draws = torch.stack([torch.rand(1, generator=g) for g in draws])[:, 0]
    uniform = draws.to(device=device, dtype=torch.float32)[:, None]
    cdf = probs.cumsum(dim=-1)
    drawn = (cdf < uniform * cdf[:, -1:]).sum(dim=-1).clamp_max(probs.shape[-1] - 1)
    return torch.where(temperature.to(device) <= 0, chosen, drawn)


def _top_k(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Each row's ``top_k`` most likely tokens, renormalised (rows with 0 keep all), so top-p then reads shares of
    what top-k kept, as in Hugging Face."""
    k = torch.where(top_k > 0, top_k, probs.shape[-1]).clamp(max=probs.shape[-1])
    kth = probs.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None].long())
    kept = probs.masked_fill(probs < kth, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)
