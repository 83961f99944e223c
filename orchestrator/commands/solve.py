"""``thinkpool solve``: one problem through the same service the REST API and the SDK use."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path


def cmd_solve(args, parser) -> int:
    from pydantic import ValidationError

    from dms_runtime.loading import default_model_path
    from orchestrator.schemas import SolveRequest
    from orchestrator.service import service_factory
    from tasks.chain import ProblemError, parse_problem

    try:
        parse_problem(args.prompt)
    except ProblemError as error:
        parser.error(f"argument prompt: {error}")
    model_dir = args.model or default_model_path()
    if not (Path(model_dir) / "config.json").is_file():
        parser.error(f"argument --model: no model at {model_dir}: expected a Hugging Face checkpoint directory with config.json")
    try:
        request = SolveRequest(prompt=args.prompt, samples=args.samples, cr=args.cr, max_tokens=args.max_new_tokens,
                               temperature=args.temperature, seed=args.seed)
    except ValidationError as error:
        first = error.errors()[0]
        parser.error(f"argument --{str(first['loc'][0]).replace('_', '-')}: {first['msg']}")
    started = time.perf_counter()
    service = service_factory(model_dir, None, args.workers)()
    try:
        result = asyncio.run(service.solve(request))
    except ValueError as error:
        service.pool.shutdown()
        field, _, message = str(error).partition(": ")
        parser.error(f"argument --{field.replace('_', '-')}: {message}")
    service.pool.shutdown()
    report = {"prompt": args.prompt, **result.model_dump(exclude={"threads"}), "time_s": round(time.perf_counter() - started, 3)}
    if args.json:
        print(json.dumps(report))
    else:
        votes = ", ".join(f"{a}: {c}" for a, c in result.votes.items()) or "no thread answered"
        print(f"answer: {result.answer}\nvotes: {votes}\nthreads: {result.samples} at {result.cr:g}x  "
              f"tokens: {result.tokens}  time: {report['time_s']}s")
    return 0
