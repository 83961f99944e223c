"""The REST service (``thinkpool serve``): FastAPI over one ``SolveService``.

Routes: ``POST /v1/solve`` (sync, or ``"async": true`` -> 202 and a job id), ``GET/DELETE /v1/jobs/{id}``,
``GET /v1/jobs/{id}/events`` (server-sent events), OpenAI-style ``POST /v1/completions`` and
``GET /v1/models``, ``/healthz``, ``/readyz``, ``/metrics`` (Prometheus). Jobs are saved before they are
acknowledged; on start-up, jobs left unfinished by a previous process are run again. When API keys are
configured (``THINKPOOL_API_KEYS=key1,key2``) every route but the health checks needs one, compared in
constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, generate_latest
from pydantic import BaseModel, Field, ValidationError

from orchestrator.jobs import make_job_store
from orchestrator.schemas import Job, SolveRequest, SolveResult
from tasks.families import MAX_PROMPT_CHARS

MAX_BODY_BYTES = 64 * 1024
KEEP_FINISHED_STREAMS = 256  # finished jobs whose event stream can still be replayed


class CompletionRequest(BaseModel):
    """OpenAI's completion body (the fields thinkpool reads); the prompt is read by the model's task family."""

    model: str | None = None
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    n: int = Field(1, ge=1, le=256)
    max_tokens: int | None = Field(None, ge=1, le=8192)
    temperature: float | None = Field(None, ge=0, le=5)
    seed: int = Field(0, ge=0)


@dataclass(frozen=True)
class KeyLimits:
    """What one API key may ask for (``THINKPOOL_API_KEYS=key[:max_samples[:max_kv_budget]],...``)."""

    max_samples: int | None = None
    max_kv_budget: int | None = None

    def check(self, body: SolveRequest) -> None:
        samples = 1 if body.samples == "auto" else body.samples
        if self.max_samples is not None and samples > self.max_samples:
            raise ValueError(f"samples: at most {self.max_samples} for this API key")
        if self.max_kv_budget is not None and (body.kv_budget is None or body.kv_budget > self.max_kv_budget):
            raise ValueError(f"kv_budget: at most {self.max_kv_budget} bytes for this API key (set it explicitly)")


def parse_keys(text: str) -> dict[str, KeyLimits]:
    keys = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, *limits = item.split(":")
        numbers = [int(x) if x else None for x in limits] + [None, None]
        keys[key] = KeyLimits(numbers[0], numbers[1])
    return keys


def create_app(service_factory, store=None) -> FastAPI:
    """``service_factory()`` builds the SolveService at start-up (the workers load then, not at import)."""
    registry = CollectorRegistry()
    latency = Histogram("thinkpool_request_seconds", "solve request latency", ["route"], registry=registry)
    gauges = {name: Gauge(f"thinkpool_{name}", help_, registry=registry) for name, help_ in {
        "pool_bytes": "KV pool size (bytes)", "pool_used_bytes": "KV bytes in use", "pool_peak_bytes": "KV high-water mark",
        "threads_running": "threads decoding", "threads_waiting": "threads queued", "tokens_per_s": "engine tokens per second",
        "realized_cr": "mean realized compression of recent threads",
        "engine_busy_seconds": "time the engines spent stepping, all workers"}.items()}
    state: dict = {"events": {}, "tasks": {}, "recent_cr": [], "finished": [], "cancelling": set()}
    keys = parse_keys(os.environ.get("THINKPOOL_API_KEYS", ""))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["service"] = await asyncio.to_thread(service_factory)
        state["store"] = store or make_job_store(state["service"].model_id)
        state["store"].model_id = state["service"].model_id
        for job in state["store"].unfinished():  # accepted before a restart: finish it now
            start_job(job)
        yield
        state["service"].pool.shutdown()

    app = FastAPI(title="thinkpool", version="0.1", lifespan=lifespan)

    async def authorized(request: Request) -> KeyLimits | None:
        if not keys:
            return None
        given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        found = None
        for key, limits in keys.items():  # every key compared, in constant time each
            if hmac.compare_digest(given.encode(), key.encode()):
                found = limits
        if found is None:
            raise HTTPException(status_code=401, detail="missing or unknown API key (X-API-Key or Authorization: Bearer)")
        return found

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            return JSONResponse(status_code=413, content={"detail": f"request body over {MAX_BODY_BYTES} bytes"})
        return await call_next(request)

    def publish(job_id: str, event: str, data: dict) -> None:
        state["events"].setdefault(job_id, []).append((event, data))
        if event == "done":  # keep the streams of the most recent finished jobs only
            state["finished"].append(job_id)
            while len(state["finished"]) > KEEP_FINISHED_STREAMS:
                state["events"].pop(state["finished"].pop(0), None)

    def record(result: SolveResult) -> None:
        state["recent_cr"] = (state["recent_cr"] + [result.realized_cr])[-100:]

    async def run_job(job: Job) -> None:
        store = state["store"]
        job.state = "running"
        store.save(job)
        publish(job.id, "state", {"state": "running"})
        try:
            result = await state["service"].solve(job.request, job_id=job.id,
                                                  on_event=lambda name, data: publish(job.id, name, data))
            if job.id in state["cancelling"]:
                raise asyncio.CancelledError
            job.result, job.state = result, "done"
            record(job.result)
            publish(job.id, "votes", {"votes": job.result.votes, "answer": job.result.answer})
        except asyncio.CancelledError:
            job.state = "cancelled"
        except Exception as error:  # a failed job is reported, with why; never silently lost
            job.state, job.error = "failed", f"{type(error).__name__}: {error}"
        store.save(job)
        publish(job.id, "done", {"state": job.state})
        state["tasks"].pop(job.id, None)
        state["cancelling"].discard(job.id)

    def start_job(job: Job) -> None:
        state["tasks"][job.id] = asyncio.get_event_loop().create_task(run_job(job))

    def unprocessable(field: str, message: str) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": [{"loc": ["body", field], "msg": message, "type": "value_error"}]})

    @app.post("/v1/solve", response_model=None, responses={
        200: {"model": SolveResult, "description": "the result (synchronous request)"},
        202: {"description": "accepted: {id, state} (with \"async\": true)"},
        422: {"description": "invalid request: detail names the field and the limit"}})
    async def solve(body: SolveRequest, limits: KeyLimits | None = Depends(authorized)):
        service, store = state["service"], state["store"]
        try:
            if limits is not None:
                limits.check(body)
            service.check(body)
        except ValueError as error:
            field, _, message = str(error).partition(": ")
            return unprocessable(field, message or str(error))
        cached = store.cached(body)
        if cached is not None and cached.result is not None:
            return JSONResponse(status_code=202, content={"id": cached.id, "state": "done"}) if body.run_async else cached.result
        now = time.time()
        job = store.save(Job(id=uuid.uuid4().hex[:12], state="queued", request=body, created_s=now, updated_s=now))
        publish(job.id, "state", {"state": "queued"})
        if body.run_async:
            start_job(job)
            return JSONResponse(status_code=202, content={"id": job.id, "state": "queued"})
        with latency.labels("solve").time():
            start_job(job)
            await state["tasks"][job.id]
        job = store.get(job.id)
        if job.state != "done":
            raise HTTPException(status_code=500, detail=job.error or job.state)
        return job.result

    @app.get("/v1/jobs/{job_id}", dependencies=[Depends(authorized)])
    async def get_job(job_id: str) -> Job:
        job = state["store"].get(job_id)
        if job is None:
            raise HTTPException(status_code=404, detail=f"no job {job_id}")
        return job

    @app.delete("/v1/jobs/{job_id}", dependencies=[Depends(authorized)])
    async def cancel_job(job_id: str) -> Job:
        job = state["store"].get(job_id)
        if job is None:
            raise HTTPException(status_code=404, detail=f"no job {job_id}")
        task = state["tasks"].get(job_id)
        if task is not None:
            state["cancelling"].add(job_id)
            await state["service"].cancel(job_id)  # every thread of the job stops on its worker; its KV is free
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return state["store"].get(job_id)

    @app.get("/v1/jobs/{job_id}/events", dependencies=[Depends(authorized)])
    async def job_events(job_id: str):
        if state["store"].get(job_id) is None:
            raise HTTPException(status_code=404, detail=f"no job {job_id}")

        async def stream():
            sent = 0
            while True:
                events = state["events"].get(job_id, [])
                for event, data in events[sent:]:
                    yield f"event: {event}\ndata: {json.dumps(data)}\n\n"
                sent = len(events)
                job = state["store"].get(job_id)
                if job.state in ("done", "failed", "cancelled") and job_id not in state["tasks"]:
                    if not any(e == "done" for e, _ in events):
                        yield f"event: done\ndata: {json.dumps({'state': job.state})}\n\n"
                    return
                await asyncio.sleep(0.1)

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest):
        try:
            request = SolveRequest(prompt=body.prompt, samples=body.n, max_tokens=body.max_tokens,
                                   temperature=body.temperature, seed=body.seed)
            state["service"].check(request)
        except ValidationError as error:
            return JSONResponse(status_code=422, content={"detail": [
                {"loc": ["body", *map(str, e["loc"])], "msg": e["msg"], "type": e["type"]} for e in error.errors()]})
        except ValueError as error:
            field, _, message = str(error).partition(": ")
            return unprocessable(field, message or str(error))
        with latency.labels("completions").time():
            result = await state["service"].solve(request)
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion", "created": int(time.time()),
            "model": body.model or state["service"].info["model"],
            "choices": [{"index": t.sample, "text": t.text,
                         "finish_reason": "length" if t.finish_reason == "length" else "stop", "logprobs": None}
                        for t in result.threads],
            # The prompt is prefilled once for all n threads, as OpenAI counts it once.
            "usage": {"completion_tokens": result.tokens, "prompt_tokens": result.prompt_tokens,
                      "total_tokens": result.tokens + result.prompt_tokens},
        }

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        info = state["service"].info
        return {"object": "list", "data": [{"id": os.path.basename(info["model"].rstrip("/")), "object": "model",
                                            "owned_by": "thinkpool", "ratios": info["ratios"],
                                            "task": info.get("task")}]}

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz", responses={
        503: {"description": "starting, or a worker or its Ray node is down: the body says which"}})
    async def readyz():
        """Ready when every worker answers (a ping each, bounded, the answer shared for a second or two)."""
        if "service" not in state:
            return JSONResponse(status_code=503, content={"status": "starting"})
        workers = await state["service"].pool.health()
        down = [w for w in workers if w.state != "up"]
        body = {"status": "unavailable" if down else "ready", "workers": [w.as_dict() for w in workers]}
        if down:
            return JSONResponse(status_code=503, content=body | {"detail": "; ".join(w.describe() for w in down)})
        return body

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics():
        stats = [s for s in await state["service"].pool.stats() if s is not None]
        gauges["pool_bytes"].set(sum(s.pool_bytes for s in stats))
        gauges["pool_used_bytes"].set(sum(s.pool_used_bytes for s in stats))
        gauges["pool_peak_bytes"].set(max((s.pool_peak_bytes for s in stats), default=0))
        gauges["threads_running"].set(sum(s.running for s in stats))
        gauges["threads_waiting"].set(sum(s.waiting for s in stats))
        gauges["tokens_per_s"].set(sum(s.tokens_per_s for s in stats))
        gauges["engine_busy_seconds"].set(sum(s.busy_s for s in stats))
        recent = state["recent_cr"]
        gauges["realized_cr"].set(sum(recent) / len(recent) if recent else 0)
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
