"""``thinkpool kv-growth``: measure what each ratio's gates keep of a thread, and store it with the gates.

Admission control reserves, for every thread, what it can grow to. DESIGN's model says a head keeps the
window and ``1/cr`` of the rest, but a ratio is a mean over heads and over whole sequences, and trained gates
spend it unevenly: the shipped 8x adapters keep most of the prompt (the values asked for later) and about a
thirteenth of the scratch work a thread generates, so reserving ``1/cr`` of the token limit leaves half the
pool unused. Here each adapter runs sampled threads through the engine on fresh problems; the fractions kept
of prompt and of generated tokens (past the window, layers and heads pooled) are taken at a high quantile
over threads, so that most threads hold less than their reservation and the rest are what preemption is for.
The generated fraction is also taken at every point of a curve (the first 32, 64, ... tokens past the window),
since a chain's first tokens are kept more than its later scratch: a thread with a short token limit is
reserved what threads of that length kept, not the long-run fraction.

Problems are a problem file's rows, each encoded and stopped by its task family as ``eval`` runs it, or fresh
chain problems (the chain task's models). The fits go into each thinkpool adapter's metadata, or, for an
NVIDIA-layout directory, into its growth file with the weights' fingerprint (:mod:`dms_runtime.kv_growth`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from dms_runtime.adapters import adapter_path, model_fingerprint, read_adapter_metadata, update_metadata
from dms_runtime.kv_growth import MIN_PAST_WINDOW, write_growth_file
from dms_runtime.model_dir import context_length, read_config
from dms_runtime.nvidia_layout import NvidiaAdapterSet, read_dms_config
from policies.statistics import quantile
from tasks.chain import generate_suite
from tasks.jsonl import row_family
from workers.records import ThreadResult
from workers.thread import SamplingParams
from workers.worker import WorkerConfig, available_ratios, build_engine

QUANTILE = 0.95
MEASURE_POOL_BYTES = 256 * 2**20  # room for every measured thread at once: nothing waits, nothing is preempted
MIN_THREADS_AT_POINT = 8  # a curve point stands on at least this many threads that reached it
FULL_K_RANGE = (1, 20)  # the chain task's difficulties


class TooShortError(ValueError):
    """No thread ran long enough past its window to be measured; the message says what to change."""


@dataclass(frozen=True)
class KVGrowthFit:
    cr: float
    prompt: float  # fraction of prompt tokens kept, at ``quantile`` over threads
    generated: float  # fraction of generated tokens kept past the window, at ``quantile``
    generated_curve: tuple[tuple[int, float], ...]  # (p, fraction kept of the first p past the window), at ``quantile``
    quantile: float
    threads: int  # threads measured (those with enough tokens past the window)
    problems: int
    k: tuple[int, int] | None  # the generated chain problems' difficulties; None: a problem file's
    seed: int
    temperature: float
    max_new_tokens: int
    task: str = "chain"  # the family of rows that name none
    min_past_window: int = MIN_PAST_WINDOW
    fingerprint: str = ""  # the measured weights' (model and an NVIDIA directory's own gates)


def adapter_k_range(model_dir: str | Path, cr: float) -> tuple[int, int]:
    """The difficulties an adapter was calibrated on (its threshold fit), else the whole chain range (also for
    gates with no thinkpool adapter file: an NVIDIA-layout directory's)."""
    path = adapter_path(model_dir, cr)
    if not path.is_file():
        return FULL_K_RANGE
    fit = read_adapter_metadata(path).get("threshold_fit") or {}
    return tuple(fit.get("k", FULL_K_RANGE))


def measure_kv_growth(model_dir: str | Path, ratios: list[float] | None = None, n: int = 16, threads: int = 8,
                      k: tuple[int, int] | None = None, seed: int = 9101, temperature: float = 0.8,
                      max_new_tokens: int = 1536, q: float = QUANTILE, progress: bool = True,
                      problems: list[dict] | None = None, task: str = "chain",
                      min_past_window: int = MIN_PAST_WINDOW) -> list[KVGrowthFit]:
    """Run ``threads`` sampled threads on each of ``n`` problems per ratio; return the growth fits.

    ``problems``: rows of a problem file (the first ``n``; a row is of its own ``task``, else of ``task``), encoded
    and stopped by their family; without them, ``n`` fresh chain problems per ratio (difficulties ``k``, default
    the adapter's threshold-fit range). A thread counts when ``min_past_window`` of its own tokens left the window;
    raises :class:`TooShortError` when none did. A thread runs at most what the model's context leaves."""
    engine = build_engine(WorkerConfig(model=str(model_dir), kv_budget_bytes=MEASURE_POOL_BYTES, reserve="nominal"))
    adapters = engine.adapters
    fingerprint = model_fingerprint(engine.model, adapters.layout.gates if isinstance(adapters, NvidiaAdapterSet) else None)
    context = context_length(read_config(model_dir))
    fits = []
    try:
        for cr in ratios or available_ratios(model_dir):
            k_range = None if problems is not None else (k or adapter_k_range(model_dir, cr))
            suite = problems[:n] if problems is not None else generate_suite(n, *k_range, seed=seed)
            for index, problem in enumerate(suite):
                family = row_family(problem, task)
                ids = family.encode(problem["prompt"], engine.tokenizer)
                limit = max_new_tokens if not context else max(1, min(max_new_tokens, context - len(ids)))
                params = SamplingParams(temperature=temperature, max_new_tokens=limit, seed=seed)
                engine.submit(f"kv-growth-{cr:g}-{index}", ids, list(range(threads)), params, cr, family=family)
            with tqdm(total=len(suite) * threads, desc=f"kv growth {cr:g}x", unit="thread", disable=not progress) as bar:
                results = engine.run(on_result=lambda _: bar.update(1))
            window = adapters.window(cr)
            counted = [r for r in results if long_enough(r, window, min_past_window)]
            if not counted:
                longest = max((r.tokens for r in results), default=0)
                source = "these problems" if k_range is None else f"chain problems of k {k_range[0]}-{k_range[1]}"
                raise TooShortError(
                    f"no thread at {cr:g}x on {source} generated {min_past_window} tokens past its {window}-token "
                    f"window (the longest generated {longest} tokens, at most {max_new_tokens} allowed): raise "
                    "--max-new-tokens, measure on problems whose threads run longer (--problems, --k), or lower "
                    "--min-past-window")
            fits.append(KVGrowthFit(cr, quantile([r.prompt_kept for r in counted], q),
                                    quantile([r.generated_kept for r in counted], q), curve_quantiles(results, q), q,
                                    len(counted), len(suite), k_range, seed, temperature, max_new_tokens, task,
                                    min_past_window, fingerprint))
    finally:
        engine.close()
    return fits


def long_enough(result: ThreadResult, window: int, min_past_window: int = MIN_PAST_WINDOW) -> bool:
    """Whether enough of a thread's own tokens left its window for its kept fraction to count."""
    return result.tokens - window - 1 >= min_past_window


def curve_quantiles(results: list[ThreadResult], q: float) -> tuple[tuple[int, float], ...]:
    """At each curve point reached by enough threads, the ``q`` quantile of what they kept of their tokens so far."""
    at_point: dict[int, list[float]] = {}
    for result in results:
        for p, fraction in result.generated_kept_curve:
            at_point.setdefault(p, []).append(fraction)
    return tuple((p, quantile(kept, q)) for p, kept in sorted(at_point.items()) if len(kept) >= MIN_THREADS_AT_POINT)


def store(model_dir: str | Path, fits: list[KVGrowthFit]) -> list[Path]:
    """Store the fits where workers read their reservations from: each thinkpool adapter's metadata
    (``kv_growth``), or an NVIDIA-layout directory's growth file, with the weights' fingerprint. Returns the paths."""
    entries = {}
    for fit in fits:
        entry = asdict(fit)
        entry.pop("cr")
        entries[fit.cr] = entry
    if read_dms_config(model_dir) is None:
        for cr, entry in entries.items():
            update_metadata(adapter_path(model_dir, cr), {"kv_growth": entry})
        return [adapter_path(model_dir, cr) for cr in entries]
    fingerprints = {fit.fingerprint for fit in fits}
    if len(fingerprints) != 1 or not fits[0].fingerprint:
        raise ValueError(f"fits: measured on {len(fingerprints)} sets of weights; store one measurement at a time")
    return [write_growth_file(model_dir, fits[0].fingerprint, entries)]


def describe(fits: list[KVGrowthFit]) -> str:
    return "\n".join(json.dumps(asdict(fit)) for fit in fits)
