"""Forecast a model's greedy, one-thread and vote@N accuracy from two teacher-forced passes per problem.

    .venv/bin/python scripts/vote_forecast.py --problems runs/dev100_of_140.jsonl
    .venv/bin/python scripts/vote_forecast.py --problems FILE --model runs/candidate --temperatures 0.8,1.0
    .venv/bin/python scripts/vote_forecast.py --problems FILE --unshared operator   # what shared operator mistakes cost

A vote of 16 threads on 100 hard problems takes half an hour here; this takes a minute or two and has landed
within about a point of the measured vote (``docs/foundation.md``). The model of a thread behind it, each part
measured on the shipped model:

- a thread leaves the valid paths at a work line's header copied from the prompt (25 of 26 greedy failures
  do, ``scripts/error_anatomy.py``);
- a header's chance of being copied wrong depends on the prompt, the line and the operand order taken there,
  not on the lines written before it (``scripts/header_probe.py --histories``), so one pass along each order
  gives every line's error on every path;
- only a line the query depends on can change the answer (``Problem.needed``);
- a thread with exactly one wrong header lands on that mistake's answer (a wrong ``+`` or ``*`` gives one value
  in either order); two or more wrong headers give an answer no other thread shares.

The vote is then drawn: N threads from that answer distribution; the right answer wins if it holds more
threads than any single wrong one (half a win on a tie). Greedy follows each header's most likely tokens.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import string
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from header_probe import HeaderRead, read_headers  # noqa: E402

from dms_runtime.loading import default_model_path, load_model  # noqa: E402
from tasks.chain_tokenizer import writes_reversed_minus_lines  # noqa: E402
from evaluation.plots import plot_vote_forecast  # noqa: E402
from tasks.chain import Problem, parse_problem  # noqa: E402
from tasks.cot import REVERSED_MINUS  # noqa: E402
from tasks.jsonl import read_jsonl  # noqa: E402

ALTERNATIVES = 4  # wrong tokens kept per prediction; rarer ones count as mistakes no other thread shares


@dataclasses.dataclass
class LineOdds:
    """One needed work line at one temperature: the chance a thread copies its header right, the chance of each
    shareable mistake, and whether greedy copies it right."""

    right: float
    mistakes: dict[tuple, float]
    greedy_right: bool


def line_odds(reads: dict[bool, HeaderRead], letters: list[int], subtract: dict[int, bool], temperature: float
              ) -> LineOdds:
    """``reads``: the line read along the canonical path (False) and, if it has one, the other order (True).
    ``subtract``: the subtraction tokens, each with whether it takes the right operand from the left (``~``)."""
    canonical = reads[False]
    first = torch.softmax(canonical.first[letters] / temperature, dim=-1)
    orders = [False, True] if canonical.two_orders else [False]
    valid = {string.ascii_lowercase[letters.index(reads[other].want[0])]: other for other in orders}
    mistakes: dict[tuple, float] = {}
    for index, char in enumerate(string.ascii_lowercase):
        if char not in valid:
            mistakes[("first", char)] = float(first[index])
    greedy_first = string.ascii_lowercase[int(first.argmax())]
    greedy_right, right = greedy_first in valid, 0.0
    for char, other in valid.items():
        read = reads[other]
        p_first = float(first[string.ascii_lowercase.index(char)])
        operator = torch.softmax(read.operator / temperature, dim=-1)
        second = torch.softmax(read.second / temperature, dim=-1)
        _, want_operator, want_second = read.want
        for token in operator.topk(ALTERNATIVES).indices.tolist():
            if token != want_operator:
                # a wrong + or * gives one value in either order; a wrong subtraction's value depends on its side
                key = ("operator", "-", other != subtract[token]) if token in subtract else ("operator", token)
                mistakes[key] = mistakes.get(key, 0.0) + p_first * float(operator[token])
        for token in second.topk(ALTERNATIVES).indices.tolist():
            if token != want_second:
                key = (other, "second", token)
                mistakes[key] = mistakes.get(key, 0.0) + p_first * float(operator[want_operator] * second[token])
        right += p_first * float(operator[want_operator] * second[want_second])
        if char == greedy_first:
            greedy_right = int(operator.argmax()) == want_operator and int(second.argmax()) == want_second
    return LineOdds(right, mistakes, greedy_right)


def answer_odds(lines: list[LineOdds], unshared: str = "none") -> tuple[float, list[float]]:
    """The chance a thread is right, and the chance of each shareable wrong answer (exactly one mistake).
    ``unshared`` ("operator", "operands" or "all") counts that kind of mistake as shared by no other thread: a
    what-if that shows how much of the vote each kind of shared mistake costs."""
    right = 1.0
    for line in lines:
        right *= line.right
    wrong = [right * p / max(line.right, 1e-12) for line in lines for key, p in line.mistakes.items()
             if unshared not in ("all", "operator" if "operator" in key else "operands")]
    return right, wrong


def vote_wins(right: float, wrong: list[float], samples: int, draws: int, rng: random.Random) -> float:
    """The chance the right answer wins a plurality vote of ``samples`` threads (Monte Carlo over ``draws``)."""
    spread = max(0.0, 1.0 - right - sum(wrong))  # answers no other thread shares
    weights = [right, spread, *wrong]
    wins = 0.0
    for _ in range(draws):
        counts = [0] * len(weights)
        for drawn in rng.choices(range(len(weights)), weights, k=samples):
            counts[drawn] += 1
        best_wrong = max(counts[2:], default=0)
        wins += 1.0 if counts[0] > best_wrong else 0.5 if counts[0] == best_wrong and counts[0] else 0.0
    return wins / draws


def needed_reads(model, tokenizer, problem: Problem) -> list[dict[bool, HeaderRead]]:
    """Each needed work line read along the canonical path (False) and the other operand order (True)."""
    canonical, other = (read_headers(model, tokenizer, problem, path) for path in ("canonical", "other_order"))
    return [{False: c, True: o} for c, o in zip(canonical, other) if c.var in problem.needed]


def forecast(model, tokenizer, problems: list[Problem], temperatures: list[float], samples: int = 16,
             draws: int = 400, seed: int = 0, unshared: str = "none") -> dict:
    letters = tokenizer.convert_tokens_to_ids(list(string.ascii_lowercase))
    subtract = {tokenizer.convert_tokens_to_ids("-"): False}
    if writes_reversed_minus_lines(tokenizer):
        subtract[tokenizer.convert_tokens_to_ids(REVERSED_MINUS)] = True
    rng = random.Random(seed)
    greedy, thread, vote = 0, dict.fromkeys(temperatures, 0.0), dict.fromkeys(temperatures, 0.0)
    for problem in problems:
        lines = needed_reads(model, tokenizer, problem)
        for temperature in temperatures:
            odds = [line_odds(line, letters, subtract, temperature) for line in lines]
            right, wrong = answer_odds(odds, unshared)
            thread[temperature] += right
            vote[temperature] += vote_wins(right, wrong, samples, draws, rng)
            if temperature == temperatures[0]:
                greedy += all(line.greedy_right for line in odds)
    n = len(problems)
    return {"problems": n, "samples": samples, "unshared": unshared, "greedy": round(greedy / n, 4),
            "by_temperature": {str(t): {"one_thread": round(thread[t] / n, 4), f"vote@{samples}": round(vote[t] / n, 4)}
                               for t in temperatures}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", required=True, type=Path)
    parser.add_argument("--model", default=str(default_model_path()))
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--temperatures", default="0.5,0.8,1.0")
    parser.add_argument("--draws", type=int, default=400, help="Monte Carlo votes per problem and temperature")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unshared", choices=("none", "operator", "operands", "all"), default="none",
                        help="what-if: count this kind of mistake as an answer no other thread shares")
    parser.add_argument("--plot", type=Path, help="draw the forecast by temperature (PNG)")
    parser.add_argument("--measured", nargs="*", default=[], metavar="T=ACCURACY",
                        help="measured vote accuracies to draw beside the forecast, e.g. 1.0=0.72")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    problems = [parse_problem(p["prompt"]) for p in read_jsonl(args.problems)[: args.limit or None]]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    report = forecast(model, tokenizer, problems, temperatures, args.samples, args.draws, args.seed, args.unshared)
    if args.plot:
        measured = {float(t): float(a) for t, a in (item.split("=") for item in args.measured)}
        plot_vote_forecast(report, args.plot, measured, title=f"{Path(args.model).name} on {args.problems.name}")
    print(json.dumps({"model": args.model, **report}, indent=1))


if __name__ == "__main__":
    main()
