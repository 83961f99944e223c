"""``thinkpool serve``: the REST service. On a host other machines can reach it needs API keys, unless anonymous
access is asked for explicitly (``--allow-anonymous``)."""

from __future__ import annotations

import ipaddress
import os


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only: ``localhost`` or a loopback address. Any other name
    may resolve to an outside interface, so it counts as reachable."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(args, parser) -> None:
    """Refuse (exit 2) to serve a non-loopback host with no API key configured, unless ``--allow-anonymous``."""
    from orchestrator.api_keys import parse_keys

    try:
        keys = parse_keys(os.environ.get("THINKPOOL_API_KEYS", ""))
    except ValueError as error:  # THINKPOOL_API_KEYS that do not parse
        parser.error(str(error))
    if is_loopback(args.host) or args.allow_anonymous or keys:
        return
    parser.error(f"argument --host: {args.host} can be reached from other machines and THINKPOOL_API_KEYS is not set: "
                 "set THINKPOOL_API_KEYS=key1,key2 (clients send X-API-Key or Authorization: Bearer), or pass "
                 "--allow-anonymous to serve it to anyone without a key")


def cmd_serve(args, parser) -> int:
    check_exposure(args, parser)
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
