"""What the API's routes share: the service, the job store, the running jobs and their events, the key gate, and
the bounded queue.

Work is admitted only while fewer than ``limits.max_active_jobs`` solves (jobs queued or running, and OpenAI
requests in flight) are under way; beyond that a request gets 429 with ``Retry-After`` (the recent mean solve
time) instead of waiting without end. A request's ``deadline_s`` counts from its acceptance: past it, its threads
are stopped (their KV freed) and a job ends ``timed_out``. Each job's events (its state, the controller's plan and
rounds, its threads' tokens, each finished thread, the vote) are kept for replay with sequence numbers, so a
reader that joins late, or reconnects with ``Last-Event-ID``, misses nothing; a minute after a job finishes its
``tokens`` events are dropped (its result holds every thread's text), and the streams of only the most recent
finished jobs are kept.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from orchestrator.api_keys import Caller, KeyGate
from orchestrator.schemas import Job, SolveRequest, SolveResult
from orchestrator.settings import LimitSettings

KEEP_FINISHED_STREAMS = 256  # finished jobs whose event stream can still be replayed
COMPACT_AFTER_S = 60.0  # a finished job's tokens events are kept this long for readers still catching up
RECENT = 100  # solves the Retry-After estimate and the realized-CR gauge look back on


class QueueFull(Exception):
    def __init__(self, active: int, retry_after_s: int):
        super().__init__(f"queue full: {active} solves queued or running (limits.max_active_jobs); retry in "
                         f"{retry_after_s} s")
        self.retry_after_s = retry_after_s


class DeadlineExceeded(Exception):
    pass


@dataclass
class EventLog:
    """One job's events in order, each with its sequence number."""

    events: list[tuple[int, str, dict]] = field(default_factory=list)

    def since(self, seq: int) -> list[tuple[int, str, dict]]:
        return self.events[bisect.bisect_right(self.events, seq, key=lambda e: e[0]):]


class ApiMetrics:
    """The Prometheus registry of one app: request latency, and the workers' pool and engine figures."""

    GAUGES = {
        "pool_bytes": "KV pool size (bytes)", "pool_used_bytes": "KV bytes in use",
        "pool_peak_bytes": "KV high-water mark",
        "threads_running": "threads decoding", "threads_waiting": "threads queued",
        "tokens_per_s": "engine tokens per second", "realized_cr": "mean realized compression of recent threads",
        "engine_busy_seconds": "time the engines spent stepping, all workers",
        "active_solves": "solves queued or running (jobs and OpenAI requests)"}

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram("thinkpool_request_seconds", "solve request latency", ["route"],
                                 registry=self.registry)
        self.gauges = {name: Gauge(f"thinkpool_{name}", help_, registry=self.registry)
                       for name, help_ in self.GAUGES.items()}

    def render(self, stats: list, recent_cr: list[float], active: int) -> bytes:
        values = {
            "pool_bytes": sum(s.pool_bytes for s in stats), "pool_used_bytes": sum(s.pool_used_bytes for s in stats),
            "pool_peak_bytes": max((s.pool_peak_bytes for s in stats), default=0),
            "threads_running": sum(s.running for s in stats), "threads_waiting": sum(s.waiting for s in stats),
            "tokens_per_s": sum(s.tokens_per_s for s in stats), "engine_busy_seconds": sum(s.busy_s for s in stats),
            "realized_cr": sum(recent_cr) / len(recent_cr) if recent_cr else 0, "active_solves": active}
        for name, value in values.items():
            self.gauges[name].set(value)
        return generate_latest(self.registry)


class ApiRuntime:
    def __init__(self, limits: LimitSettings, gate: KeyGate):
        self.limits, self.gate = limits, gate
        self.metrics = ApiMetrics()
        self.service = None  # set when the app starts (the workers load then)
        self.store = None
        self.logs: dict[str, EventLog] = {}
        self.finished: list[str] = []
        self.tasks: dict[str, asyncio.Task] = {}
        self.cancelling: set[str] = set()
        self.requests: dict[str, asyncio.Task] = {}  # OpenAI requests under way (jobs are counted by their tasks)
        self.recent_s: list[float] = []
        self.recent_cr: list[float] = []
        self._seq = 0
        self._stopping: set[asyncio.Task] = set()
        self._compacting: deque[tuple[float, str]] = deque()  # (when, job id): finished jobs with tokens events

    # -- admission -----------------------------------------------------------------------------------
    @property
    def active(self) -> int:
        return len(self.tasks) + len(self.requests)

    def admit(self) -> None:
        """QueueFull when the queue is at ``limits.max_active_jobs``."""
        if self.active >= self.limits.max_active_jobs:
            raise QueueFull(self.active, self.retry_after_s())

    def retry_after_s(self) -> int:
        mean = sum(self.recent_s) / len(self.recent_s) if self.recent_s else 1.0
        return min(60, max(1, math.ceil(mean)))

    def start_request(self, request: SolveRequest, task_id: str,
                      on_event: Callable[[str, dict], None] | None = None) -> asyncio.Task:
        """Run an OpenAI request's solve as a task counted in the queue until it ends (admit first); whoever
        reads it stops it with :meth:`stop` when its client leaves."""
        task = asyncio.get_event_loop().create_task(self.solve(request, task_id, time.time(), on_event))
        self.requests[task_id] = task
        task.add_done_callback(lambda _: self.requests.pop(task_id, None))
        return task

    def record(self, result: SolveResult, seconds: float) -> None:
        self.recent_cr = (self.recent_cr + [result.realized_cr])[-RECENT:]
        self.recent_s = (self.recent_s + [seconds])[-RECENT:]

    # -- solving within a deadline -------------------------------------------------------------------
    async def solve(self, request: SolveRequest, task_id: str, accepted_s: float,
                    on_event: Callable[[str, dict], None] | None = None, stream_tokens: bool = True) -> SolveResult:
        """``service.solve``, stopped at ``request.deadline_s`` after ``accepted_s`` (DeadlineExceeded): its threads
        stop on their worker and free their KV before this returns."""
        started = time.time()
        work: Awaitable[SolveResult] = self.service.solve(request, job_id=task_id, on_event=on_event,
                                                          stream_tokens=stream_tokens)
        if request.deadline_s is None:
            result = await work
        else:
            result = await self._within(work, task_id, accepted_s + request.deadline_s - time.time(),
                                        request.deadline_s)
        self.record(result, time.time() - started)
        return result

    async def _within(self, work: Awaitable[SolveResult], task_id: str, seconds: float, deadline_s: float):
        task = asyncio.ensure_future(work)
        try:
            done, _ = await asyncio.wait({task}, timeout=max(0.0, seconds))
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        if task in done:
            return task.result()
        await self.service.cancel(task_id)  # every thread stops now and frees its KV; the solve then ends
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise DeadlineExceeded(f"deadline_s: not finished within {deadline_s:g} s of its acceptance")

    async def stop(self, task_id: str, task: asyncio.Task) -> None:
        """Stop a running solve: its threads on their worker first (their KV is free when this returns), then it."""
        if not task.done():
            await self.service.cancel(task_id)
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def stop_soon(self, task_id: str, task: asyncio.Task) -> asyncio.Task:
        """:meth:`stop` as a task of its own: a reader whose client left is cancelled itself (again at every await,
        under Starlette), yet its solve must still be stopped."""
        stopper = asyncio.ensure_future(self.stop(task_id, task))
        self._stopping.add(stopper)
        stopper.add_done_callback(self._stopping.discard)
        return stopper

    # -- jobs ----------------------------------------------------------------------------------------
    def publish(self, job_id: str, event: str, data: dict) -> None:
        self._seq += 1
        self.logs.setdefault(job_id, EventLog()).events.append((self._seq, event, data))
        if event == "done":
            now = time.monotonic()
            self.finished.append(job_id)
            self._compacting.append((now, job_id))
            while self._compacting and self._compacting[0][0] < now - COMPACT_AFTER_S:
                log = self.logs.get(self._compacting.popleft()[1])
                if log is not None:  # a reader has had its time: the result holds the threads' text
                    log.events = [e for e in log.events if e[1] != "tokens"]
            while len(self.finished) > KEEP_FINISHED_STREAMS:
                self.logs.pop(self.finished.pop(0), None)

    def job_for(self, job_id: str, caller: Caller) -> Job | None:
        """The job, if it exists and belongs to this caller's key (None: not found, to anyone else)."""
        job = self.store.get(job_id)
        if job is None or job.owner != caller.key_id:
            return None
        return job

    def start_job(self, job: Job) -> asyncio.Task:
        task = self.tasks[job.id] = asyncio.get_event_loop().create_task(self.run_job(job))
        return task

    async def run_job(self, job: Job) -> None:
        job.state = "running"
        self.store.save(job)
        self.publish(job.id, "state", {"state": "running"})
        try:
            # A synchronous request's id is told only with its result: nobody can read its tokens as they come.
            result = await self.solve(job.request, job.id, job.created_s,
                                      lambda name, data: self.publish(job.id, name, data), job.request.run_async)
            if job.id in self.cancelling:
                raise asyncio.CancelledError
            job.result, job.state = result, "done"
            self.publish(job.id, "votes", {"votes": result.votes, "answer": result.answer})
        except asyncio.CancelledError:
            job.state = "cancelled"
        except DeadlineExceeded as error:
            job.state, job.error = "timed_out", str(error)
        except Exception as error:  # a failed job is reported, with why; never silently lost
            job.state, job.error = "failed", f"{type(error).__name__}: {error}"
        self.store.save(job)
        self.publish(job.id, "done", {"state": job.state})
        self.tasks.pop(job.id, None)
        self.cancelling.discard(job.id)
