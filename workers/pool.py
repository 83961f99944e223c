"""``WorkerPool``: ModelWorkers as Ray actors; each task pinned to the worker that had the most room for it.

Joins the cluster at ``RAY_ADDRESS`` (or the one given) or starts a local one. A task (all the requests that
share its ``task_id``: a controller's chunks and rounds) runs on one worker, where its prompt is held; the
first request of a task picks the live worker with the fewest threads outstanding. Actors restart when they
die (``max_restarts=-1``); a request whose worker died mid-run is sent again, re-pinning its task to
whichever worker then has the most room, for the threads not yet reported. Each thread's result is yielded
exactly once: the pool keeps the set of sample indices still owed, and a thread's seed fixes its tokens, so
a re-run thread is the same thread.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import replace
from typing import AsyncIterator

import ray
import torch
from ray._private import ray_constants
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from workers.records import ThreadResult, TokenProgress
from workers.runner import ThreadRunner
from workers.worker import ModelWorker, ProblemRequest, WorkerConfig, WorkerStats

WORKER_LOST = (RayActorError, ActorDiedError, ActorUnavailableError)


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to ``address`` / ``$RAY_ADDRESS``, or start a local Ray instance in-process, on loopback only."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        # Ray renices its workers by default; next to any other busy process a reniced model worker
        # starves (a 25x slower actor was measured here), so local workers run at normal priority.
        os.environ.setdefault("RAY_worker_niceness", "0")
        # This instance is this process's alone: node address 127.0.0.1 binds every Ray port (GCS, raylet, object
        # manager, workers, agents) to loopback. Ray turns "127.0.0.1" into the machine's outward address while its
        # cluster mode is on (the default on Linux), so it is off while this node starts.
        cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
        ray_constants.ENABLE_RAY_CLUSTER = False
        try:
            ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                     _node_ip_address="127.0.0.1")
        finally:
            ray_constants.ENABLE_RAY_CLUSTER = cluster_mode


class WorkerPool(ThreadRunner):
    def __init__(self, config: WorkerConfig | None = None, num_workers: int = 1, address: str | None = None, max_retries: int = 3):
        self.config = config or WorkerConfig()
        ensure_ray(address, num_cpus=max(os.cpu_count() or 1, num_workers))
        # GPUs per actor: $THINKPOOL_WORKER_GPUS (a driver without a GPU, like the API container, placing
        # workers on GPU nodes), else one when this machine has a GPU.
        local = 1 if torch.cuda.is_available() and self.config.device in ("auto", "cuda") else 0
        gpus = float(os.environ.get("THINKPOOL_WORKER_GPUS", local))
        actor = ray.remote(ModelWorker).options(max_restarts=-1, num_cpus=0 if gpus else 1, num_gpus=gpus)
        self.workers = [actor.remote(self.config) for _ in range(num_workers)]
        ray.get([w.ping.remote() for w in self.workers])
        self.max_retries = max_retries
        self._pins: dict[str, int] = {}  # task id -> the worker it runs on
        self._outstanding = [0] * num_workers  # threads routed to each worker and not yet reported
        self._cancelled: set[str] = set()  # tasks cancelled (their requests stop re-running)

    # -- routing -------------------------------------------------------------------------------------
    async def _worker_stats(self, worker) -> WorkerStats | None:
        try:
            return await asyncio.wait_for(worker.stats.remote(), timeout=30)
        except (asyncio.TimeoutError, *WORKER_LOST):
            return None

    async def pick(self) -> int:
        """The live worker with the fewest threads outstanding from this pool (ties: the most unreserved KV).

        Outstanding counts are kept here because a burst of requests is routed before any worker has
        admitted (and so reserved memory for) the previous ones."""
        stats = await asyncio.gather(*(self._worker_stats(w) for w in self.workers))
        alive = [i for i, s in enumerate(stats) if s is not None]
        if not alive:
            return 0  # all restarting: queue on the first; Ray delivers once it is back
        return min(alive, key=lambda i: (self._outstanding[i], stats[i].reserved_bytes - stats[i].pool_bytes))

    async def pin(self, task_id: str) -> int:
        """The worker a task runs on (chosen now, if it has none)."""
        if task_id not in self._pins:
            self._pins[task_id] = await self.pick()
        return self._pins[task_id]

    # -- requests ------------------------------------------------------------------------------------
    async def run(self, request: ProblemRequest, worker=None) -> AsyncIterator[ThreadResult | TokenProgress]:
        """Each thread's result as it finishes, exactly once, surviving worker deaths (and, when the request streams
        its tokens, the progress of the threads still owed)."""
        owed = set(request.samples)
        attempt = 0
        task = request.task
        if worker is not None:
            self._pins[task] = self.workers.index(worker)
        while owed and task not in self._cancelled:
            index = await self.pin(task)
            target = self.workers[index]
            sub_id = f"{request.request_id}/{attempt}"
            sent = len(owed)
            self._outstanding[index] += sent
            try:
                async for ref in target.run.remote(replace(request, request_id=sub_id, task_id=task, samples=tuple(sorted(owed)))):
                    result: ThreadResult | TokenProgress = await ref
                    if isinstance(result, TokenProgress):
                        threads = tuple(t for t in result.threads if t.sample in owed)
                        if threads:
                            yield replace(result, problem_id=request.request_id, threads=threads)
                        continue
                    if result.sample in owed:
                        owed.discard(result.sample)
                        self._outstanding[index] -= 1
                        sent -= 1
                        yield replace(result, problem_id=request.request_id)
                break  # the stream ended: done, or cancelled
            except WORKER_LOST:
                attempt += 1
                if attempt > self.max_retries:
                    raise
                if self._pins.get(task) == index:  # its held prompt died with the worker: start afresh elsewhere
                    del self._pins[task]
            finally:
                self._outstanding[index] -= sent
        if not request.keep_task:
            self._pins.pop(task, None)

    async def cancel(self, task_id: str) -> int:
        """Stop every thread of a task on its worker and free its KV; its requests end."""
        self._cancelled.add(task_id)
        index = self._pins.pop(task_id, None)
        if index is None:
            return 0
        try:
            return await self.workers[index].cancel.remote(task_id)
        except WORKER_LOST:
            return 0

    async def close_task(self, task_id: str) -> None:
        """A kept task is done: its worker frees its held prompts."""
        self._cancelled.discard(task_id)
        index = self._pins.pop(task_id, None)
        if index is not None:
            try:
                await self.workers[index].close_task.remote(task_id)
            except WORKER_LOST:
                pass

    async def stats(self) -> list[WorkerStats | None]:
        return list(await asyncio.gather(*(self._worker_stats(w) for w in self.workers)))

    async def fit(self, prompt_ids: list[int], params, cr: float) -> int:
        return await self.workers[0].fit.remote(prompt_ids, params, cr)

    async def reset_peaks(self) -> None:
        await asyncio.gather(*(w.reset_peak.remote() for w in self.workers))

    def info(self) -> dict:
        return ray.get(self.workers[0].info.remote()) | {"workers": len(self.workers)}

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)


def new_request_id() -> str:
    return uuid.uuid4().hex[:12]
