"""``thinkpool serve``: the REST service."""

from __future__ import annotations


def cmd_serve(args, parser) -> int:
    import uvicorn

    from dms_runtime.loading import ModelLoadError, check_model_dir, default_model_path
    from orchestrator.api import create_app
    from orchestrator.service import service_factory

    model_dir = args.model or default_model_path()
    try:
        check_model_dir(model_dir)  # no config, no tokenizer, bad dms_* settings: exit 2 before anything starts
    except ModelLoadError as error:
        parser.error(f"argument --model: {error}")
    try:
        app = create_app(service_factory(model_dir, args.kv_budget, args.workers))
    except ValueError as error:  # THINKPOOL_API_KEYS that do not parse
        parser.error(str(error))
    uvicorn.run(app, host=args.host, port=args.port)
    return 0
