"""``thinkpool kv-growth``: measure what each DMS adapter's heads keep of a thread, and store it with the adapter.

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
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from policies.statistics import quantile
from dms_runtime.adapters import adapter_path, read_adapter_metadata, update_metadata
from tasks.chain import generate_suite
from tasks.prompt import format_prompt
from workers.records import ThreadResult
from workers.thread import SamplingParams
from workers.worker import WorkerConfig, available_ratios, build_engine

QUANTILE = 0.95
# A thread counts when this many of its own tokens left the window: reservations are for threads at their token
# limit, and the fraction a short thread keeps of its few tokens is noisy (4 of 21 is 0.19).
MIN_PAST_WINDOW = 256
MEASURE_POOL_BYTES = 256 * 2**20  # room for every measured thread at once: nothing waits, nothing is preempted
MIN_THREADS_AT_POINT = 8  # a curve point stands on at least this many threads that reached it


@dataclass(frozen=True)
class KVGrowthFit:
    cr: float
    prompt: float  # fraction of prompt tokens kept, at ``quantile`` over threads
    generated: float  # fraction of generated tokens kept past the window, at ``quantile``
    generated_curve: tuple[tuple[int, float], ...]  # (p, fraction kept of the first p past the window), at ``quantile``
    quantile: float
    threads: int  # threads measured (those with enough tokens past the window)
    problems: int
    k: tuple[int, int]
    seed: int
    temperature: float
    max_new_tokens: int


def adapter_k_range(model_dir: str | Path, cr: float) -> tuple[int, int]:
    """The difficulties an adapter was calibrated on (its threshold fit), else the whole chain range."""
    fit = read_adapter_metadata(adapter_path(model_dir, cr)).get("threshold_fit") or {}
    return tuple(fit.get("k", (1, 20)))


def measure_kv_growth(model_dir: str | Path, ratios: list[float] | None = None, problems: int = 16, threads: int = 8,
                      k: tuple[int, int] | None = None, seed: int = 9101, temperature: float = 0.8,
                      max_new_tokens: int = 1536, q: float = QUANTILE, progress: bool = True) -> list[KVGrowthFit]:
    """Run ``threads`` sampled threads on each of ``problems`` fresh problems per adapter; return the growth fits."""
    engine = build_engine(WorkerConfig(model=str(model_dir), kv_budget_bytes=MEASURE_POOL_BYTES))
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    fits = []
    try:
        for cr in ratios or available_ratios(model_dir):
            k_range = k or adapter_k_range(model_dir, cr)
            suite = generate_suite(problems, *k_range, seed=seed)
            for problem in suite:
                engine.submit(problem["id"], engine.encode(format_prompt(problem["prompt"])), list(range(threads)), params, cr)
            with tqdm(total=problems * threads, desc=f"kv growth {cr:g}x", unit="thread", disable=not progress) as bar:
                results = engine.run(on_result=lambda _: bar.update(1))
            counted = [r for r in results if long_enough(r, engine.adapters.window(cr))]
            if not counted:
                raise ValueError(f"no thread at {cr:g}x generated {MIN_PAST_WINDOW} tokens past its window on k {k_range[0]}-{k_range[1]}")
            fits.append(KVGrowthFit(cr, quantile([r.prompt_kept for r in counted], q),
                                    quantile([r.generated_kept for r in counted], q), curve_quantiles(results, q), q,
                                    len(counted), problems, k_range, seed, temperature, max_new_tokens))
    finally:
        engine.close()
    return fits


def long_enough(result: ThreadResult, window: int) -> bool:
    """Whether enough of a thread's own tokens left its window for its kept fraction to count."""
    return result.tokens - window - 1 >= MIN_PAST_WINDOW


def curve_quantiles(results: list[ThreadResult], q: float) -> tuple[tuple[int, float], ...]:
    """At each curve point reached by enough threads, the ``q`` quantile of what they kept of their tokens so far."""
    at_point: dict[int, list[float]] = {}
    for result in results:
        for p, fraction in result.generated_kept_curve:
            at_point.setdefault(p, []).append(fraction)
    return tuple((p, quantile(kept, q)) for p, kept in sorted(at_point.items()) if len(kept) >= MIN_THREADS_AT_POINT)


def store(model_dir: str | Path, fits: list[KVGrowthFit]) -> None:
    """Write each fit into its adapter's metadata (``kv_growth``), where workers read their reservations from."""
    for fit in fits:
        entry = asdict(fit)
        entry.pop("cr")
        update_metadata(adapter_path(model_dir, fit.cr), {"kv_growth": entry})


def describe(fits: list[KVGrowthFit]) -> str:
    return "\n".join(json.dumps(asdict(fit)) for fit in fits)
