"""Batch reasoning on a Ray cluster: one result line per problem.

    ray job submit --working-dir . -- python -m orchestrator.batch --input problems.jsonl --output results.jsonl
    thinkpool batch --input problems.jsonl --output results.jsonl          # the same, from the CLI

Joins the cluster it runs on (``RAY_ADDRESS``, set by ``ray job submit``) or starts a local one. Problems
are solved concurrently on the workers; each result line (``id``, ``answer``, ``correct`` when the file
has answers, ``votes``, ``samples``, ``tokens``, ``realized_cr``) is appended as soon as its problem is
done, so ``--resume`` after an interruption skips the ids already written.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from orchestrator.cli import bounded


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The batch options, shared by ``python -m orchestrator.batch`` and ``thinkpool batch``."""
    parser.add_argument("--input", type=Path, required=True, help="JSONL problems ({id, prompt[, answer]})")
    parser.add_argument("--output", type=Path, required=True, help="JSONL results, one line per problem")
    parser.add_argument("--resume", action="store_true", help="skip problems whose id is already in --output")
    parser.add_argument("--samples", type=bounded(int, 1, 256), default=8, help="threads per problem (1 = greedy)")
    parser.add_argument("--cr", type=float, default=1.0, help="DMS compression ratio")
    parser.add_argument("--workers", type=bounded(int, 1), default=1, help="Ray worker actors")
    parser.add_argument("--concurrency", type=bounded(int, 1), default=16, help="problems in flight at once")
    parser.add_argument("--model", type=Path, default=None)
    return parser


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Refuse a missing input file before any worker starts (``parser.error``: a message and exit code 2)."""
    if not args.input.is_file():
        parser.error(f"argument --input: file not found: {args.input}")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = add_arguments(argparse.ArgumentParser(prog="python -m orchestrator.batch", description=__doc__.splitlines()[0]))
    return check_args(parser.parse_args(argv), parser)


async def run_batch(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dms_runtime.loading import default_model_path
    from orchestrator.evaluate import problem_record
    from tasks.jsonl import read_jsonl, read_problems
    from tasks.prompt import format_prompt
    from workers.pool import WorkerPool
    from workers.thread import SamplingParams
    from workers.worker import ProblemRequest, WorkerConfig

    problems = read_problems(args.input)
    done: set[str] = set()
    if args.resume and args.output.is_file():
        done = {record["id"] for record in read_jsonl(args.output)}
    todo = [p for p in problems if p["id"] not in done]
    pool = WorkerPool(WorkerConfig(model=str(args.model or default_model_path())), num_workers=args.workers)
    gate = asyncio.Semaphore(args.concurrency)
    params = SamplingParams(0.0 if args.samples == 1 else 0.8, 1.0, 1536, 0)
    with args.output.open("a") as out, tqdm(total=len(todo), desc="problems", file=sys.stderr) as bar:
        async def one(index: int, problem: dict) -> None:
            async with gate:
                request = ProblemRequest(f"batch-{problem['id']}", format_prompt(problem["prompt"]), tuple(range(args.samples)),
                                         SamplingParams(params.temperature, 1.0, params.max_new_tokens, index), args.cr)
                threads = await pool.collect(request)
            record = problem_record(problem, threads)
            out.write(json.dumps(record) + "\n")
            out.flush()
            bar.update(1)

        await asyncio.gather(*(one(i, p) for i, p in enumerate(todo)))
    pool.shutdown()
    print(f"wrote {len(todo)} results to {args.output} ({len(done)} already there)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run_batch(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
