"""``thinkpool calibrate``: measure the controller's profile for one (model, task family)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from orchestrator.commands.common import check_adapters, read_problems_or_exit
from workers.factory import make_pool


def profile_problems(args, parser, task: str) -> tuple[list[dict], str]:
    """The problems to measure on and the signal to bin them by: a problem file (any task; greedy_confidence by
    default), or fresh chain problems per k bin (``--bins``, ``--per-bin``; signal k)."""
    from tasks.chain import generate_suite

    if args.problems is not None:
        problems = read_problems_or_exit(args, parser, task, need_answers=True)
        signal = args.signal or "greedy_confidence"
        if signal == "k" and any("k" not in p for p in problems):
            parser.error("argument --signal: k needs chain problems (their k is read off the prompt)")
        return problems, signal
    if task != "chain":
        parser.error(f"argument --problems: the {task} task needs a problem file with answers to calibrate on")
    problems = [p for low, high in args.bins for p in generate_suite(args.per_bin, low, high, seed=args.seed + low)]
    return problems, args.signal or "k"


def cmd_calibrate(args, parser) -> int:
    from dms_runtime.loading import default_model_path, load_tokenizer
    from evaluation.calibration import build_profile, describe, measure
    from tasks.families import default_family
    from workers.worker import available_ratios

    model_dir = Path(args.model or default_model_path())
    task = args.task or default_family(model_dir)
    problems, signal = profile_problems(args, parser, task)
    ratios = args.cr or [1.0] + available_ratios(model_dir)
    check_adapters(ratios, model_dir, parser, "--cr")
    signal_cr = min(ratios)
    window = 16
    adapters = sorted(model_dir.glob("dms-*x.json"))
    if adapters:
        window = json.loads(adapters[0].read_text())["dms_config"]["window"]
    output = args.output or model_dir / f"calibration-{task}.json"
    pool = make_pool(model_dir, None, args.workers)
    try:
        measured = asyncio.run(measure(pool, load_tokenizer(model_dir), problems, task, ratios, args.threads,
                                       args.max_new_tokens, args.temperature, args.seed, args.top_p,
                                       progress=lambda line: print(line, file=sys.stderr)))
    finally:
        pool.shutdown()
    bins = args.quantile_bins if signal == "greedy_confidence" else args.bins
    profile = build_profile(measured, signal, bins, ratios, args.temperature, args.max_new_tokens, str(model_dir), task,
                            window, args.seed, args.top_p, signal_cr)
    for line in describe(profile):
        print(line, file=sys.stderr)
    print(f"profile: {profile.save(output)}")
    return 0
