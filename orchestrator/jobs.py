"""The job store: accepted solve requests and their results, in memory or in Redis (``$REDIS_URL``).

A job is written before it is acknowledged, so a job accepted before a crash is found again by
``unfinished()`` when the API restarts, and is then run to a final state. A job belongs to the API key that
created it (``owner``, the key's id): only that key sees it. Finished results are cached by the request's
content (problem and configuration, not the ``async`` flag or the deadline), the owner and the served model's
identity (its weights' fingerprint): the same request from the same key to the same model is answered from the
store; another key, or a retrained or other model, never answers from another's results. A finished job (and
its cache entry) expires ``ttl_s`` after it finished; an unfinished one is kept until it finishes.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque

import redis

from orchestrator.schemas import Job, SolveRequest

FINAL = ("done", "failed", "cancelled", "timed_out")
DEFAULT_TTL_S = 86400.0
RECENT_JOBS = 1000  # jobs an owner's listing reaches back to


def cache_key(request: SolveRequest, model_id: str, owner: str | None = None) -> str:
    body = request.model_dump_json(exclude={"run_async", "deadline_s"})
    return hashlib.sha256(f"{model_id}\n{owner or ''}\n{body}".encode()).hexdigest()[:24]


class MemoryJobStore:
    def __init__(self, model_id: str = "", ttl_s: float = DEFAULT_TTL_S):
        self.model_id, self.ttl_s = model_id, ttl_s
        self._jobs: dict[str, Job] = {}
        self._cache: dict[str, str] = {}
        self._cached_as: dict[str, str] = {}  # job id -> its cache key
        self._expiring: deque[tuple[float, str]] = deque()  # (when, job id), in the order jobs finished

    def save(self, job: Job) -> Job:
        self._expire()
        job.updated_s = time.time()
        self._jobs[job.id] = job.model_copy(deep=True)
        if job.state in FINAL:
            self._expiring.append((job.updated_s + self.ttl_s, job.id))
        if job.state == "done":
            key = cache_key(job.request, self.model_id, job.owner)
            self._cache[key], self._cached_as[job.id] = job.id, key
        return job

    def get(self, job_id: str) -> Job | None:
        self._expire()
        job = self._jobs.get(job_id)
        return job.model_copy(deep=True) if job else None

    def unfinished(self) -> list[Job]:
        return [j.model_copy(deep=True) for j in self._jobs.values() if j.state not in FINAL]

    def recent(self, owner: str | None, limit: int = RECENT_JOBS) -> list[Job]:
        """``owner``'s jobs, newest first (at most ``limit``)."""
        self._expire()
        mine = sorted((j for j in self._jobs.values() if j.owner == owner), key=lambda j: j.created_s, reverse=True)
        return [j.model_copy(deep=True) for j in mine[:limit]]

    def cached(self, request: SolveRequest, owner: str | None = None) -> Job | None:
        job_id = self._cache.get(cache_key(request, self.model_id, owner))
        return self.get(job_id) if job_id else None

    def _expire(self) -> None:
        now = time.time()
        while self._expiring and self._expiring[0][0] <= now:
            _, job_id = self._expiring.popleft()
            job = self._jobs.get(job_id)
            if job is not None and job.state in FINAL and job.updated_s + self.ttl_s <= now:
                del self._jobs[job_id]
                key = self._cached_as.pop(job_id, None)
                if key is not None and self._cache.get(key) == job_id:
                    del self._cache[key]


class RedisJobStore:
    def __init__(self, url: str, prefix: str = "thinkpool:jobs", model_id: str = "", ttl_s: float = DEFAULT_TTL_S):
        self.client = redis.Redis.from_url(url)
        self.prefix = prefix
        self.model_id, self.ttl_s = model_id, ttl_s

    def save(self, job: Job) -> Job:
        job.updated_s = time.time()
        final = job.state in FINAL
        expire_ms = max(1, int(self.ttl_s * 1000)) if final else None
        pipe = self.client.pipeline(transaction=True)
        pipe.set(f"{self.prefix}:job:{job.id}", job.model_dump_json(by_alias=True), px=expire_ms)
        if final:
            pipe.srem(f"{self.prefix}:unfinished", job.id)
        else:
            pipe.sadd(f"{self.prefix}:unfinished", job.id)
        if job.state == "done":
            pipe.set(f"{self.prefix}:cache:{cache_key(job.request, self.model_id, job.owner)}", job.id, px=expire_ms)
        listing = self._listing(job.owner)
        pipe.zadd(listing, {job.id: job.created_s}, nx=True)
        pipe.zremrangebyrank(listing, 0, -RECENT_JOBS - 1)  # the newest RECENT_JOBS only
        pipe.execute()
        return job

    def _listing(self, owner: str | None) -> str:
        return f"{self.prefix}:owner:{owner or ''}"

    def recent(self, owner: str | None, limit: int = RECENT_JOBS) -> list[Job]:
        """``owner``'s jobs, newest first (at most ``limit``); ids whose job expired leave the listing here."""
        listing = self._listing(owner)
        ids = [i.decode() for i in self.client.zrevrange(listing, 0, limit - 1)]
        jobs = [self.get(i) for i in ids]
        expired = [i for i, job in zip(ids, jobs) if job is None]
        if expired:
            self.client.zrem(listing, *expired)
        return [job for job in jobs if job is not None]

    def get(self, job_id: str) -> Job | None:
        raw = self.client.get(f"{self.prefix}:job:{job_id}")
        return Job.model_validate_json(raw) if raw else None

    def unfinished(self) -> list[Job]:
        ids = sorted(i.decode() for i in self.client.smembers(f"{self.prefix}:unfinished"))
        return [job for job in (self.get(i) for i in ids) if job is not None]

    def cached(self, request: SolveRequest, owner: str | None = None) -> Job | None:
        job_id = self.client.get(f"{self.prefix}:cache:{cache_key(request, self.model_id, owner)}")
        return self.get(job_id.decode()) if job_id else None


def make_job_store(model_id: str = "", ttl_s: float = DEFAULT_TTL_S):
    """Redis when ``$REDIS_URL`` is set, else in memory; results cached for the model ``model_id``; finished jobs
    kept ``ttl_s`` seconds."""
    url = os.environ.get("REDIS_URL")
    return RedisJobStore(url, model_id=model_id, ttl_s=ttl_s) if url else MemoryJobStore(model_id, ttl_s)
