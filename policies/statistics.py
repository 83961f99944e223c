"""Small statistics shared by measurements (KV growth, latency, paired gains)."""

from __future__ import annotations

import math


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile: an observed value, never below what that share of the values reach."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
