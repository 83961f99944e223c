"""``/v1/jobs/{id}``: a job's state and result, its live events (server-sent), and cancelling it. A job is seen
only by the API key that created it (404 to any other)."""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Depends, Header, HTTPException
from fastapi.responses import StreamingResponse

from orchestrator.api_errors import responses
from orchestrator.api_keys import Caller
from orchestrator.api_runtime import ApiRuntime
from orchestrator.jobs import FINAL
from orchestrator.routes.route_deps import caller, runtime
from orchestrator.schemas import Job

router = APIRouter(tags=["jobs"], responses=responses(400, 401, 404, 413, 429, 500))
POLL_S = 0.1


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
