"""Who may call the API, with what per-key limits and how often.

``THINKPOOL_API_KEYS=key[:max_samples[:max_kv_budget[:requests_per_minute]]],...``: with keys configured, every
route but the health checks needs one (``X-API-Key`` or ``Authorization: Bearer``), compared in constant time. A
key's limits bound what it may ask for (422 naming the field) and how many requests it may make per minute (429
with ``Retry-After``; ``limits.requests_per_minute`` is the default for keys that set none, and for anonymous
callers, counted per client address, when no keys are configured). A key is known elsewhere only by its id, a
hash: jobs and cached results belong to it.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from dataclasses import dataclass

from orchestrator.schemas import SolveRequest

MAX_BUCKETS = 10_000  # anonymous callers are counted per address: idle ones are forgotten past this many


@dataclass(frozen=True)
class KeyLimits:
    """What one API key may ask for, and how often (None: no limit of its own)."""

    max_samples: int | None = None
    max_kv_budget: int | None = None
    requests_per_minute: int | None = None

    def check(self, body: SolveRequest) -> None:
        samples = 1 if body.samples == "auto" else body.samples
        if self.max_samples is not None and samples > self.max_samples:
            raise ValueError(f"samples: at most {self.max_samples} for this API key")
        if self.max_kv_budget is not None and (body.kv_budget is None or body.kv_budget > self.max_kv_budget):
            raise ValueError(f"kv_budget: at most {self.max_kv_budget} bytes for this API key (set it explicitly)")


def parse_keys(text: str) -> dict[str, KeyLimits]:
    """``key[:max_samples[:max_kv_budget[:requests_per_minute]]],...``; ValueError naming the bad entry."""
    keys = {}
    for index, item in enumerate(filter(None, (part.strip() for part in text.split(","))), start=1):
        key, *limits = item.split(":")
        if not key or len(limits) > 3:
            raise ValueError(f"THINKPOOL_API_KEYS: entry {index} is not key[:max_samples[:max_kv_budget"
                             "[:requests_per_minute]]]")
        try:
            numbers = [int(x) if x else None for x in limits] + [None] * (3 - len(limits))
        except ValueError:
            raise ValueError(f"THINKPOOL_API_KEYS: entry {index}: limits must be whole numbers") from None
        if any(n is not None and n < 1 for n in numbers):
            raise ValueError(f"THINKPOOL_API_KEYS: entry {index}: limits must be at least 1")
        keys[key] = KeyLimits(*numbers)
    return keys


def key_id(key: str) -> str:
    """What a key is known by in jobs, caches and logs (never the key itself)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: its key's id (None when no keys are configured) and limits."""

    key_id: str | None
    limits: KeyLimits | None


class Unauthorized(Exception):
    pass


class RateLimited(Exception):
    def __init__(self, retry_after_s: int, per_minute: int):
        super().__init__(f"rate limit: at most {per_minute} requests per minute for this API key; retry in "
                         f"{retry_after_s} s")
        self.retry_after_s = retry_after_s


class RateLimiter:
    """A token bucket per caller: ``per_minute`` requests a minute, in bursts of up to ``per_minute``."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # caller -> (tokens, when)

    def hit(self, caller: str, per_minute: int) -> None:
        """Count one request; RateLimited (with the seconds until the next one fits) when the bucket is empty."""
        now = time.monotonic()
        rate = per_minute / 60.0
        tokens, when = self._buckets.get(caller, (float(per_minute), now))
        tokens = min(float(per_minute), tokens + (now - when) * rate)
        if tokens < 1.0:
            self._buckets[caller] = (tokens, now)
            raise RateLimited(max(1, math.ceil((1.0 - tokens) / rate)), per_minute)
        self._buckets[caller] = (tokens - 1.0, now)
        if len(self._buckets) > MAX_BUCKETS:
            self._forget_full(now, rate)

    def _forget_full(self, now: float, rate: float) -> None:
        for caller, (tokens, when) in list(self._buckets.items()):
            if tokens + (now - when) * rate >= 60 * rate:
                del self._buckets[caller]


class KeyGate:
    """Authenticates a request's key and counts it against its rate limit."""

    def __init__(self, keys: dict[str, KeyLimits], default_per_minute: int = 0):
        self.keys, self.default_per_minute = keys, default_per_minute
        self.rates = RateLimiter()

    def admit(self, given: str, client: str) -> Caller:
        """The caller behind ``given`` (the key sent, or ""), counted once; Unauthorized or RateLimited."""
        if not self.keys:
            caller = Caller(None, None)
            identity, per_minute = f"address:{client}", self.default_per_minute
        else:
            found = None
            for key, limits in self.keys.items():  # every key compared, in constant time each
                if hmac.compare_digest(given.encode(), key.encode()):
                    found = key
            if found is None:
                raise Unauthorized("missing or unknown API key (X-API-Key or Authorization: Bearer)")
            limits = self.keys[found]
            caller = Caller(key_id(found), limits)
            identity = f"key:{caller.key_id}"
            per_minute = limits.requests_per_minute or self.default_per_minute
        if per_minute:
            self.rates.hit(identity, per_minute)
        return caller
