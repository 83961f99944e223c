"""``POST /v1/solve``: a multi-sample solve, answered when done or (``"async": true``) accepted as a job."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Depends, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from orchestrator.api_errors import responses, unprocessable
from orchestrator.api_keys import Caller
from orchestrator.api_runtime import ApiRuntime
from orchestrator.routes.route_deps import admit, caller, runtime
from orchestrator.schemas import Job, JobState, SolveRequest, SolveResult

router = APIRouter(tags=["solve"])


class Accepted(BaseModel):
    """An async job: poll ``GET /v1/jobs/{id}``, stream ``GET /v1/jobs/{id}/events``."""

    id: str
    state: JobState


def check(body: SolveRequest, who: Caller, rt: ApiRuntime) -> JSONResponse | None:
    """A 422 naming the field, when this key may not ask for it or this deployment cannot run it."""
    try:
        if who.limits is not None:
            who.limits.check(body)
        rt.service.check(body)
    except ValueError as error:
        field, _, message = str(error).partition(": ")
        return unprocessable(field, message or str(error))
    return None


@router.post("/v1/solve", response_model=None, responses={
    200: {"model": SolveResult, "description": "the result (synchronous request)"},
    202: {"model": Accepted, "description": "accepted (\"async\": true): the job's id and state",
          "links": {name: {"operationId": name, "parameters": {"job_id": "$response.body#/id"}}
                    for name in ("getJob", "jobEvents", "cancelJob")}},
    **responses(400, 401, 413, 422, 429, 500, 504)})
async def solve(body: SolveRequest, who: Caller = Depends(caller), rt: ApiRuntime = Depends(runtime)):
    refused = check(body, who, rt)
    if refused is not None:
        return refused
    cached = rt.store.cached(body, who.key_id)
    if cached is not None and cached.result is not None:
        if body.run_async:
            return JSONResponse(status_code=202, content={"id": cached.id, "state": "done"})
        return cached.result
    admit(rt)
    now = time.time()
    job = rt.store.save(Job(id=uuid.uuid4().hex[:12], state="queued", request=body, created_s=now, updated_s=now,
                            owner=who.key_id))
    rt.publish(job.id, "state", {"state": "queued"})
    task = rt.start_job(job)
    if body.run_async:
        return JSONResponse(status_code=202, content={"id": job.id, "state": "queued"})
    with rt.metrics.latency.labels("solve").time():
        await asyncio.shield(task)  # accepted work finishes even if this client leaves
    job = rt.store.get(job.id)
    if job.state == "timed_out":
        raise HTTPException(status_code=504, detail=job.error)
    if job.state != "done":
        raise HTTPException(status_code=500, detail=job.error or job.state)
    return job.result
