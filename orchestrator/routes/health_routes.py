"""``/healthz`` (the process answers), ``/readyz`` (the workers are loaded) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from orchestrator.api_errors import responses
from orchestrator.api_runtime import ApiRuntime
from orchestrator.routes.route_deps import caller, runtime

router = APIRouter(tags=["health"])


class WorkerState(BaseModel):
    """One worker as the last health check saw it (``workers.runner.WorkerHealth``)."""

    worker: int
    state: str  # "up" | "down"
    node: str | None = None  # its Ray node (None in-process)
    node_alive: bool | None = None
    detail: str = ""


class Health(BaseModel):
    status: str  # "ok" | "ready" | "starting" | "unavailable"
    workers: list[WorkerState] | None = None
    detail: str | None = None  # which worker or node is down


@router.get("/healthz", response_model_exclude_none=True, responses=responses(400, 413))
async def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Health, response_model_exclude_none=True, responses={
    503: {"model": Health, "description": "starting, or a worker or its Ray node is down: the body says which"},
    **responses(400, 413)})
async def readyz(request: Request):
    """Ready when every worker answers (a ping each, bounded, the answer shared for a second or two)."""
    rt: ApiRuntime = runtime(request)
    if rt.service is None:
        return JSONResponse(status_code=503, content={"status": "starting"})
    workers = await rt.service.pool.health()
    down = [w for w in workers if w.state != "up"]
    body = Health(status="unavailable" if down else "ready", workers=[WorkerState(**w.as_dict()) for w in workers],
                  detail="; ".join(w.describe() for w in down) or None)
    if down:
        return JSONResponse(status_code=503, content=body.model_dump(exclude_none=True))
    return body


@router.get("/metrics", dependencies=[Depends(caller)], response_class=PlainTextResponse, responses={
    200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
    **responses(400, 401, 413, 429, 500)})
async def metrics(rt: ApiRuntime = Depends(runtime)):
    stats = [s for s in await rt.service.pool.stats() if s is not None]
    return PlainTextResponse(rt.metrics.render(stats, rt.recent_cr, rt.active), media_type=CONTENT_TYPE_LATEST)
