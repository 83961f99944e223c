"""Aggregation of thread answers into one answer."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

# A task's verifier: ``(problem, answer) -> bool | float``, higher is better (``True`` counts as 1).
Verifier = Callable[[str, str], "bool | float"]


@dataclass(frozen=True)
class Vote:
    """The winning answer (``None`` if no thread answered) and every answer's count."""

    answer: str | None
    counts: dict[str, int]


def grouped(answers: list[str | None], key: Callable[[str], str] | None) -> list[str | None]:
    """Each answer replaced by the first answer with the same ``key`` (a task family's comparison key), so that
    ``0.5`` and ``\\frac{1}{2}`` count as one answer, reported as the thread that came first wrote it."""
    if key is None:
        return list(answers)
    first: dict[str, str] = {}
    return [None if a is None else first.setdefault(key(a), a) for a in answers]


def majority_vote(answers: list[str | None], confidences: list[float] | None = None,
                  key: Callable[[str], str] | None = None) -> Vote:
    """Most frequent answer (answers with the same ``key`` are one answer, see :func:`grouped`). A tie goes to the
    tied answer whose threads are more confident in sum (``confidences``: each thread's mean log-probability), and
    without confidences to the one that appeared first.

    Why not arrival order: threads arrive as they finish, the shortest first, and a chain of thought that is
    short for its problem has often skipped a step. Ties broken by arrival went to the wrong answer: vanilla's
    4-thread votes on 140 hard problems tied 13 times and won none, where chance wins 4. With confidences the
    vote depends on the threads alone, not on the order a scheduler returned them in."""
    answers = grouped(answers, key)
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return Vote(answer=None, counts={})
    best = max(counts.values())
    tied = [a for a in dict.fromkeys(answers) if a is not None and counts[a] == best]  # in order of appearance
    if confidences is not None and len(tied) > 1:
        total = {a: sum(c for x, c in zip(answers, confidences) if x == a) for a in tied}
        tied.sort(key=lambda a: -total[a])  # stable: the first to appear among exact ties
    return Vote(answer=tied[0], counts=dict(counts.most_common()))


def weighted_vote(answers: list[str | None], weights: list[float], key: Callable[[str], str] | None = None) -> Vote:
    """The answer with the largest total weight (ties: first arrival); ``counts`` are still plain counts."""
    answers = grouped(answers, key)
    totals: dict[str, float] = {}
    for answer, weight in zip(answers, weights):
        if answer is not None:
            totals[answer] = totals.get(answer, 0.0) + weight
    if not totals:
        return Vote(answer=None, counts={})
    best = max(totals.values())
    winner = next(a for a in answers if a is not None and totals[a] == best)
    return Vote(answer=winner, counts=dict(Counter(a for a in answers if a is not None).most_common()))


def confidence_vote(answers: list[str | None], mean_logprobs: list[float], keep: float = 0.5,
                    key: Callable[[str], str] | None = None) -> Vote:
    """DeepConf-style: drop the least confident threads, then weight each kept one by its confidence.

    A thread's confidence is the mean log-probability of its tokens. The ``keep`` fraction most
    confident threads (at least one) vote, each with weight ``exp(mean_logprob)`` (its geometric-mean
    token probability), so a few sure threads outvote many that wandered."""
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    ranked = sorted(range(len(answers)), key=lambda i: mean_logprobs[i], reverse=True)
    kept = sorted(ranked[: max(1, math.ceil(keep * len(answers)))])
    return weighted_vote([answers[i] for i in kept], [math.exp(mean_logprobs[i]) for i in kept], key)


# The votes a run of sampled threads can be scored by (``thinkpool eval --vote``, the controller's ``weighting``).
VOTES = ("majority", "confidence")


def vote_by(rule: str, answers: list[str | None], mean_logprobs: list[float],
            key: Callable[[str], str] | None = None) -> Vote:
    """The answer of ``rule`` (one of :data:`VOTES`): :func:`majority_vote` (ties to the surer threads) or
    :func:`confidence_vote` (the surer half, weighted by confidence)."""
    if rule == "majority":
        return majority_vote(answers, mean_logprobs, key=key)
    if rule == "confidence":
        return confidence_vote(answers, mean_logprobs, key=key)
    raise ValueError(f"vote must be one of {', '.join(VOTES)}, got {rule!r}")


def best_of_n(texts: list[str], answers: list[str | None], verifier) -> Vote:
    """The answer of the thread that ``verifier(text, answer) -> score`` rates highest (first on ties)."""
    scored = [(verifier(text, answer), -i) for i, (text, answer) in enumerate(zip(texts, answers)) if answer is not None]
    if not scored:
        return Vote(answer=None, counts={})
    _, index = max(scored)
    return Vote(answer=answers[-index], counts=dict(Counter(a for a in answers if a is not None).most_common()))


def verified_vote(problem: str, answers: list[str | None], verifier: Verifier,
                  key: Callable[[str], str] | None = None) -> Vote:
    """Best-of-N with a task's verifier: the answer ``verifier(problem, answer)`` scores highest, each distinct
    answer scored once (a verifier may be costly); equal scores go to the more frequent answer, then the first.

    Unlike :func:`best_of_n`, the verifier sees the problem, not a thread's text: it is the caller's check of an
    answer (a unit test, a solver), which is what an SDK user has."""
    answers = grouped(answers, key)
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return Vote(answer=None, counts={})
    order = list(dict.fromkeys(a for a in answers if a is not None))
    scores = {a: float(verifier(problem, a)) for a in order}
    winner = max(order, key=lambda a: (scores[a], counts[a], -order.index(a)))
    return Vote(answer=winner, counts=dict(counts.most_common()))
