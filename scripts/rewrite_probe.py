"""Are a problem's failures set by its text or by its structure? Equivalent rewrites of each problem, greedy on each.

    .venv/bin/python scripts/rewrite_probe.py write --problems runs/dev100_of_140.jsonl --rewrites 8 --output rw.jsonl
    thinkpool eval --problems rw.jsonl --batch-size 160 --workers 0 --json --output rw_greedy.jsonl
    .venv/bin/python scripts/rewrite_probe.py score rw_greedy.jsonl

A rewrite swaps the operands of some ``+`` and ``*`` statements at random (``c=a+b`` -> ``c=b+a``): the same
problem with the same answer, drawn from the same distribution the generator draws from, but a different text
to copy headers from (other lookalike statements, other operand orders). Rewrite 0 is the original. If greedy's
failures were accidents of the text, the rewrites of a failed problem would mostly be right and a vote over them
would beat greedy by far; if the problem's structure sets them, the rewrites fail alike. Prints one JSON object:
accuracy per rewrite, how many problems each count of right rewrites has, and a vote over the first n rewrites'
threads. With ``--samples N --temperature T`` on the eval, each rewrite's N sampled threads join the vote.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
from dataclasses import replace
from pathlib import Path

from policies.extraction import answers_match
from tasks.chain import Problem, parse_problem
from tasks.jsonl import read_jsonl, write_jsonl
from vote_curve import kept_threads, read_records, vote  # this folder's script: the eval's vote over kept threads


def commuted(problem: Problem, rng: random.Random) -> Problem:
    """The same problem with each ``+`` and ``*`` statement's operands swapped with probability 1/2."""
    return Problem(tuple(
        replace(a, y=a.z, z=a.y) if not a.is_input and a.op in "+*" and rng.random() < 0.5 else a
        for a in problem.assignments
    ))


def write(problems: Path, rewrites: int, output: Path, seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    for row in read_jsonl(problems):
        problem = parse_problem(row["prompt"])
        for index in range(rewrites):
            text = problem if index == 0 else commuted(problem, rng)
            rows.append({"id": f"{row['id']}~{index}", "prompt": text.text, "answer": text.answer, "k": problem.k})
    write_jsonl(output, rows)


def score(threads: Path) -> dict:
    """``threads``: an ``eval --output`` file of rewrites (greedy: one thread a rewrite; or N sampled threads each).
    A rewrite counts as right when its own vote is; the vote over the first n rewrites pools their threads."""
    by_problem: dict[str, dict[int, dict]] = collections.defaultdict(dict)
    for record in read_records(threads):
        problem_id, index = record["id"].rsplit("~", 1)
        by_problem[problem_id][int(index)] = record
    rewrites = min(len(group) for group in by_problem.values())
    n = len(by_problem)
    right_counts = collections.Counter(sum(g[i]["correct"] for i in range(rewrites)) for g in by_problem.values())
    failed = [g for g in by_problem.values() if not g[0]["correct"]]
    votes = {}
    for size in range(1, rewrites + 1):
        wins = 0
        for group in by_problem.values():
            pooled = [thread for i in range(size) for thread in kept_threads(group[i])]
            wins += answers_match(vote(pooled).answer, group[0]["expected"])
        votes[str(size)] = round(wins / n, 4)
    return {
        "problems": n,
        "rewrites": rewrites,
        "threads_per_rewrite": len(next(iter(by_problem.values()))[0]["threads"]),
        "accuracy_by_rewrite": [round(sum(g[i]["correct"] for g in by_problem.values()) / n, 4) for i in range(rewrites)],
        "thread_accuracy": round(sum(g[i]["thread_accuracy"] for g in by_problem.values() for i in range(rewrites))
                                 / (n * rewrites), 4),
        "problems_by_right_rewrites": {str(c): right_counts[c] for c in range(rewrites + 1)},
        "original_failures": len(failed),
        "rewrites_right_where_original_fails": round(
            sum(g[i]["correct"] for g in failed for i in range(1, rewrites)) / max(1, len(failed) * (rewrites - 1)), 4),
        "vote_over_first_n_rewrites": votes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("write", help="write each problem's rewrites (rewrite 0: the original)")
    make.add_argument("--problems", required=True, type=Path)
    make.add_argument("--rewrites", type=int, default=8)
    make.add_argument("--output", required=True, type=Path)
    make.add_argument("--seed", type=int, default=7)
    scorer = commands.add_parser("score", help="score the kept threads (greedy or sampled) of the rewrites")
    scorer.add_argument("threads", type=Path)
    args = parser.parse_args()
    if args.command == "write":
        write(args.problems, args.rewrites, args.output, args.seed)
    else:
        print(json.dumps(score(args.threads), indent=1))


if __name__ == "__main__":
    main()
