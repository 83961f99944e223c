"""``thinkpool calibrate``: measure the planner's profile on the workers.

For every difficulty bin and ratio, one greedy thread and, at each temperature, ``threads`` sampled threads
run on each of ``problems`` fresh problems. Vote accuracy for n = 1, 2, 4, ... sampled threads is estimated
from those threads by averaging the majority vote (ties to the more confident answer, as the live vote breaks
them) over random n-subsets (so one run gives every n), along with the mean tokens per thread; the greedy
thread gives the profile's ``greedy`` entry. The same seeds serve every temperature, so their votes differ
by the temperature and not by the draw.
"""

from __future__ import annotations

import asyncio
import random

from policies.extraction import answers_match
from policies.planner import CalibrationProfile, ProfileEntry
from policies.voting import majority_vote
from tasks.chain import generate_suite
from tasks.prompt import format_prompt
from workers.thread import SamplingParams
from workers.worker import ProblemRequest


def vote_accuracy(answers: list[str | None], confidences: list[float], expected: str, n: int, rng: random.Random,
                  draws: int = 64) -> float:
    """Expected correctness of a majority vote over n threads drawn from ``answers`` (with their mean log-probs)."""
    def correct(picked) -> bool:
        return answers_match(majority_vote([answers[i] for i in picked], [confidences[i] for i in picked]).answer, expected)

    if n >= len(answers):
        return float(correct(range(len(answers))))
    return sum(correct(rng.sample(range(len(answers)), n)) for _ in range(draws)) / draws


async def calibrate(pool, tokenizer, bins: list[tuple[int, int]], ratios: list[float], problems: int, threads: int,
                    max_new_tokens: int, temperatures: list[float], seed: int, model: str, window: int, top_p: float = 1.0,
                    progress=print) -> CalibrationProfile:
    rng = random.Random(seed)
    counts = [n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n <= threads]
    entries: list[ProfileEntry] = []
    for low, high in bins:
        suite = generate_suite(problems, low, high, seed=seed + low)
        prompts = [tuple(tokenizer(format_prompt(p["prompt"]))["input_ids"]) for p in suite]
        for cr in ratios:
            greedy_requests = [
                ProblemRequest(f"calibrate-{low}-{cr:g}-{i}-greedy", prompts[i], (0,),
                               SamplingParams(0.0, 1.0, max_new_tokens, 0), cr)
                for i, p in enumerate(suite)
            ]
            sampled_requests = [
                ProblemRequest(f"calibrate-{low}-{cr:g}-{i}-t{temperature:g}", prompts[i], tuple(range(threads)),
                               SamplingParams(temperature, top_p, max_new_tokens, seed * 7919 + i), cr)
                for temperature in temperatures for i, p in enumerate(suite)
            ]
            everything = await asyncio.gather(*(pool.collect(r) for r in greedy_requests + sampled_requests))
            greedy = [group[0] for group in everything[: len(suite)]]
            added = [ProfileEntry(k_min=low, k_max=high, cr=cr, threads=1, greedy=True,
                                  accuracy=sum(answers_match(t.answer, p["answer"]) for t, p in zip(greedy, suite)) / len(suite),
                                  tokens_per_thread=max(1.0, sum(t.tokens for t in greedy) / len(greedy)))]
            for index, temperature in enumerate(temperatures):
                results = everything[len(suite) * (index + 1): len(suite) * (index + 2)]
                tokens = [t.tokens for group in results for t in group]
                for n in counts:
                    accuracy = sum(vote_accuracy([t.answer for t in group], [t.mean_logprob for t in group], p["answer"], n, rng)
                                   for p, group in zip(suite, results))
                    added.append(ProfileEntry(k_min=low, k_max=high, cr=cr, threads=n, accuracy=accuracy / len(suite),
                                              tokens_per_thread=sum(tokens) / len(tokens), temperature=temperature))
            entries += added
            progress(f"k {low}-{high} at {cr:g}x: " + ", ".join(
                ("greedy" if e.greedy else f"T{e.temperature:g} vote@{e.threads}") + f" {e.accuracy:.2f}" for e in added))
    return CalibrationProfile(model=model, max_new_tokens=max_new_tokens, temperature=temperatures[0], top_p=top_p,
                              problems=problems, window=window, entries=entries)
