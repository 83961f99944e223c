"""``thinkpool calibrate``: measure the planner's profile."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from orchestrator.commands.common import check_adapters
from workers.factory import make_pool


def cmd_calibrate(args, parser) -> int:
    from dms_runtime.loading import default_model_path
    from evaluation.calibration import calibrate
    from workers.worker import available_ratios

    model_dir = args.model or default_model_path()
    ratios = args.cr or [1.0] + available_ratios(model_dir)
    check_adapters(ratios, model_dir, parser, "--cr")
    pool = make_pool(model_dir, None, args.workers)
    window = 16
    adapters = sorted(Path(model_dir).glob("dms-*x.json"))
    if adapters:
        window = json.loads(adapters[0].read_text())["dms_config"]["window"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    profile = asyncio.run(calibrate(pool, tokenizer, args.bins, ratios, args.problems, args.threads, args.max_new_tokens,
                                    args.temperature, args.seed, str(model_dir), window, args.top_p,
                                    progress=lambda line: print(line, file=sys.stderr)))
    pool.shutdown()
    print(f"profile: {profile.save(args.output)}")
    return 0
