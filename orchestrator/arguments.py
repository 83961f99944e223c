"""argparse types shared by the CLI and ``python -m orchestrator.batch``: each names its limit when it refuses a value."""

from __future__ import annotations

import argparse
from typing import Callable


def bounded(kind: Callable, low: float | None = None, high: float | None = None) -> Callable:
    """An argparse type that converts with ``kind`` and enforces ``low <= value <= high``."""

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            span = f"between {low} and {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value

    return convert


def k_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        k_min, k_max = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K or KMIN-KMAX, got {text!r}") from None
    if not 1 <= k_min <= k_max <= 24:
        raise argparse.ArgumentTypeError(f"k range must lie within 1-24 with KMIN <= KMAX, got {text!r}")
    return k_min, k_max


def byte_size(text: str) -> int:
    """Bytes: ``12000000``, ``12e6``, ``64MiB``, ``1.5GB``."""
    from workers.factory import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def fixed_config(text: str) -> tuple[float, int]:
    """``CRxTHREADS``, e.g. ``8x16``: a fixed compression ratio and thread count."""
    ratio, _, threads = text.lower().partition("x")
    try:
        cr, n = float(ratio), int(threads)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CRxTHREADS such as 8x16, got {text!r}") from None
    if not (1 <= cr <= 64 and 1 <= n <= 1024):
        raise argparse.ArgumentTypeError(f"ratio must lie within 1-64 and threads within 1-1024, got {text!r}")
    return cr, n


def sample_count(maximum: int, word: str = "fit") -> Callable:
    """``word`` (``fit``: as many threads as the KV pool holds; ``auto``: the controller) or a count in 1..maximum."""
    count = bounded(int, 1, maximum)

    def convert(text: str):
        return word if text == word else count(text)

    return convert
