"""Batch reasoning on a Ray cluster: one result line per problem.

    ray job submit --working-dir . -- python -m orchestrator.batch --input problems.jsonl --output results.jsonl
    thinkpool batch --input problems.jsonl --output results.jsonl          # the same, from the CLI

Joins the cluster it runs on (``RAY_ADDRESS``, set by ``ray job submit``) or starts a local one. Every problem
is one request to the same :class:`~orchestrator.service.SolveService` the REST API runs (so the configured
sampling defaults apply), seeded from its id: problems are solved concurrently on the workers, each result line
(``id``, ``answer``, ``correct`` when the file has answers, ``votes``, ``samples``, ``tokens``, ``realized_cr``,
``kv_peak_bytes``) is appended as soon as its problem is done, and ``--resume`` after an interruption skips the
ids already written and gives the rest the threads a full run would have. A row may name its task family
(``"task": "math"``, a regex row its ``"answer_pattern"``); rows that name none are of ``--task``, else of the
model's own family (its directory's ``thinkpool.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from orchestrator.arguments import bounded, sample_count
from tasks.families import FAMILIES


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The batch options, shared by ``python -m orchestrator.batch`` and ``thinkpool batch``."""
    parser.add_argument("--input", type=Path, required=True, help="JSONL problems ({id, prompt[, answer]})")
    parser.add_argument("--output", type=Path, required=True, help="JSONL results, one line per problem")
    parser.add_argument("--resume", action="store_true", help="skip problems whose id is already in --output")
    parser.add_argument("--samples", type=sample_count(256, "auto"), default=8,
                        help="threads per problem (1 = greedy), or 'auto' for the controller")
    parser.add_argument("--cr", type=bounded(float, 1, 64), default=None, help="DMS compression ratio (fixed samples)")
    parser.add_argument("--seed", type=bounded(int, 0), default=0, help="the run's seed (each problem's derives from its id)")
    parser.add_argument("--max-new-tokens", type=bounded(int, 1, 8192), default=None,
                        help="token limit per thread (default: the settings', within the model's context)")
    parser.add_argument("--workers", type=bounded(int, 0, 64), default=1, help="Ray worker actors (0: in this process)")
    parser.add_argument("--concurrency", type=bounded(int, 1), default=16, help="problems in flight at once")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--task", choices=FAMILIES, default=None,
                        help="task family of rows that name none (default: the model's)")
    return parser


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Refuse a missing input file before any worker starts (``parser.error``: a message and exit code 2)."""
    from dms_runtime.loading import ModelLoadError, check_model_dir, default_model_path

    if not args.input.is_file():
        parser.error(f"argument --input: file not found: {args.input}")
    try:
        check_model_dir(args.model or default_model_path())
    except ModelLoadError as error:
        parser.error(f"argument --model: {error}")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = add_arguments(argparse.ArgumentParser(prog="python -m orchestrator.batch", description=__doc__.splitlines()[0]))
    return check_args(parser.parse_args(argv), parser)


def result_line(problem: dict, result) -> dict:
    """One problem's result line: its outcome (scored, by its task family, when the row has an answer) and its
    threads' answers."""
    from policies.extraction import answers_match
    from tasks.families import get_family

    line = {"id": problem["id"], "task": result.task, "answer": result.answer, "votes": result.votes,
            "samples": result.samples,
            "tokens": result.tokens, "cr": result.cr, "realized_cr": result.realized_cr, "kv_peak_bytes": result.kv_peak_bytes,
            "threads": [{"answer": t.answer, "tokens": t.tokens, "mean_logprob": round(t.mean_logprob, 5)} for t in result.threads]}
    if "answer" in problem:
        line["expected"] = problem["answer"]
        if result.task == "chain":
            line["correct"] = answers_match(result.answer, problem["answer"])
        else:
            family = get_family(result.task, answer_pattern=problem.get("answer_pattern"))
            line["correct"] = family.same(result.answer, problem["answer"])
    return line


async def run_batch(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dms_runtime.loading import default_model_path
    from orchestrator.schemas import SolveRequest
    from orchestrator.service import service_factory
    from tasks.families import default_family
    from tasks.jsonl import ProblemFileError, problem_seed, read_jsonl, read_problems

    model_dir = args.model or default_model_path()
    try:
        problems = read_problems(args.input, task=args.task or default_family(model_dir))
    except (ProblemFileError, ValueError) as error:
        print(f"python -m orchestrator.batch: error: argument --input: {error}", file=sys.stderr)
        return 2
    done: set[str] = set()
    if args.resume and args.output.is_file():
        done = {record["id"] for record in read_jsonl(args.output)}
    todo = [p for p in problems if p["id"] not in done]
    service = service_factory(model_dir, None, args.workers)()
    gate = asyncio.Semaphore(args.concurrency)
    with args.output.open("a") as out, tqdm(total=len(todo), desc="problems", file=sys.stderr) as bar:
        async def one(problem: dict) -> None:
            async with gate:
                request = SolveRequest(prompt=problem["prompt"], samples=args.samples, cr=args.cr,
                                       max_tokens=args.max_new_tokens,
                                       task=problem.get("task", args.task), answer_pattern=problem.get("answer_pattern"),
                                       seed=problem_seed(args.seed, problem["id"]))
                result = await service.solve(request, job_id=f"batch-{problem['id']}")
            out.write(json.dumps(result_line(problem, result)) + "\n")
            out.flush()
            bar.update(1)

        await asyncio.gather(*(one(p) for p in todo))
    service.pool.shutdown()
    print(f"wrote {len(todo)} results to {args.output} ({len(done)} already there)", file=sys.stderr)
    return 0


def cmd_batch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``thinkpool batch``."""
    return asyncio.run(run_batch(check_args(args, parser)))


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run_batch(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
