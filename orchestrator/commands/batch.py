"""``thinkpool batch``: the batch entry point (``python -m orchestrator.batch``) from the CLI."""

from __future__ import annotations

import asyncio


def cmd_batch(args, parser) -> int:
    from orchestrator.batch import check_args, run_batch

    return asyncio.run(run_batch(check_args(args, parser)))
