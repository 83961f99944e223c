"""How much of a thread's KV an adapter keeps: the figure admission control reserves memory by.

Measured per adapter on fresh problems (``thinkpool kv-growth``, :mod:`training.measure_kv_growth`) and stored in
the adapter's metadata under ``kv_growth``; an adapter never measured falls back to DESIGN's ``1/cr``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dms_runtime.adapters import read_adapter_metadata

# A thread's own tokens past its window at which the kept fraction is measured (the growth curve's points).
CURVE_POINTS = (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


@dataclass(frozen=True)
class KVGrowth:
    """The fractions of tokens a ratio's heads keep once the tokens have left the window, pooled over layers and
    KV heads: of the prompt, and of the tokens a thread generates.

    DESIGN's budget model keeps ``1/cr`` of both (:meth:`nominal`). An adapter's measured growth (written by
    ``thinkpool kv-growth``) replaces it: trained gates keep most of the prompt, which holds the values asked
    for later, and far less than ``1/cr`` of the scratch work, so the nominal model reserves memory that
    threads never use. They also keep more of a thread's first tokens (its input registers) than of the rest,
    so the measurement is a curve, ``generated_curve``: ``(p, f)``, of its first ``p`` tokens past the window a
    thread keeps ``f``; ``generated`` is the fraction over whole threads, used where there is no curve."""

    prompt: float
    generated: float
    generated_curve: tuple[tuple[int, float], ...] = ()

    @classmethod
    def nominal(cls, cr: float) -> "KVGrowth":
        kept = 1.0 if cr <= 1 else 1.0 / cr
        return cls(kept, kept)

    def kept_generated(self, past: int) -> float:
        """Tokens (per head) a thread keeps of its first ``past`` own tokens past the window: between the curve's
        points the kept count is interpolated (never decreasing, as a thread's held tokens only grow); before the
        first point and beyond the last the nearest point's fraction applies."""
        if past <= 0:
            return 0.0
        if not self.generated_curve:
            return self.generated * past
        points = [(0, 0.0)]
        for p, fraction in self.generated_curve:
            points.append((p, max(points[-1][1], fraction * p)))
        for (p0, k0), (p1, k1) in zip(points, points[1:]):
            if past <= p1:
                return k0 + (k1 - k0) * (past - p0) / (p1 - p0)
        last_p, last_kept = points[-1]
        return last_kept * past / last_p

    def as_dict(self) -> dict:
        return {"prompt": self.prompt, "generated": self.generated, "generated_curve": [list(p) for p in self.generated_curve]}

    @classmethod
    def from_dict(cls, data: dict) -> "KVGrowth":
        curve = tuple((int(p), float(f)) for p, f in data.get("generated_curve") or ())
        return cls(float(data["prompt"]), float(data["generated"]), curve)


def read_kv_growth(adapter: str | Path) -> KVGrowth | None:
    """The growth measured for the adapter at ``adapter`` (None when it was never measured)."""
    measured = read_adapter_metadata(adapter).get("kv_growth")
    if not isinstance(measured, dict):
        return None
    return KVGrowth.from_dict(measured)
