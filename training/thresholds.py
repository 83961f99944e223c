"""Fitting each DMS adapter's decision threshold so that it realizes its target compression on fresh problems.

Training holds each ratio at a fraction of evicted tokens. What a ratio promises, and what ``thinkpool eval``
reports, is the realized compression: tokens processed / tokens held per head at a thread's end, averaged
over heads and threads. The two part ways when heads evict unequally: a head that keeps the register lines
holds several times what a head that keeps only its window holds, and a mean of ratios follows the second.
So trained gates overshoot (the shipped 8x gates realized 11x). The threshold (evict where a gate's logit
exceeds it) moves all of an adapter's decisions together, and the realized ratio falls as it rises, so a
bisection finds the threshold that lands on the target.

Two ways to measure the realized ratio at a threshold. Greedy solves of fresh generated chain problems (the chain
recipe; they also give an accuracy). Or teacher-forced passes over text the model produced (any task: the retrofit's
cached completions of the user's prompts), no generation and no answers needed: DMS decides a token's fate from the
hidden state of the next position and prefill evicts as decoding does, so one forward pass over a finished thread
holds what decoding it would have held.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dms_runtime.adapters import adapter_path, load_adapter, read_adapter_metadata, set_threshold
from dms_runtime.loading import load_model
from policies.extraction import answers_match
from tasks.chain import generate_suite
from tasks.prompt import format_prompt
from evaluation.reference_decode import KVPolicy, SamplingParams, generate_threads

DEFAULT_PROBLEMS = 64  # calibration problems (or completions, teacher-forced) when a config names no number

# (adapter file, threshold) -> (mean realized ratio, accuracy or None where the text has no answers to check)
Measure = Callable[[Path, float], tuple[float, float | None]]


@dataclass(frozen=True)
class ThresholdFit:
    target_cr: float
    threshold: float
    realized_cr: float  # on the calibration text, at ``threshold``
    accuracy: float | None  # greedy, on the same problems (None: teacher-forced, nothing was solved)
    trials: int  # thresholds tried
    problems: int
    seed: int
    source: str = "greedy"  # greedy: solves of generated chain problems; teacher_forced: the model's own completions


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


@torch.inference_mode()
def measure_teacher_forced(model, adapter: Path, threshold: float, sequences: list[list[int]]) -> float:
    """The mean realized ratio of ``sequences`` (token ids: prompt and completion), each read in one pass with the
    adapter at ``threshold``, as a thread that generated it would have realized at its end."""
    handle = load_adapter(model, adapter, threshold=threshold)
    ratios = []
    try:
        for ids in sequences:  # one at a time: no padding, every sequence at its own length
            cache = handle.new_cache()
            model(input_ids=torch.tensor([ids], device=model.device), past_key_values=cache, use_cache=True)
            ratios.append(float(cache.realized_compression()[0]))
    finally:
        handle.detach()
    return sum(ratios) / len(ratios)


def greedy_solves(model, tokenizer, problems: list[dict]) -> Measure:
    return lambda adapter, threshold: measure(model, tokenizer, adapter, threshold, problems)


def teacher_forced(model, sequences: list[list[int]]) -> Measure:
    return lambda adapter, threshold: (measure_teacher_forced(model, adapter, threshold, sequences), None)


def fit_threshold(adapter: Path, measure_at: Measure, problems: int, seed: int, tolerance: float = 0.03,
                  max_trials: int = 10, step: float = 4.0, progress: bool = True,
                  source: str = "greedy") -> ThresholdFit:
    """The threshold, among at most ``max_trials`` tried, whose realized ratio is nearest the adapter's target:
    it brackets the target by doubling steps from the adapter's current threshold, then bisects."""
    metadata = read_adapter_metadata(adapter)
    target = float(metadata["target_cr"])
    tried: dict[float, tuple[float, float | None]] = {}
    bar = tqdm(total=max_trials, desc=f"threshold {target:g}x", disable=not progress)

    def ratio_at(threshold: float) -> float:
        if threshold not in tried:
            tried[threshold] = measure_at(adapter, threshold)
            bar.update(1)
            bar.set_postfix(threshold=f"{threshold:.2f}", realized_cr=f"{tried[threshold][0]:.2f}")
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
    return ThresholdFit(target, best, tried[best][0], tried[best][1], len(tried), problems, seed, source)


def fit_thresholds(model_dir: str | Path, adapter_dir: str | Path, ratios: list[float], k_min: int, k_max: int,
                   problems: int = DEFAULT_PROBLEMS, seed: int = 9001, progress: bool = True) -> list[ThresholdFit]:
    """Fit and write the threshold of each adapter ``adapter_dir/dms-<r>x`` of the model at ``model_dir``, on greedy
    solves of ``problems`` generated chain problems of difficulty ``k_min..k_max``."""
    model, tokenizer = load_model(model_dir)
    measure_at = greedy_solves(model, tokenizer, generate_suite(problems, k_min, k_max, seed=seed))
    return _fit_and_write(adapter_dir, ratios, measure_at, problems, seed, "greedy", {"k": [k_min, k_max]}, progress)


def fit_thresholds_on_text(model_dir: str | Path, adapter_dir: str | Path, ratios: list[float],
                           sequences: list[list[int]], seed: int = 0, progress: bool = True) -> list[ThresholdFit]:
    """Fit and write each adapter's threshold teacher-forced on ``sequences``, text the model produced (the task-agnostic
    fit: a retrofit's cached completions of the user's prompts)."""
    if not sequences:
        raise ValueError("sequences: a teacher-forced threshold fit needs at least one sequence")
    model, _ = load_model(model_dir)
    measure_at = teacher_forced(model, sequences)
    return _fit_and_write(adapter_dir, ratios, measure_at, len(sequences), seed, "teacher_forced",
                          {"tokens": sum(map(len, sequences))}, progress)


def _fit_and_write(adapter_dir: str | Path, ratios: list[float], measure_at: Measure, problems: int, seed: int,
                   source: str, extra: dict, progress: bool) -> list[ThresholdFit]:
    fits = []
    for ratio in ratios:
        path = adapter_path(adapter_dir, ratio)
        fit = fit_threshold(path, measure_at, problems, seed, progress=progress, source=source)
        set_threshold(path, fit.threshold, extra={"threshold_fit": asdict(fit) | extra})
        fits.append(fit)
    return fits


def describe(fits: list[ThresholdFit]) -> str:
    return "\n".join(json.dumps(asdict(fit)) for fit in fits)
