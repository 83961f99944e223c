"""Majority-vote accuracy against the number of threads, from the threads ``eval --output`` keeps.

    thinkpool eval --problems hard.jsonl --samples fit --kv-budget 13.5MB --workers 0 --output runs/threads.jsonl
    .venv/bin/python research/vote_curve.py "DMS 8x=runs/threads.jsonl" "vanilla=runs/vanilla.jsonl" --plot curve.png

For each n up to the threads a problem kept, the vote of n of them drawn at random (``--draws`` draws per
problem, seeded): what a smaller budget would have voted with the same model. It shows where a run sits on
its own curve: how much a vote of more threads would still add, and what a thread's accuracy costs.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from evaluation.plots import plot_vote_curves
from policies.extraction import answers_match
from policies.voting import majority_vote
from tasks.jsonl import read_jsonl


def vote_curve(records: list[dict], draws: int, seed: int) -> dict[int, float]:
    """Mean accuracy of a majority vote over ``n`` random threads of each problem, for n = 1 .. the fewest kept."""
    rng = random.Random(seed)
    threads = [kept_threads(r) for r in records]
    curve = {}
    for n in range(1, min(map(len, threads)) + 1):
        right = sum(answers_match(vote(rng.sample(kept, n)).answer, record["expected"])
                    for kept, record in zip(threads, records) for _ in range(draws))
        curve[n] = round(right / (draws * len(records)), 4)
    return curve


def kept_threads(record: dict) -> list[tuple[str | None, float]]:
    """A record's kept threads as (answer, mean log-probability) pairs, what :func:`vote` takes."""
    return [(t["answer"], t.get("mean_logprob", 0.0)) for t in record["threads"]]


def vote(threads: list[tuple[str | None, float]]):
    """The eval's majority vote (ties to the more confident answer) over (answer, mean log-probability) pairs."""
    return majority_vote([answer for answer, _ in threads], [confidence for _, confidence in threads])


def read_records(path: Path) -> list[dict]:
    """An ``eval --output`` file's records; ValueError when one keeps no threads."""
    records = read_jsonl(path)
    if not records or not all(r.get("threads") for r in records):
        raise ValueError(f"{path}: every record must keep its threads (rerun thinkpool eval with --output)")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=FILE: an eval --output JSONL and its label")
    parser.add_argument("--draws", type=int, default=200, help="random subsets per problem and thread count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, help="draw the curves (PNG)")
    args = parser.parse_args()
    report = {"draws": args.draws, "seed": args.seed, "runs": []}
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            parser.error(f"run {spec!r}: expected LABEL=FILE")
        try:
            records = read_records(Path(path))
        except (OSError, ValueError) as error:
            parser.error(str(error))
        report["runs"].append({"label": label, "file": path, "n": len(records),
                               "threads": sum(len(r["threads"]) for r in records) / len(records),
                               "accuracy": sum(r["correct"] for r in records) / len(records),
                               "curve": vote_curve(records, args.draws, args.seed)})
    if args.plot:
        plot_vote_curves(report["runs"], args.plot)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
