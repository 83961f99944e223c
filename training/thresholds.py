"""Fitting each DMS adapter's decision threshold so that it realizes its target compression on fresh problems.

Training holds each ratio at a fraction of evicted tokens. What a ratio promises, and what ``thinkpool eval``
reports, is the realized compression: tokens processed / tokens held per head at a thread's end, averaged
over heads and threads. The two part ways when heads evict unequally: a head that keeps the register lines
holds several times what a head that keeps only its window holds, and a mean of ratios follows the second.
So trained gates overshoot (the shipped 8x gates realized 11x). The threshold (evict where a gate's logit
exceeds it) moves all of an adapter's decisions together, and the realized ratio falls as it rises, so a
bisection over greedy solves of fresh problems finds the threshold that lands on the target.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from dms_runtime.adapters import adapter_path, load_adapter, read_adapter_metadata, set_threshold
from dms_runtime.loading import load_model
from policies.extraction import answers_match
from tasks.chain import generate_suite
from tasks.prompt import format_prompt
from evaluation.reference_decode import KVPolicy, SamplingParams, generate_threads

DEFAULT_PROBLEMS = 64  # calibration problems when a config does not name a number


@dataclass(frozen=True)
class ThresholdFit:
    target_cr: float
    threshold: float
    realized_cr: float  # on the calibration problems, at ``threshold``
    accuracy: float  # greedy, on the same problems
    trials: int  # thresholds tried
    problems: int
    seed: int


def measure(model, tokenizer, adapter: Path, threshold: float, problems: list[dict],
            max_new_tokens: int = 1536) -> tuple[float, float]:
    """Greedy solves of ``problems`` with the adapter at ``threshold``: (mean realized ratio, accuracy)."""
    handle = load_adapter(model, adapter, threshold=threshold)
    try:
        result = generate_threads(model, tokenizer, [format_prompt(p["prompt"]) for p in problems], 1,
                                  SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens), progress=False,
                                  kv=KVPolicy(dms=handle))
    finally:
        handle.detach()
    correct = sum(answers_match(t.answer, problems[t.problem_index]["answer"]) for t in result.threads)
    return result.realized_cr, correct / len(problems)


def fit_threshold(model, tokenizer, adapter: Path, problems: list[dict], seed: int, tolerance: float = 0.03,
                  max_trials: int = 10, step: float = 4.0, progress: bool = True) -> ThresholdFit:
    """The threshold, among at most ``max_trials`` tried, whose realized ratio is nearest the adapter's target:
    it brackets the target by doubling steps from the adapter's current threshold, then bisects."""
    metadata = read_adapter_metadata(adapter)
    target = float(metadata["target_cr"])
    tried: dict[float, tuple[float, float]] = {}
    bar = tqdm(total=max_trials, desc=f"threshold {target:g}x", disable=not progress)

    def ratio_at(threshold: float) -> float:
        if threshold not in tried:
            tried[threshold] = measure(model, tokenizer, adapter, threshold, problems)
            bar.update(1)
            bar.set_postfix(threshold=f"{threshold:.2f}", realized_cr=f"{tried[threshold][0]:.2f}", accuracy=f"{tried[threshold][1]:.2f}")
        return tried[threshold][0]

    def close_enough() -> bool:
        return any(abs(r / target - 1) <= tolerance for r, _ in tried.values())

    start = float(metadata["dms_config"]["threshold"])
    direction = 1.0 if ratio_at(start) > target else -1.0  # raise the threshold to evict less
    near, far = start, start + direction * step
    while len(tried) < max_trials and not close_enough() and (ratio_at(far) > target) == (direction > 0):
        near, far, step = far, far + direction * 2 * step, 2 * step
    while len(tried) < max_trials and not close_enough():
        middle = (near + far) / 2
        near, far = (middle, far) if (ratio_at(middle) > target) == (direction > 0) else (near, middle)
    bar.close()
    best = min(tried, key=lambda t: abs(tried[t][0] / target - 1))
    return ThresholdFit(target, best, tried[best][0], tried[best][1], len(tried), len(problems), seed)


def fit_thresholds(model_dir: str | Path, adapter_dir: str | Path, ratios: list[float], k_min: int, k_max: int,
                   problems: int = DEFAULT_PROBLEMS, seed: int = 9001, progress: bool = True) -> list[ThresholdFit]:
    """Fit and write the threshold of each adapter ``adapter_dir/dms-<r>x`` of the model at ``model_dir``."""
    model, tokenizer = load_model(model_dir)
    suite = generate_suite(problems, k_min, k_max, seed=seed)
    fits = []
    for ratio in ratios:
        path = adapter_path(adapter_dir, ratio)
        fit = fit_threshold(model, tokenizer, path, suite, seed, progress=progress)
        set_threshold(path, fit.threshold, extra={"threshold_fit": asdict(fit) | {"k": [k_min, k_max]}})
        fits.append(fit)
    return fits


def describe(fits: list[ThresholdFit]) -> str:
    return "\n".join(json.dumps(asdict(fit)) for fit in fits)
