"""How one DMS adapter's realized compression and greedy accuracy move with its decision threshold, on a problem file.

A probe for length-aware eviction: an adapter whose threshold was fitted over mixed lengths over-evicts long threads,
and this shows whether raising the threshold there buys accuracy back. Prints one JSON document (the sweep, then the
same model without gates); ``--plot`` draws both against the threshold.

    .venv/bin/python research/threshold_sweep.py --model checkpoints/chain-qwen3 --cr 8 \
        --problems runs/hard48.jsonl --thresholds 0 8 16 25 50 --plot sweep.png
"""

from __future__ import annotations

import argparse
import json

from dms_runtime.adapters import adapter_path
from dms_runtime.loading import load_model
from policies.extraction import answers_match
from tasks.prompt import format_prompt
from training.thresholds import measure
from evaluation.reference_decode import SamplingParams, generate_threads


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = result["sweep"]
    thresholds = [row["threshold"] for row in sweep]
    fig, accuracy_axis = plt.subplots(figsize=(7, 4))
    accuracy_axis.plot(thresholds, [100 * row["accuracy"] for row in sweep], "o-", color="tab:blue", label="accuracy")
    accuracy_axis.axhline(100 * result["cr1"]["accuracy"], color="tab:blue", ls=":", label="no eviction")
    accuracy_axis.set_xlabel("decision threshold (evict where the gate's logit exceeds it)")
    accuracy_axis.set_ylabel("greedy accuracy, %", color="tab:blue")
    ratio_axis = accuracy_axis.twinx()
    ratio_axis.plot(thresholds, [row["realized_cr"] for row in sweep], "s--", color="tab:red", label="realized_cr")
    ratio_axis.axhline(result["cr"], color="tab:red", ls=":")
    ratio_axis.set_ylabel("realized compression", color="tab:red")
    accuracy_axis.set_title(f"{result['cr']:g}x adapter of {result['model']}, {sweep[0]['n']} problems")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/chain-qwen3")
    parser.add_argument("--cr", type=float, default=8)
    parser.add_argument("--problems", required=True)
    parser.add_argument("--thresholds", type=float, nargs="+", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=1536)
    parser.add_argument("--plot", help="draw accuracy and realized compression against the threshold (PNG)")
    args = parser.parse_args()
    problems = [json.loads(line) for line in open(args.problems)]
    model, tokenizer = load_model(args.model)
    adapter = adapter_path(args.model, args.cr)
    sweep = []
    for threshold in sorted(args.thresholds):
        realized, accuracy = measure(model, tokenizer, adapter, threshold, problems, args.max_new_tokens)
        sweep.append({"threshold": threshold, "realized_cr": round(realized, 3), "accuracy": accuracy, "n": len(problems)})
    threads = generate_threads(model, tokenizer, [format_prompt(p["prompt"]) for p in problems], 1,
                               SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens), progress=False).threads
    correct = sum(answers_match(t.answer, problems[t.problem_index]["answer"]) for t in threads)
    result = {"model": args.model, "cr": args.cr, "problems": args.problems, "sweep": sweep,
              "cr1": {"accuracy": correct / len(problems), "n": len(problems)}}
    print(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
