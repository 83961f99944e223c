"""``thinkpool calibrate``: measure the planner's profile on the workers, for one (model, task family).

Every problem gets one greedy thread at each ratio and, at each temperature, ``threads`` sampled threads at each
ratio. Problems are binned on the profile's difficulty signal (``policies/planner.py``): ``k`` (the chain task's,
read off the prompt) into the given bins, or ``greedy_confidence`` (any task: the lowest token log-probability of
the greedy thread at ``signal_cr``) into quantile bins of equal size. Per bin and ratio, vote accuracy for
n = 1, 2, 4, ... sampled threads is estimated from those threads by averaging the majority vote (ties to the more
confident answer, as the live vote breaks them; equal answers by the family's key) over random n-subsets (so one
run gives every n), with the mean tokens per thread; the greedy thread gives the bin's ``greedy`` entry. The same
seeds serve every temperature, so their votes differ by the temperature and not by the draw.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from policies.planner import CalibrationProfile, ProfileEntry
from policies.voting import majority_vote
from tasks.families import TaskFamily
from tasks.jsonl import problem_seed, row_family
from workers.thread import SamplingParams
from workers.worker import ProblemRequest

VOTE_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)


def vote_accuracy(answers: list[str | None], confidences: list[float], expected: str, n: int, rng: random.Random,
                  family: TaskFamily, draws: int = 64) -> float:
    """Expected correctness of a majority vote over n threads drawn from ``answers`` (with their mean log-probs)."""
    def correct(picked) -> bool:
        vote = majority_vote([answers[i] for i in picked], [confidences[i] for i in picked], key=family.key)
        return family.same(vote.answer, expected)

    if n >= len(answers):
        return float(correct(range(len(answers))))
    return sum(correct(rng.sample(range(len(answers)), n)) for _ in range(draws)) / draws


@dataclass
class Measured:
    """One problem's threads: the greedy one and the sampled ones per temperature, at each ratio."""

    problem: dict
    family: TaskFamily
    greedy: dict  # cr -> ThreadResult
    sampled: dict  # (cr, temperature) -> list[ThreadResult]


async def measure(pool, tokenizer, problems: list[dict], default_task: str, ratios: list[float], threads: int,
                  max_new_tokens: int, temperatures: list[float], seed: int, top_p: float = 1.0,
                  progress=print) -> list[Measured]:
    """Every problem's greedy and sampled threads at every ratio (a problem's threads are seeded from its id)."""
    async def one(problem: dict) -> Measured:
        family = row_family(problem, default_task)
        ids = tuple(family.encode(problem["prompt"], tokenizer))
        pattern = getattr(family, "answer_pattern", None) or None

        def request(name: str, cr: float, samples: tuple[int, ...], params: SamplingParams) -> ProblemRequest:
            return ProblemRequest(f"calibrate-{problem['id']}-{cr:g}-{name}", ids, samples, params, cr,
                                  task_family=family.name, answer_pattern=pattern, stop_strings=tuple(family.stop_strings))

        thread_seed = problem_seed(seed, problem["id"])
        greedy = {cr: request("greedy", cr, (0,), SamplingParams(0.0, 1.0, max_new_tokens, thread_seed))
                  for cr in ratios}
        sampled = {(cr, t): request(f"t{t:g}", cr, tuple(range(threads)),
                                    SamplingParams(t, top_p, max_new_tokens, thread_seed))
                   for cr in ratios for t in temperatures}
        done = await asyncio.gather(*(pool.collect(r) for r in [*greedy.values(), *sampled.values()]))
        measured = Measured(problem, family, {cr: group[0] for cr, group in zip(greedy, done)},
                            dict(zip(sampled, done[len(greedy):])))
        progress(f"{problem['id']}: greedy " + " ".join(f"{cr:g}x={t.answer}" for cr, t in measured.greedy.items())
                 + f" (expected {problem['answer']})")
        return measured

    return list(await asyncio.gather(*(one(p) for p in problems)))


def quantile_bins(values: list[float], count: int) -> list[tuple[float, float]]:
    """``count`` contiguous bins holding about equal numbers of ``values`` (edges halfway between neighbours)."""
    ordered = sorted(values)
    count = max(1, min(count, len(ordered)))
    cuts = [(ordered[len(ordered) * i // count - 1] + ordered[len(ordered) * i // count]) / 2 for i in range(1, count)]
    edges = [ordered[0], *cuts, ordered[-1]]
    return [(edges[i], edges[i + 1]) for i in range(count)]


def build_profile(measured: list[Measured], signal: str, bins: list[tuple[float, float]] | int, ratios: list[float],
                  temperatures: list[float], max_new_tokens: int, model: str, task: str, window: int, seed: int,
                  top_p: float = 1.0, signal_cr: float = 1.0) -> CalibrationProfile:
    """The profile of ``measured`` problems: ``bins`` are k ranges for the ``k`` signal, or a number of quantile
    bins for ``greedy_confidence`` (read from each problem's greedy thread at ``signal_cr``)."""
    if signal == "k":
        values = [float(m.problem["k"]) for m in measured]
    else:
        values = [max(m.greedy[signal_cr].min_logprob, -1e9) for m in measured]
    ranges = quantile_bins(values, bins) if isinstance(bins, int) else [(float(a), float(b)) for a, b in bins]
    rng = random.Random(seed)
    entries: list[ProfileEntry] = []
    assigned = [bin_index(v, ranges) for v in values]
    for index, (low, high) in enumerate(ranges):
        members = [m for m, b in zip(measured, assigned) if b == index]
        if not members:
            continue
        for cr in ratios:
            greedy = [m.greedy[cr] for m in members]
            entries.append(ProfileEntry(
                low=low, high=high, cr=cr, threads=1, greedy=True,
                accuracy=sum(m.family.same(t.answer, m.problem["answer"]) for m, t in zip(members, greedy)) / len(members),
                tokens_per_thread=max(1.0, sum(t.tokens for t in greedy) / len(greedy))))
            for temperature in temperatures:
                groups = [m.sampled[(cr, temperature)] for m in members]
                tokens = [t.tokens for group in groups for t in group]
                for n in (n for n in VOTE_COUNTS if n <= len(groups[0])):
                    accuracy = sum(vote_accuracy([t.answer for t in group], [t.mean_logprob for t in group],
                                                 m.problem["answer"], n, rng, m.family) for m, group in zip(members, groups))
                    entries.append(ProfileEntry(low=low, high=high, cr=cr, threads=n, accuracy=accuracy / len(members),
                                                tokens_per_thread=max(1.0, sum(tokens) / len(tokens)),
                                                temperature=temperature))
    per_bin = len(measured) // max(1, len(ranges))
    return CalibrationProfile(model=model, task=task, signal=signal, signal_cr=signal_cr, max_new_tokens=max_new_tokens,
                              temperature=temperatures[0], top_p=top_p, problems=max(1, per_bin), window=window,
                              entries=entries)


def bin_index(value: float, ranges: list[tuple[float, float]]) -> int:
    """The first of ``ranges`` holding ``value`` (past either end: the nearest), as the planner bins a task."""
    for index, (low, high) in enumerate(ranges):
        if low <= value <= high:
            return index
    return 0 if value < ranges[0][0] else len(ranges) - 1


def describe(profile: CalibrationProfile) -> list[str]:
    """One line per bin and ratio: greedy and vote accuracies (the progress the command prints)."""
    lines = []
    for low, high in profile.bins():
        for cr in sorted({e.cr for e in profile.entries}):
            found = [e for e in profile.entries if (e.low, e.high) == (low, high) and e.cr == cr]
            lines.append(f"{profile.signal} {low:g}..{high:g} at {cr:g}x: " + ", ".join(
                ("greedy" if e.greedy else f"T{e.temperature:g} vote@{e.threads}") + f" {e.accuracy:.2f}" for e in found))
    return lines
