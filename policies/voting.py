"""Aggregation of thread answers into one answer."""

from __future__ import annotations

import math
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


def weighted_vote(answers: list[str | None], weights: list[float]) -> Vote:
    """The answer with the largest total weight (ties: first arrival); ``counts`` are still plain counts."""
    totals: dict[str, float] = {}
    for answer, weight in zip(answers, weights):
        if answer is not None:
            totals[answer] = totals.get(answer, 0.0) + weight
    if not totals:
        return Vote(answer=None, counts={})
    best = max(totals.values())
    winner = next(a for a in answers if a is not None and totals[a] == best)
    return Vote(answer=winner, counts=dict(Counter(a for a in answers if a is not None).most_common()))


def confidence_vote(answers: list[str | None], mean_logprobs: list[float], keep: float = 0.5) -> Vote:
    """DeepConf-style: drop the least confident threads, then weight each kept one by its confidence.

    A thread's confidence is the mean log-probability of its tokens. The ``keep`` fraction most
    confident threads (at least one) vote, each with weight ``exp(mean_logprob)`` (its geometric-mean
    token probability), so a few sure threads outvote many that wandered."""
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    ranked = sorted(range(len(answers)), key=lambda i: mean_logprobs[i], reverse=True)
    kept = sorted(ranked[: max(1, math.ceil(keep * len(answers)))])
    return weighted_vote([answers[i] for i in kept], [math.exp(mean_logprobs[i]) for i in kept])


def best_of_n(texts: list[str], answers: list[str | None], verifier) -> Vote:
    """The answer of the thread that ``verifier(text, answer) -> score`` rates highest (first on ties)."""
    scored = [(verifier(text, answer), -i) for i, (text, answer) in enumerate(zip(texts, answers)) if answer is not None]
    if not scored:
        return Vote(answer=None, counts={})
    _, index = max(scored)
    return Vote(answer=answers[-index], counts=dict(Counter(a for a in answers if a is not None).most_common()))
