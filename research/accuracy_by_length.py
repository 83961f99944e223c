"""Where a DMS ratio loses, by thread length: accuracy paired with vanilla in each length band, the ratio the threads
realized there, and the most a thread of that length can realize at all (everything outside the window evicted).

    .venv/bin/python research/accuracy_by_length.py --problems runs/mixed400_3901.jsonl --model checkpoints/chain-qwen3 \
        --vanilla runs/mixed400_vanilla.jsonl --dms runs/mixed400_shipped_bands.jsonl --window 32

Problems are banded by vanilla's greedy thread length, so every method is compared on the same problems. ``ceiling``:
the mean ratio a method named R could realize if no thread went past R, i.e. the mean of min(R, tokens / window):
where it is under R, an R mean over these lengths is only reached by taking long threads past R.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from evaluation.scoring import LENGTH_BANDS
from tasks.jsonl import read_jsonl
from tasks.families import get_family
from transformers import AutoTokenizer


def band_name(tokens: int) -> str:
    low, high = next(b for b in LENGTH_BANDS if b[1] is None or tokens < b[1])
    return f"{low}-{high - 1}" if high else f"{low}+"


def by_length(problems: Path, model: Path, vanilla: Path, dms: Path, window: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model)
    family = get_family("chain")
    prompt_tokens = {p["id"]: len(family.encode(p["prompt"], tokenizer)) for p in read_jsonl(problems)}
    base = {r["id"]: r for r in read_jsonl(vanilla)}
    methods: dict[str, list[dict]] = defaultdict(list)
    for record in read_jsonl(dms):
        methods[record["method"]].append(record)
    report = {}
    for method, records in methods.items():
        named = records[0]["threads"][0].get("cr") or float(method.split("-")[-1].rstrip("x"))
        bands: dict[str, dict] = defaultdict(lambda: defaultdict(float))
        ceiling = []
        for record in records:
            thread = record["threads"][0]
            cap = (prompt_tokens[record["id"]] + thread["tokens"]) / window
            ceiling.append(min(named, cap))
            band = bands[band_name(base[record["id"]]["threads"][0]["tokens"])]
            band["problems"] += 1
            band["vanilla"] += base[record["id"]]["correct"]
            band[method] += record["correct"]
            band["realized_cr"] += thread["realized_cr"]
            band["window_cap"] += cap
        report[method] = {
            "named_cr": named, "ceiling": round(sum(ceiling) / len(ceiling), 3),
            "bands": {name: {"problems": int(b["problems"])} | {key: round(b[key] / b["problems"], 3)
                                                                 for key in ("vanilla", method, "realized_cr", "window_cap")}
                      for name, b in sorted(bands.items(), key=lambda kv: int(kv[0].split("-")[0].rstrip("+")))}}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True, help="its tokenizer counts the prompts' tokens")
    parser.add_argument("--vanilla", type=Path, required=True, help="eval --output of the base model, greedy")
    parser.add_argument("--dms", type=Path, required=True, help="eval --output of one or more DMS ratios, greedy")
    parser.add_argument("--window", type=int, default=32)
    args = parser.parse_args()
    print(json.dumps(by_length(args.problems, args.model, args.vanilla, args.dms, args.window), indent=1))


if __name__ == "__main__":
    main()
