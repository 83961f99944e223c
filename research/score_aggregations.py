"""Score answer aggregations on the same sampled threads: an ``eval --output`` file in, one JSON object out.

    thinkpool eval --problems hard.jsonl --samples 16 --workers 0 --output runs/threads.jsonl
    .venv/bin/python research/score_aggregations.py runs/threads.jsonl

Every rule sees the threads each problem's record keeps (answer, mean and min log-probability), so the
comparison is paired: a difference comes from the rule, not from different samples.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from policies.extraction import answers_match
from policies.voting import confidence_vote, majority_vote, weighted_vote
from tasks.jsonl import read_jsonl

RULES = {
    "majority": lambda t: majority_vote([x["answer"] for x in t], [x["mean_logprob"] for x in t]),
    "majority, ties by first arrival": lambda t: majority_vote([x["answer"] for x in t]),
    "weighted by exp(mean logprob)": lambda t: weighted_vote([x["answer"] for x in t],
                                                             [math.exp(x["mean_logprob"]) for x in t]),
    "confidence (DeepConf, best half)": lambda t: confidence_vote([x["answer"] for x in t], [x["mean_logprob"] for x in t]),
    "confidence by min logprob (best half)": lambda t: confidence_vote([x["answer"] for x in t], [x["min_logprob"] for x in t]),
}


def tied_for_first(counts: dict[str, int]) -> bool:
    top = sorted(counts.values(), reverse=True)
    return len(top) > 1 and top[0] == top[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, help="JSONL written by thinkpool eval --output")
    args = parser.parse_args()
    records = read_jsonl(args.records)
    records = [r for r in records if r.get("threads")]
    if not records:
        raise SystemExit(f"{args.records}: no record keeps its threads (rerun thinkpool eval with --output)")
    report = {"records": str(args.records), "n": len(records), "accuracy": {}}
    for name, rule in RULES.items():
        right = sum(answers_match(rule(r["threads"]).answer, r["expected"]) for r in records)
        report["accuracy"][name] = round(right / len(records), 4)
    report["ties_for_first"] = sum(tied_for_first(majority_vote([x["answer"] for x in r["threads"]]).counts)
                                   for r in records)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
