"""What several commands share: loading a model or a problem file or exiting with a message, checking
requested ratios against the adapters, building the workers."""

from __future__ import annotations

import os

from orchestrator.cli import byte_size


def load_model_or_exit(args, parser):
    from dms_runtime.loading import ModelLoadError, default_model_path, load_model

    path = args.model or default_model_path()
    try:
        model, tokenizer = load_model(path)
    except ModelLoadError as error:
        parser.error(f"argument --model: {error}")
    return model, tokenizer, str(path)


def read_problems_or_exit(args, parser) -> list[dict]:
    """``--problems`` (first ``--limit``), or a one-line usage error naming the field."""
    from tasks.jsonl import ProblemFileError, read_problems

    try:
        return read_problems(args.problems, args.limit)
    except ProblemFileError as error:
        parser.error(f"argument --problems: {error}")


def check_adapters(ratios, model_dir, parser, option: str) -> None:
    """Exit with a usage error naming ``option`` if a ratio above 1 has no adapter beside the model."""
    from workers.worker import available_ratios

    missing = [cr for cr in ratios if cr != 1 and cr not in available_ratios(model_dir)]
    if missing:
        parser.error(f"argument {option}: no DMS adapter for {missing[0]:g}x beside {model_dir}")


def make_pool(model_dir, kv_budget: int | None, workers: int, reserve: str = "measured"):
    """The workers an eval or solve runs on: Ray actors, or (``workers == 0``) one engine in this process."""
    from workers.worker import WorkerConfig

    if kv_budget is None and os.environ.get("THINKPOOL_KV_BUDGET"):
        kv_budget = byte_size(os.environ["THINKPOOL_KV_BUDGET"])
    config = WorkerConfig(model=str(model_dir), kv_budget_bytes=kv_budget, reserve=reserve)
    if workers == 0:
        from workers.local import LocalPool

        return LocalPool(config)
    from workers.pool import WorkerPool

    return WorkerPool(config, num_workers=workers)
