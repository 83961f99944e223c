"""The REST service (``thinkpool serve``): FastAPI over one ``SolveService``.

Routes (one module each under ``orchestrator/routes/``): ``POST /v1/solve`` (sync, or ``"async": true`` -> 202 and a
job id), ``GET /v1/jobs`` (the caller's), ``GET/DELETE /v1/jobs/{id}``, ``GET /v1/jobs/{id}/events`` (server-sent
events), OpenAI's ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` and
``GET /v1/models/{id}``, ``/healthz``, ``/readyz``, ``/v1/pool`` (the KV pools), ``/metrics`` (Prometheus), and the
dashboard at ``/ui``. Jobs are saved before they are acknowledged; on start-up, jobs left unfinished by a previous
process are run again. API keys, rate limits, the bounded queue, deadlines and the body limit:
``orchestrator/api_keys.py``, ``api_runtime.py``, ``api_limits.py``; error shapes: ``orchestrator/api_errors.py``.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.api_errors import error_response, on_http_error, on_validation_error
from orchestrator.api_keys import KeyGate, parse_keys
from orchestrator.api_limits import BodyLimit
from orchestrator.api_runtime import ApiRuntime
from orchestrator.jobs import make_job_store
from orchestrator.routes import health_routes, job_routes, openai_routes, solve_routes, ui_routes
from orchestrator.settings import LimitSettings, get_settings


def create_app(service_factory, store=None, limits: LimitSettings | None = None) -> FastAPI:
    """``service_factory()`` builds the SolveService at start-up (the workers load then, not at import);
    ``limits`` default to the settings' (``configs/defaults.yaml``, ``THINKPOOL_LIMITS_*``); keys come from
    ``THINKPOOL_API_KEYS``."""
    limits = limits or get_settings().limits
    runtime = ApiRuntime(limits, KeyGate(parse_keys(os.environ.get("THINKPOOL_API_KEYS", "")),
                                         limits.requests_per_minute))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service = await asyncio.to_thread(service_factory)
        runtime.store = store or make_job_store(service.model_id, limits.job_ttl_s)
        runtime.store.model_id = service.model_id
        runtime.service = service
        for job in runtime.store.unfinished():  # accepted before a restart: finish it now
            runtime.start_job(job)
        yield
        service.pool.shutdown()

    app = FastAPI(title="thinkpool", version="0.1", lifespan=lifespan,
                  description="Many reasoning threads inside a fixed KV memory budget. Errors: `{\"detail\": ...}` "
                              "on thinkpool's routes, OpenAI's `{\"error\": {...}}` on the OpenAI routes.")
    app.state.runtime = runtime
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)

    @app.exception_handler(Exception)
    async def on_failure(request: Request, error: Exception):
        return error_response(request.url.path, 500, f"{type(error).__name__}: {error}")

    for routes in (solve_routes, job_routes, openai_routes, health_routes, ui_routes):
        app.include_router(routes.router)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    return app
