"""The accuracy gain of one method over another on the same problems, per draw and pooled, with its uncertainty.

    .venv/bin/python research/paired_gain.py "fresh 200=runs/dms.jsonl,runs/vanilla.jsonl" "140=..." \
        --names "8x-long" "vanilla" --plot gain.png

Each DRAW=A,B pairs two ``eval --output`` files of the same problems (matched by id). Every vote is re-scored
from the kept threads with the eval's rule (ties to the more confident answer), so files written before that
rule compare alike. The comparison is paired: per problem, A right and B wrong, or the other way round; the
95% interval is a paired bootstrap over problems (seeded), pooled over all draws.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from policies.statistics import quantile
from policies.extraction import answers_match
from vote_curve import kept_threads, read_records, vote  # this folder's script: the eval's vote over kept threads


def correctness(path: Path) -> dict[str, bool]:
    """Problem id -> whether the re-scored vote of its kept threads is right."""
    return {r["id"]: answers_match(vote(kept_threads(r)).answer, r["expected"]) for r in read_records(path)}


def paired(a: dict[str, bool], b: dict[str, bool]) -> list[tuple[bool, bool]]:
    if a.keys() != b.keys():
        raise ValueError(f"the two files hold different problems ({len(a.keys() ^ b.keys())} ids differ)")
    return [(a[i], b[i]) for i in sorted(a)]


def summary(pairs: list[tuple[bool, bool]], resamples: int, rng: random.Random) -> dict:
    n = len(pairs)
    diffs = [int(x) - int(y) for x, y in pairs]
    boot = [sum(rng.choice(diffs) for _ in range(n)) / n for _ in range(resamples)]
    return {"n": n, "a": round(sum(x for x, _ in pairs) / n, 4), "b": round(sum(y for _, y in pairs) / n, 4),
            "gain": round(sum(diffs) / n, 4), "only_a_right": diffs.count(1), "only_b_right": diffs.count(-1),
            "gain_95": [round(quantile(boot, 0.025), 4), round(quantile(boot, 0.975), 4)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("draws", nargs="+", help="LABEL=A.jsonl,B.jsonl: eval --output files of the same problems")
    parser.add_argument("--names", nargs=2, default=["A", "B"], help="what A and B are")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, help="draw the accuracies per draw (PNG)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    report, pooled = {"a": args.names[0], "b": args.names[1], "draws": []}, []
    for spec in args.draws:
        label, sep, files = spec.partition("=")
        a_path, comma, b_path = files.partition(",")
        if not sep or not comma:
            parser.error(f"draw {spec!r}: expected LABEL=A.jsonl,B.jsonl")
        try:
            pairs = paired(correctness(Path(a_path)), correctness(Path(b_path)))
        except (OSError, ValueError) as error:
            parser.error(f"draw {label!r}: {error}")
        pooled += pairs
        report["draws"].append({"label": label, "a_file": a_path, "b_file": b_path, **summary(pairs, args.resamples, rng)})
    report["pooled"] = summary(pooled, args.resamples, rng)
    if args.plot:
        from evaluation.plots import plot_paired_gain

        plot_paired_gain(report, args.plot)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
