"""How much of a thread's KV an adapter keeps: the figure admission control reserves memory by.

Measured per ratio on problems (``thinkpool kv-growth``, :mod:`training.measure_kv_growth`) and stored with the
gates: in a thinkpool adapter's metadata under ``kv_growth``, or, for an NVIDIA-layout directory, which has no
adapter file, in ``thinkpool-kv-growth.json`` beside its weights with the fingerprint of the weights it was measured
on (:func:`write_growth_file`, :func:`measured_growth`). Gates never measured, or whose weights changed since, fall
back to DESIGN's ``1/cr``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dms_runtime.adapters import read_adapter_metadata

log = logging.getLogger(__name__)

# A thread's own tokens past its window at which the kept fraction is measured (the growth curve's points).
CURVE_POINTS = (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
# A thread counts in a measurement when this many of its own tokens left the window: reservations are for threads
# at their token limit, and the fraction a short thread keeps of its few tokens is noisy (4 of 21 is 0.19).
MIN_PAST_WINDOW = 256
GROWTH_FILE = "thinkpool-kv-growth.json"  # beside an NVIDIA-layout directory's config.json
GROWTH_FORMAT = "thinkpool-kv-growth/1"


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


# -- the growth file of an NVIDIA-layout directory ----------------------------------------------------------------
def growth_file(model_dir: str | Path) -> Path:
    return Path(model_dir) / GROWTH_FILE


def read_growth_file(model_dir: str | Path) -> tuple[str, dict[float, dict]] | None:
    """The fingerprint of the weights the file was measured on and its entry per ratio (each an adapter's
    ``kv_growth`` entry: the fit and how it was measured); None without a file. Raises ValueError naming the file
    and the field for one that is not what :func:`write_growth_file` writes."""
    path = growth_file(model_dir)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read the measured KV growth ({error})") from error
    if not isinstance(data, dict) or data.get("format") != GROWTH_FORMAT:
        raise ValueError(f"{path}: field 'format': expected {GROWTH_FORMAT!r} (written by thinkpool kv-growth)")
    fingerprint, ratios = data.get("fingerprint"), data.get("ratios")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"{path}: field 'fingerprint': must be the measured weights' fingerprint (a string)")
    if not isinstance(ratios, dict):
        raise ValueError(f"{path}: field 'ratios': must map each ratio to its measured growth")
    entries = {}
    for name, entry in ratios.items():
        try:
            KVGrowth.from_dict(entry)
            entries[float(name)] = entry
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            raise ValueError(f"{path}: field 'ratios.{name}': not a measured growth ({error!r})") from error
    return fingerprint, entries


def write_growth_file(model_dir: str | Path, fingerprint: str, entries: Mapping[float, dict]) -> Path:
    """Store each ratio's measured growth ``entries`` beside the model, with the fingerprint of the weights they were
    measured on. Entries of other ratios measured on the same weights are kept; any measured on other weights go."""
    path = growth_file(model_dir)
    try:
        stored = read_growth_file(model_dir)
    except ValueError:
        stored = None  # an unreadable file is replaced by the new measurement
    kept = stored[1] if stored is not None and stored[0] == fingerprint else {}
    ratios = {f"{cr:g}": entry for cr, entry in sorted({**kept, **entries}.items())}
    text = json.dumps({"format": GROWTH_FORMAT, "fingerprint": fingerprint, "ratios": ratios}, indent=2) + "\n"
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)  # a reader sees the old file or the new one, never half of one
    return path


def measured_growth(model_dir: str | Path, cr: float, fingerprint: Callable[[], str]) -> KVGrowth | None:
    """The growth stored beside an NVIDIA-layout directory for ratio ``cr``, if it was measured on these weights
    (``fingerprint()``, asked only when there is a file). A file measured on other weights is ignored with a
    warning: its figures say nothing about these gates, and admission falls back to the nominal ``1/cr``."""
    stored = read_growth_file(model_dir)
    if stored is None:
        return None
    measured_on, entries = stored
    actual = fingerprint()
    if measured_on != actual:
        log.warning("%s was measured on weights %s, these are %s: ignored, admission reserves the nominal 1/cr until "
                    "`thinkpool kv-growth --model %s` measures them again", growth_file(model_dir), measured_on, actual,
                    model_dir)
        return None
    entry = entries.get(float(cr))
    return None if entry is None else KVGrowth.from_dict(entry)
