"""``thinkpool serve``: the REST service."""

from __future__ import annotations

from pathlib import Path


def cmd_serve(args, parser) -> int:
    import uvicorn

    from dms_runtime.loading import default_model_path
    from orchestrator.api import create_app
    from orchestrator.service import service_factory

    model_dir = args.model or default_model_path()
    if not (Path(model_dir) / "config.json").is_file():
        parser.error(f"argument --model: no model at {model_dir}")
    uvicorn.run(create_app(service_factory(model_dir, args.kv_budget, args.workers)), host=args.host, port=args.port)
    return 0
