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


class Health(BaseModel):
    status: str
    workers: int | None = None


@router.get("/healthz", response_model_exclude_none=True, responses=responses(400, 413))
async def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Health, response_model_exclude_none=True, responses={
    503: {"model": Health, "description": "not ready (starting)"}, **responses(400, 413)})
async def readyz(request: Request):
    rt: ApiRuntime = runtime(request)
    if rt.service is None:
        return JSONResponse(status_code=503, content={"status": "starting"})
    return Health(status="ready", workers=rt.service.info["workers"])


@router.get("/metrics", dependencies=[Depends(caller)], response_class=PlainTextResponse, responses={
    200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
    **responses(400, 401, 413, 429, 500)})
async def metrics(rt: ApiRuntime = Depends(runtime)):
    stats = [s for s in await rt.service.pool.stats() if s is not None]
    return PlainTextResponse(rt.metrics.render(stats, rt.recent_cr, rt.active), media_type=CONTENT_TYPE_LATEST)
