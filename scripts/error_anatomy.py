"""Where threads go wrong on the chain task, and whether sampled threads of a failed problem fail alike.

    thinkpool generate --n 100 --k 16-20 --seed 1002 --output runs/hard_k16-20.jsonl
    .venv/bin/python scripts/error_anatomy.py --problems runs/hard_k16-20.jsonl --limit 30 --samples 8
    .venv/bin/python scripts/error_anatomy.py --problems runs/dms_k1-20.jsonl --model checkpoints/chain-qwen3-dms --cr 8

Decodes every problem greedily (optionally under a DMS adapter), compares each failed thread's chain of
thought with the reference one line by line, and names the part of the first line that differs: the
header copied from the prompt (``r=h+p``), the operand values copied from register lines (``h:00+p:22``),
the single-digit facts, or the register it writes; a wrong header is also classified (``header_defects``:
its operator, its operands, or both, and whether it is another statement of the prompt). With ``--samples N``
the failed problems are also sampled N times (``--temperature``, 0.8 by default): how many sampled threads are
right, which answers they give, and where they first go wrong. Prints one JSON object.

Why it matters: majority voting beats greedy only if a failed problem's sampled threads reach the right
answer more often than any single wrong one; with one valid chain of thought, a thread that takes the
wrong branch at a step the greedy thread also gets wrong lands on the same wrong answer.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from dms_runtime.adapters import adapter_path, load_adapter
from dms_runtime.loading import default_model_path, load_model
from policies.extraction import answers_match
from tasks.chain import DERIVED, Problem, parse_problem
from tasks.cot import COMMUTATIVE, line_forms, statement_of, writes_reversed_minus
from tasks.jsonl import read_jsonl
from tasks.prompt import format_prompt
from evaluation.reference_decode import KVPolicy, SamplingParams, generate_threads

WORK_LINE = ("header", "operands", "facts")


def first_error(text: str, forms: list[list[str]]) -> dict | None:
    """The first line where ``text`` leaves every valid path (``tasks.cot.line_forms``): its index, the part
    that differs from the form it set out on (the one with its header, else the canonical one), and both lines."""
    for index, (got, options) in enumerate(zip(text.split("\n"), forms)):
        if got in options:
            continue
        # the form this line set out on (its header), else the canonical one
        want = next((form for form in options if form.split("|")[0] == got.split("|")[0]), options[0])
        if "|" in want:  # a work line: header|operands|facts
            got_parts = (got.split("|") + ["", ""])[:3]
            part = next((name for name, a, b in zip(WORK_LINE, got_parts, want.split("|")) if a != b), "facts")
        else:
            part = "answer" if want.startswith("#") else "register"
        return {"line": index, "part": part, "got": got, "want": want}
    return None


def same_operands(op: str, got: tuple[str, str], want: tuple[str, str]) -> bool:
    """Whether two operand pairs name the same operation under ``op``: in either order for ``+`` and ``*``."""
    return got == want or (op in COMMUTATIVE and set(got) == set(want))


def header_defect(got: str, want: str, problem: Problem) -> str:
    """What a wrongly copied header (``r=h*p`` for ``r=h+p``) got wrong: the operator, the operands, both, or the
    variable; ``+statement`` when it is another derived statement of the prompt (either operand order)."""
    match = DERIVED.match(statement_of(got))
    if match is None:
        return "malformed"
    var, y, op, z = match.groups()
    want_var, want_y, want_op, want_z = DERIVED.match(statement_of(want)).groups()  # type: ignore[union-attr]
    wrong = [name for name, bad in (("variable", var != want_var), ("operator", op != want_op),
                                    ("operands", not same_operands(op, (y, z), (want_y, want_z)))) if bad]
    other = any(a.op == op and same_operands(op, (a.y, a.z), (y, z)) and a.var != want_var
                for a in problem.assignments if not a.is_input)
    return "+".join(wrong or ["none"]) + ("+statement" if other else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", required=True, type=Path)
    parser.add_argument("--model", default=str(default_model_path()))
    parser.add_argument("--cr", type=float, default=1.0, help="a DMS adapter beside the model (1 = none)")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--samples", type=int, default=0, help="sampled threads per failed problem (0 = none)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    problems = read_jsonl(args.problems)
    problems = problems[: args.limit or None]
    model, tokenizer = load_model(args.model)
    kv = KVPolicy(dms=load_adapter(model, adapter_path(args.model, args.cr))) if args.cr > 1 else None
    prompts = [format_prompt(p["prompt"]) for p in problems]
    parsed = [parse_problem(p["prompt"]) for p in problems]
    forms = [line_forms(problem, writes_reversed_minus(model)) for problem in parsed]
    greedy = generate_threads(model, tokenizer, prompts, 1, SamplingParams(temperature=0), progress=False, kv=kv)
    failed = [t for t in greedy.threads if not answers_match(t.answer, problems[t.problem_index]["answer"])]
    report: dict = {"n": len(problems), "greedy_accuracy": 1 - len(failed) / max(1, len(problems)),
                    "first_error_parts": collections.Counter(), "header_defects": collections.Counter(), "failed": []}
    for thread in failed:
        error = first_error(thread.text, forms[thread.problem_index])
        report["first_error_parts"][error["part"] if error else "none"] += 1
        if error and error["part"] == "header":
            headers = error["got"].split("|")[0], error["want"].split("|")[0]
            error["defect"] = header_defect(*headers, parsed[thread.problem_index])
            report["header_defects"][error["defect"]] += 1
        report["failed"].append({"problem": problems[thread.problem_index]["id"], "k": problems[thread.problem_index].get("k"),
                                 "answer": problems[thread.problem_index]["answer"], "greedy": thread.answer,
                                 "first_error": error})
    if args.samples and failed:
        indices = [t.problem_index for t in failed]
        sampled = generate_threads(model, tokenizer, [prompts[i] for i in indices], args.samples,
                                   SamplingParams(temperature=args.temperature, seed=args.seed), progress=False, kv=kv)
        by_problem = collections.defaultdict(list)
        for thread in sampled.threads:
            by_problem[thread.problem_index].append(thread)
        for entry, index, threads in zip(report["failed"], indices, (by_problem[j] for j in range(len(indices)))):
            answers = collections.Counter(t.answer for t in threads)
            entry["sampled_correct"] = sum(answers_match(t.answer, entry["answer"]) for t in threads)
            entry["sampled_answers"] = answers.most_common(4)
            entry["vote_fixes_it"] = answers_match(answers.most_common(1)[0][0], entry["answer"])
            errors = (first_error(t.text, forms[index]) for t in threads)
            entry["sampled_first_errors"] = collections.Counter(
                f"line {e['line']} {e['part']}" if e else "none" for e in errors).most_common(4)
        report["vote_fixes"] = sum(entry["vote_fixes_it"] for entry in report["failed"])
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
