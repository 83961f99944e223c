"""How reliably a model copies each work line's header from the prompt, on each path, in one forward pass.

    .venv/bin/python scripts/header_probe.py --problems runs/dev100_of_140.jsonl --limit 40
    .venv/bin/python scripts/header_probe.py --problems runs/dev100_of_140.jsonl --model runs/candidate

The header copy (``r=h*p``, read off the prompt's ``r=h*p``) is where the shipped model's hard-problem threads
first go wrong (``scripts/error_anatomy.py``). This probe teacher-forces the reference chain of thought along
one path (every line in its canonical form, or every line of two operand orders in the other one) and reads
the model's probability of copying each header right: its first character among the valid ones (given that
it is a variable), then the operator and the second operand. ``mean_error`` is the chance that a thread
sampled at temperature 1 copies a header wrong, averaged over lines. It screens a candidate chain-of-thought
format in a minute, where a vote of 16 threads on 100 problems takes half an hour (``scripts/vote_forecast.py``
turns these reads into a forecast of the vote itself). ``canonical_error_by_line`` shows the error growing with
the line's place in the chain of thought; ``--histories N`` measures how little it depends on the lines before
it, the assumption the forecast rests on. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import string
from pathlib import Path

import torch

from dms_runtime.loading import default_model_path, load_model
from tasks.chain import Problem, parse_problem
from tasks.cot import line_forms, writes_reversed_minus
from tasks.jsonl import read_jsonl
from tasks.prompt import format_prompt

PATHS = ("canonical", "other_order")


@dataclasses.dataclass
class HeaderRead:
    """What a model predicts for one work line's header, teacher-forced along one path: log-probabilities for
    its first character, for the operator (given this path's first character) and for the second operand
    (given the operator), with the token ids this path writes there."""

    line: int  # index in ``line_forms(problem)``
    var: str  # the variable the line computes
    valid_first: frozenset[str]  # every valid first character (both operand orders)
    two_orders: bool
    other_order: bool  # whether the pass wrote this line in its other operand order
    first: torch.Tensor
    operator: torch.Tensor
    second: torch.Tensor
    want: tuple[int, int, int]


def read_headers(model, tokenizer, problem: Problem, path: str, order_rng: random.Random | None = None
                 ) -> list[HeaderRead]:
    """Every work line's header as the model reads it in one teacher-forced pass along ``path``: every line in
    its canonical form, or every line that has a second operand order in that one; with ``order_rng``, each
    such line in either order at random (a random history)."""
    prompt, lines, starts = format_prompt(problem.text), [], []
    for index, forms in enumerate(line_forms(problem, writes_reversed_minus(model))):
        other = len(forms) > 1 and (order_rng.random() < 0.5 if order_rng else path == "other_order")
        line = forms[1] if other else forms[0]
        if "|" in line:
            start = len(prompt) + sum(len(done) + 1 for done in lines) + 2  # the header's first char after "r="
            starts.append((index, start, forms, other))
        lines.append(line)
    text = prompt + "\n".join(lines)
    ids = tokenizer(text)["input_ids"]
    offset = len(ids) - len(text)  # a <bos> in front
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    reads = []
    for index, start, forms, other in starts:
        at = start + offset  # the token id index of the header's first char
        reads.append(HeaderRead(index, forms[0][0], frozenset(form[2] for form in forms), len(forms) > 1, other,
                                logp[at - 1], logp[at], logp[at + 1], tuple(ids[at:at + 3])))
    return reads


def copy_probability(read: HeaderRead, tokenizer) -> float:
    """The chance that a thread sampled at temperature 1 copies this header right: its first character among
    the valid ones (given that it is a variable), then this path's operator and second operand."""
    letters = tokenizer.convert_tokens_to_ids(list(string.ascii_lowercase))
    valid_ids = tokenizer.convert_tokens_to_ids(sorted(read.valid_first))
    right = torch.logsumexp(read.first[valid_ids], 0) - torch.logsumexp(read.first[letters], 0)
    return float((right + read.operator[read.want[1]] + read.second[read.want[2]]).exp())


def header_copy_probabilities(model, tokenizer, problem: Problem, path: str) -> list[float]:
    """Per work line on ``path``, the teacher-forced probability of copying its header right (``other_order``:
    only the lines that have a second operand order)."""
    return [copy_probability(read, tokenizer) for read in read_headers(model, tokenizer, problem, path)
            if path == "canonical" or read.two_orders]


def summary(probabilities: list[float]) -> dict:
    errors = torch.tensor([1 - p for p in probabilities])
    return {"lines": len(probabilities), "mean_error": round(float(errors.mean()), 4),
            "lines_error_above_0.5": round(float((errors > 0.5).float().mean()), 4),
            "lines_error_above_0.1": round(float((errors > 0.1).float().mean()), 4)}


def by_position(model, tokenizer, problems: list[Problem], per: int = 4) -> dict[str, float]:
    """Canonical-path mean error by the work line's place in the chain of thought (groups of ``per`` lines)."""
    groups: dict[int, list[float]] = {}
    for problem in problems:
        for place, p in enumerate(header_copy_probabilities(model, tokenizer, problem, "canonical")):
            groups.setdefault(place // per, []).append(1 - p)
    return {f"{g * per + 1}-{g * per + per}": round(statistics.mean(e), 4) for g, e in sorted(groups.items())}


def history_spread(model, tokenizer, problems: list[Problem], histories: int, seed: int = 0) -> dict:
    """How much a header's error depends on the lines before it: each problem teacher-forced along
    ``histories`` random mixes of operand orders; the spread of each (line, order) error across them."""
    errors: dict[tuple[int, int, bool], list[float]] = {}
    for number, problem in enumerate(problems):
        for h in range(histories):
            rng = random.Random(seed * 1_000_003 + number * 1000 + h)
            for read in read_headers(model, tokenizer, problem, "canonical", order_rng=rng):
                errors.setdefault((number, read.line, read.other_order), []).append(1 - copy_probability(read, tokenizer))
    seen = [e for e in errors.values() if len(e) >= 3]
    hard = [e for e in seen if statistics.mean(e) > 0.2]
    return {"histories": histories, "lines": len(seen),
            "mean_std": round(statistics.mean(statistics.pstdev(e) for e in seen), 4),
            "lines_error_above_0.2": len(hard),
            "mean_std_error_above_0.2": round(statistics.mean(statistics.pstdev(e) for e in hard), 4) if hard else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", required=True, type=Path)
    parser.add_argument("--model", default=str(default_model_path()))
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--histories", type=int, default=0,
                        help="also teacher-force this many random operand-order histories per problem (about "
                             "this many times slower) and report how much a header's error varies across them")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    problems = [parse_problem(p["prompt"]) for p in read_jsonl(args.problems)[: args.limit or None]]
    report: dict = {"model": args.model, "problems": len(problems)}
    for path in PATHS:
        lines = [p for problem in problems for p in header_copy_probabilities(model, tokenizer, problem, path)]
        report[path] = summary(lines)
    report["canonical_error_by_line"] = by_position(model, tokenizer, problems)
    if args.histories:
        report["history"] = history_spread(model, tokenizer, problems, args.histories)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
