"""Building the workers a service, an eval or a batch runs on, from a model directory and a KV budget."""

from __future__ import annotations

import os

from workers.runner import ThreadRunner


def make_pool(model_dir, kv_budget: int | None = None, workers: int = 1, reserve: str = "measured") -> ThreadRunner:
    """The workers a service, eval or batch runs on: Ray actors, or (``workers == 0``) one engine in this process.
    ``kv_budget`` (bytes per worker) defaults to ``$THINKPOOL_KV_BUDGET``, else the worker's default."""
    from workers.worker import WorkerConfig

    if kv_budget is None and os.environ.get("THINKPOOL_KV_BUDGET"):
        kv_budget = parse_bytes(os.environ["THINKPOOL_KV_BUDGET"])
    config = WorkerConfig(model=str(model_dir), kv_budget_bytes=kv_budget, reserve=reserve)
    if workers == 0:
        from workers.local import LocalPool

        return LocalPool(config)
    from workers.pool import WorkerPool

    return WorkerPool(config, num_workers=workers)


UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """Bytes: ``12000000``, ``12e6``, ``64MiB``, ``1.5GB`` (``ValueError`` otherwise)."""
    number = text.strip().lower().rstrip("bikmg")
    unit = text.strip().lower()[len(number):]
    try:
        value = int(float(number) * UNITS[unit])
    except (ValueError, KeyError):
        raise ValueError(f"expected bytes such as 12000000, 64MiB or 1.5GB, got {text!r}") from None
    if value < 1:
        raise ValueError(f"must be at least 1 byte, got {text!r}")
    return value
