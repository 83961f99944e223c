"""``thinkpool solve``: one problem through the workers."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from orchestrator.commands.common import make_pool


def cmd_solve(args, parser) -> int:
    from dms_runtime.loading import default_model_path
    from policies.voting import majority_vote
    from tasks.chain import ProblemError, parse_problem
    from tasks.prompt import format_prompt
    from workers.thread import SamplingParams
    from workers.worker import ProblemRequest, available_ratios

    try:
        parse_problem(args.prompt)
    except ProblemError as error:
        parser.error(f"argument prompt: {error}")
    model_dir = args.model or default_model_path()
    if not (Path(model_dir) / "config.json").is_file():
        parser.error(f"argument --model: no model at {model_dir}: expected a Hugging Face checkpoint directory with config.json")
    if args.cr != 1 and args.cr not in available_ratios(model_dir):
        parser.error(f"argument --cr: no DMS adapter for {args.cr:g}x beside {model_dir}")
    started = time.perf_counter()
    pool = make_pool(model_dir, None, args.workers)
    params = SamplingParams(0.0 if args.samples == 1 else args.temperature, args.top_p, args.max_new_tokens, args.seed)
    threads = pool.solve(ProblemRequest("solve", format_prompt(args.prompt), tuple(range(args.samples)), params, args.cr))
    stats = [s for s in asyncio.run(pool.stats()) if s is not None]
    pool.shutdown()
    vote = majority_vote([t.answer for t in threads])
    report = {
        "prompt": args.prompt,
        "answer": vote.answer,
        "votes": vote.counts,
        "samples": args.samples,
        "cr": args.cr,
        "tokens": sum(t.tokens for t in threads),
        "realized_cr": sum(t.realized_cr for t in threads) / len(threads),
        "kv_peak_bytes": max(s.pool_peak_bytes for s in stats),
        "time_s": round(time.perf_counter() - started, 3),
    }
    if args.json:
        print(json.dumps(report))
    else:
        votes = ", ".join(f"{a}: {c}" for a, c in vote.counts.items()) or "no thread answered"
        print(f"answer: {vote.answer}\nvotes: {votes}\ntokens: {report['tokens']}  time: {report['time_s']}s")
    return 0
