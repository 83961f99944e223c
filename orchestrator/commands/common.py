"""What several commands share: loading a model or exiting with a message, building the workers."""

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


def make_pool(model_dir, kv_budget: int | None, workers: int):
    """The workers an eval or solve runs on: Ray actors, or (``workers == 0``) one engine in this process."""
    from workers.worker import WorkerConfig

    if kv_budget is None and os.environ.get("THINKPOOL_KV_BUDGET"):
        kv_budget = byte_size(os.environ["THINKPOOL_KV_BUDGET"])
    config = WorkerConfig(model=str(model_dir), kv_budget_bytes=kv_budget)
    if workers == 0:
        from workers.local import LocalPool

        return LocalPool(config)
    from workers.pool import WorkerPool

    return WorkerPool(config, num_workers=workers)
