"""``thinkpool solve``: one problem through the same service the REST API and the SDK use."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

OPTIONS = {"max_tokens": "max-new-tokens", "answer_pattern": "answer-pattern"}  # request field -> its option


def cmd_solve(args, parser) -> int:
    from pydantic import ValidationError

    from dms_runtime.loading import ModelLoadError, check_model_dir, default_model_path
    from orchestrator.schemas import SolveRequest
    from orchestrator.service import service_factory
    from tasks.families import default_family, get_family

    model_dir = Path(args.model or default_model_path())
    try:
        check_model_dir(model_dir)
        task = args.task or default_family(model_dir)
        get_family(task, answer_pattern=args.answer_pattern).validate(args.prompt)  # before any worker starts
    except ModelLoadError as error:
        parser.error(f"argument --model: {error}")
    except ValueError as error:
        field, _, message = str(error).partition(": ")
        parser.error(f"argument {option(field)}: {message}")
    try:
        request = SolveRequest(prompt=args.prompt, task=args.task, answer_pattern=args.answer_pattern,
                               samples=args.samples, cr=args.cr, max_tokens=args.max_new_tokens,
                               temperature=args.temperature, seed=args.seed)
    except ValidationError as error:
        first = error.errors()[0]
        parser.error(f"argument {option(str(first['loc'][0]))}: {first['msg']}")
    started = time.perf_counter()
    service = service_factory(model_dir, None, args.workers)()
    try:
        result = asyncio.run(service.solve(request))
    except ValueError as error:
        service.pool.shutdown()
        field, _, message = str(error).partition(": ")
        parser.error(f"argument {option(field)}: {message}")
    service.pool.shutdown()
    report = {"prompt": args.prompt, **result.model_dump(exclude={"threads"}), "time_s": round(time.perf_counter() - started, 3)}
    if args.json:
        print(json.dumps(report))
    else:
        votes = ", ".join(f"{a}: {c}" for a, c in result.votes.items()) or "no thread answered"
        print(f"answer: {result.answer}\nvotes: {votes}\nthreads: {result.samples} at {result.cr:g}x  "
              f"tokens: {result.tokens}  time: {report['time_s']}s")
    return 0


def option(field: str) -> str:
    """The command-line spelling of a request field (``prompt`` is the positional argument)."""
    return "prompt" if field == "prompt" else f"--{OPTIONS.get(field, field.replace('_', '-'))}"
