"""The job store: accepted solve requests and their results, in memory or in Redis (``$REDIS_URL``).

A job is written before it is acknowledged, so a job accepted before a crash is found again by
``unfinished()`` when the API restarts, and is then run to a final state. Finished results are cached
by the request's content (problem and configuration, not the ``async`` flag) and the served model's
identity (its weights' fingerprint): the same request to the same model is answered from the store, and a
retrained or other model never answers from another's results.
"""

from __future__ import annotations

import hashlib
import os
import time

import redis

from orchestrator.schemas import Job, SolveRequest

FINAL = ("done", "failed", "cancelled")


def cache_key(request: SolveRequest, model_id: str) -> str:
    body = request.model_dump_json(exclude={"run_async"})
    return hashlib.sha256(f"{model_id}\n{body}".encode()).hexdigest()[:24]


class MemoryJobStore:
    def __init__(self, model_id: str = ""):
        self.model_id = model_id
        self._jobs: dict[str, Job] = {}
        self._cache: dict[str, str] = {}

    def save(self, job: Job) -> Job:
        job.updated_s = time.time()
        self._jobs[job.id] = job.model_copy(deep=True)
        if job.state == "done":
            self._cache[cache_key(job.request, self.model_id)] = job.id
        return job

    def get(self, job_id: str) -> Job | None:
        job = self._jobs.get(job_id)
        return job.model_copy(deep=True) if job else None

    def unfinished(self) -> list[Job]:
        return [j.model_copy(deep=True) for j in self._jobs.values() if j.state not in FINAL]

    def cached(self, request: SolveRequest) -> Job | None:
        job_id = self._cache.get(cache_key(request, self.model_id))
        return self.get(job_id) if job_id else None


class RedisJobStore:
    def __init__(self, url: str, prefix: str = "thinkpool:jobs", model_id: str = ""):
        self.client = redis.Redis.from_url(url)
        self.prefix = prefix
        self.model_id = model_id

    def save(self, job: Job) -> Job:
        job.updated_s = time.time()
        pipe = self.client.pipeline(transaction=True)
        pipe.set(f"{self.prefix}:job:{job.id}", job.model_dump_json(by_alias=True))
        if job.state in FINAL:
            pipe.srem(f"{self.prefix}:unfinished", job.id)
        else:
            pipe.sadd(f"{self.prefix}:unfinished", job.id)
        if job.state == "done":
            pipe.set(f"{self.prefix}:cache:{cache_key(job.request, self.model_id)}", job.id)
        pipe.execute()
        return job

    def get(self, job_id: str) -> Job | None:
        raw = self.client.get(f"{self.prefix}:job:{job_id}")
        return Job.model_validate_json(raw) if raw else None

    def unfinished(self) -> list[Job]:
        ids = sorted(i.decode() for i in self.client.smembers(f"{self.prefix}:unfinished"))
        return [job for job in (self.get(i) for i in ids) if job is not None]

    def cached(self, request: SolveRequest) -> Job | None:
        job_id = self.client.get(f"{self.prefix}:cache:{cache_key(request, self.model_id)}")
        return self.get(job_id.decode()) if job_id else None


def make_job_store(model_id: str = ""):
    """Redis when ``$REDIS_URL`` is set, else in memory; results cached for the model ``model_id``."""
    url = os.environ.get("REDIS_URL")
    return RedisJobStore(url, model_id=model_id) if url else MemoryJobStore(model_id)
