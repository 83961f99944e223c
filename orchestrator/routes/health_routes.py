"""``/healthz`` (the process answers), ``/readyz`` (every worker answers), ``/v1/pool`` (the KV pools, JSON) and
``/metrics`` (Prometheus)."""

from __future__ import annotations

import time

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


class WorkerPoolStats(BaseModel):
    """One worker's KV pool and engine, now."""

    pool_bytes: int
    pool_used_bytes: int
    pool_peak_bytes: int
    running: int
    waiting: int
    tokens_per_s: float


class PoolStats(BaseModel):
    """Every worker's KV pool (workers that did not answer are left out), and the sums; ``time_s`` is when."""

    time_s: float
    pool_bytes: int
    pool_used_bytes: int
    pool_peak_bytes: int
    workers: list[WorkerPoolStats]


@router.get("/v1/pool", dependencies=[Depends(caller)], response_model=PoolStats,
            responses=responses(400, 401, 413, 429, 500))
async def pool(rt: ApiRuntime = Depends(runtime)) -> PoolStats:
    """The KV pools' bytes in use and their peaks, as JSON (the dashboard draws them over time)."""
    stats = [s for s in await rt.service.pool.stats() if s is not None]
    workers = [WorkerPoolStats(pool_bytes=s.pool_bytes, pool_used_bytes=s.pool_used_bytes,
                               pool_peak_bytes=s.pool_peak_bytes, running=s.running, waiting=s.waiting,
                               tokens_per_s=round(s.tokens_per_s, 1)) for s in stats]
    return PoolStats(time_s=time.time(), pool_bytes=sum(w.pool_bytes for w in workers),
                     pool_used_bytes=sum(w.pool_used_bytes for w in workers),
                     pool_peak_bytes=max((w.pool_peak_bytes for w in workers), default=0), workers=workers)


@router.get("/metrics", dependencies=[Depends(caller)], response_class=PlainTextResponse, responses={
    200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
    **responses(400, 401, 413, 429, 500)})
async def metrics(rt: ApiRuntime = Depends(runtime)):
    stats = [s for s in await rt.service.pool.stats() if s is not None]
    return PlainTextResponse(rt.metrics.render(stats, rt.recent_cr, rt.active), media_type=CONTENT_TYPE_LATEST)
