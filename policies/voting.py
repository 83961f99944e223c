"""Aggregation of thread answers into one answer."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Vote:
    """The winning answer (``None`` if no thread answered) and every answer's count."""

    answer: str | None
    counts: dict[str, int]


def majority_vote(answers: list[str | None]) -> Vote:
    """Most frequent answer; a tie goes to the answer that reached the count first (deterministic)."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return Vote(answer=None, counts={})
    best = max(counts.values())
    winner = next(a for a in answers if a is not None and counts[a] == best)
    return Vote(answer=winner, counts=dict(counts.most_common()))
