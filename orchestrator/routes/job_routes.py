"""``/v1/jobs/{id}``: a job's state and result, its live events (server-sent), and cancelling it. A job is seen
only by the API key that created it (404 to any other)."""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Depends, Header, HTTPException, Query
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from orchestrator.api_errors import responses
from orchestrator.api_keys import Caller
from orchestrator.api_runtime import ApiRuntime
from orchestrator.jobs import FINAL
from orchestrator.routes.route_deps import caller, runtime
from orchestrator.schemas import Job

router = APIRouter(tags=["jobs"], responses=responses(400, 401, 404, 413, 429, 500))
POLL_S = 0.1


class JobSummary(BaseModel):
    """A job in a listing: enough to pick it (``GET /v1/jobs/{id}`` has the rest)."""

    id: str
    state: str
    created_s: float
    updated_s: float
    prompt: str  # the first 200 characters
    task: str | None
    samples: int | str
    answer: str | None = None
    threads: int = 0  # finished threads (of a finished job)


@router.get("/v1/jobs", operation_id="listJobs")
async def list_jobs(limit: int = Query(50, ge=1, le=500, description="the newest this many"),
                    who: Caller = Depends(caller), rt: ApiRuntime = Depends(runtime)) -> list[JobSummary]:
    """The caller's jobs, newest first: running and recent ones (finished jobs expire after ``limits.job_ttl_s``)."""
    return [JobSummary(id=j.id, state=j.state, created_s=j.created_s, updated_s=j.updated_s,
                       prompt=j.request.prompt[:200], task=j.request.task, samples=j.request.samples,
                       answer=j.result.answer if j.result else None, threads=len(j.result.threads) if j.result else 0)
            for j in rt.store.recent(who.key_id, limit)]


def owned(job_id: str, who: Caller, rt: ApiRuntime) -> Job:
    job = rt.job_for(job_id, who)
    if job is None:
        raise HTTPException(status_code=404, detail=f"no job {job_id}")
    return job


@router.get("/v1/jobs/{job_id}", operation_id="getJob")
async def get_job(job_id: str, who: Caller = Depends(caller), rt: ApiRuntime = Depends(runtime)) -> Job:
    return owned(job_id, who, rt)


@router.delete("/v1/jobs/{job_id}", operation_id="cancelJob")
async def cancel_job(job_id: str, who: Caller = Depends(caller), rt: ApiRuntime = Depends(runtime)) -> Job:
    """Every thread of the job stops on its worker and frees its KV; the job ends ``cancelled``."""
    owned(job_id, who, rt)
    task = rt.tasks.get(job_id)
    if task is not None:
        rt.cancelling.add(job_id)
        await rt.stop(job_id, task)
    return rt.store.get(job_id)


@router.get("/v1/jobs/{job_id}/events", operation_id="jobEvents", response_class=StreamingResponse, responses={200: {
    "description": "server-sent events (id, event, data): state, plan, round, tokens, thread, escalation, votes, "
                   "done; the stream ends after done",
    "content": {"text/event-stream": {"schema": {"type": "string"}}}}})
async def job_events(job_id: str, who: Caller = Depends(caller), rt: ApiRuntime = Depends(runtime),
                     last_event_id: str | None = Header(None, description="resume after this event id")):
    owned(job_id, who, rt)
    start = int(last_event_id) if last_event_id and last_event_id.isdigit() else 0

    async def stream():
        last, done_sent = start, False
        while True:
            log = rt.logs.get(job_id)
            for seq, event, data in log.since(last) if log else []:
                yield f"id: {seq}\nevent: {event}\ndata: {json.dumps(data)}\n\n"
                last, done_sent = seq, done_sent or event == "done"
            job = rt.store.get(job_id)
            if job is None or (job.state in FINAL and job_id not in rt.tasks):
                if not done_sent:
                    yield f"event: done\ndata: {json.dumps({'state': job.state if job else 'expired'})}\n\n"
                return
            await asyncio.sleep(POLL_S)

    return StreamingResponse(stream(), media_type="text/event-stream")
