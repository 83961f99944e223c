"""How much of a thread's KV an adapter keeps: the figure admission control reserves memory by.

Measured per adapter on fresh problems (``thinkpool kv-growth``, :mod:`orchestrator.kv_growth`) and stored in
the adapter's metadata under ``kv_growth``; an adapter never measured falls back to DESIGN's ``1/cr``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dms_runtime.adapters import read_adapter_metadata


@dataclass(frozen=True)
class KVGrowth:
    """The fractions of tokens a ratio's heads keep once the tokens have left the window, pooled over layers and
    KV heads: of the prompt, and of the tokens a thread generates.

    DESIGN's budget model keeps ``1/cr`` of both (:meth:`nominal`). An adapter's measured growth (written by
    ``thinkpool kv-growth``) replaces it: trained gates keep most of the prompt, which holds the values asked
    for later, and far less than ``1/cr`` of the scratch work, so the nominal model reserves memory that
    threads never use."""

    prompt: float
    generated: float

    @classmethod
    def nominal(cls, cr: float) -> "KVGrowth":
        kept = 1.0 if cr <= 1 else 1.0 / cr
        return cls(kept, kept)


def read_kv_growth(adapter: str | Path) -> KVGrowth | None:
    """The growth measured for the adapter at ``adapter`` (None when it was never measured)."""
    measured = read_adapter_metadata(adapter).get("kv_growth")
    if not isinstance(measured, dict):
        return None
    return KVGrowth(float(measured["prompt"]), float(measured["generated"]))
