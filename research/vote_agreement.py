"""How a run's votes fail, from kept threads (``thinkpool eval --output``): whether the right answer is among the
threads, how often threads are mostly wrong, and how often one wrong answer holds most of them (correlated errors,
which more threads cannot vote away).

    .venv/bin/python research/vote_agreement.py "8x=runs/equal_memory/hard300_4201_cr8_T0.5.jsonl" "vanilla=..."
"""

from __future__ import annotations

import json
import sys


def agreement(path: str) -> dict:
    rows = [json.loads(line) for line in open(path)]
    wrong = [r for r in rows if not r["correct"]]
    majority_wrong = sum(max([c for a, c in r["votes"].items() if a != r["expected"]] or [0]) > r["samples"] / 2
                         for r in wrong)
    return {"file": path, "problems": len(rows),
            "some_thread_right": sum(r["expected"] in r["votes"] for r in rows),
            "threads_right_under_20pct": sum(r["thread_accuracy"] < 0.2 for r in rows),
            "wrong_votes": len(wrong), "won_by_one_wrong_answer_over_half": majority_wrong}


if __name__ == "__main__":
    print(json.dumps({label: agreement(path) for label, path in (a.split("=", 1) for a in sys.argv[1:])}, indent=1))
