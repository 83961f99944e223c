"""How reliably a model copies each work line's header from the prompt, on each path, in one forward pass.

    .venv/bin/python scripts/header_probe.py --problems runs/dev100_of_140.jsonl --limit 40
    .venv/bin/python scripts/header_probe.py --problems runs/dev100_of_140.jsonl --model runs/candidate

The header copy (``r=h*p``, read off the prompt's ``r=h*p``) is where the shipped model's hard-problem threads
first go wrong (``scripts/error_anatomy.py``). This probe teacher-forces the reference chain of thought along
one path (every line in its canonical form, or every line of two operand orders in the other one) and reads
the model's probability of copying each header right: its first character among the valid ones (given that
it is a variable), then the operator and the second operand. ``mean_error`` is the chance that a thread
sampled at temperature 1 copies a header wrong, averaged over lines. It screens a candidate chain-of-thought
format in a minute, where a vote of 16 threads on 100 problems takes half an hour. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

import torch

from dms_runtime.loading import SHIPPED_MODEL, load_model
from tasks.chain import Problem, parse_problem
from tasks.cot import line_forms
from tasks.jsonl import read_jsonl
from tasks.prompt import format_prompt

PATHS = ("canonical", "other_order")


def header_copy_probabilities(model, tokenizer, problem: Problem, path: str) -> list[float]:
    """Per work line on ``path``, the teacher-forced probability of copying its header right (``other_order``:
    only the lines that have a second operand order)."""
    prompt, lines, probed = format_prompt(problem.text), [], []
    for forms in line_forms(problem):
        line = forms[1] if path == "other_order" and len(forms) > 1 else forms[0]
        if "|" in line and (path == "canonical" or len(forms) > 1):
            start = len(prompt) + sum(len(done) + 1 for done in lines) + 2  # the header's first char after "r="
            probed.append((start, {form[2] for form in forms}))
        lines.append(line)
    text = prompt + "\n".join(lines)
    ids = tokenizer(text)["input_ids"]
    offset = len(ids) - len(text)  # a <bos> in front
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    letters = tokenizer.convert_tokens_to_ids(list(string.ascii_lowercase))
    out = []
    for start, valid in probed:
        first = logp[start + offset - 1]  # the prediction of the char at start
        valid_ids = tokenizer.convert_tokens_to_ids(sorted(valid))
        right = torch.logsumexp(first[valid_ids], 0) - torch.logsumexp(first[letters], 0)  # given a variable
        rest = sum(logp[i + offset - 1, ids[i + offset]] for i in (start + 1, start + 2))
        out.append(float((right + rest).exp()))
    return out


def summary(probabilities: list[float]) -> dict:
    errors = torch.tensor([1 - p for p in probabilities])
    return {"lines": len(probabilities), "mean_error": round(float(errors.mean()), 4),
            "lines_error_above_0.5": round(float((errors > 0.5).float().mean()), 4),
            "lines_error_above_0.1": round(float((errors > 0.1).float().mean()), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", required=True, type=Path)
    parser.add_argument("--model", default=str(SHIPPED_MODEL))
    parser.add_argument("--limit", type=int, default=0)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    problems = [parse_problem(p["prompt"]) for p in read_jsonl(args.problems)[: args.limit or None]]
    report: dict = {"model": args.model, "problems": len(problems)}
    for path in PATHS:
        lines = [p for problem in problems for p in header_copy_probabilities(model, tokenizer, problem, path)]
        report[path] = summary(lines)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
