"""When to stop sampling a problem: once its leading answer is settled.

The rule (in the spirit of adaptive consistency): treat the two most frequent answers' shares as unknown,
with a uniform prior; the posterior probability that the leader's share really is the larger one is
``P(Beta(a + 1, b + 1) > 1/2)`` for counts ``a`` (leader) and ``b`` (runner-up). For integer counts it has
a closed form, a binomial tail: ``P(Binomial(a + b + 1, 1/2) <= a)``. Sampling stops once it reaches
``threshold`` (default 0.95): 4 agreeing threads and no dissent settle it (0.97); 3-0 does not (0.94);
a 6-1 split settles it (0.96), a 5-2 split does not (0.86). More threads cannot change a settled answer
often enough to pay for themselves.
"""

from __future__ import annotations

from math import comb


def leader_probability(counts: dict[str, int]) -> float:
    """Posterior probability that the most frequent answer is truly the most likely one (top two compared)."""
    top = sorted(counts.values(), reverse=True) + [0, 0]
    a, b = top[0], top[1]
    n = a + b + 1
    return sum(comb(n, j) for j in range(a + 1)) / 2**n


def settled(counts: dict[str, int], threshold: float = 0.95) -> bool:
    """True when more threads are unlikely to change the leading answer."""
    return bool(counts) and leader_probability(counts) >= threshold
