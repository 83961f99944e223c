"""``WorkerPool``: ModelWorkers as Ray actors; each task pinned to the live worker with the most free KV; dead
workers noticed, reported and recovered.

Joins the cluster at ``RAY_ADDRESS`` (or the one given) or starts a local one. Workers go where Ray finds what
each asks for: a GPU where there is one (``$THINKPOOL_WORKER_GPUS``), and the custom resources named in
``$THINKPOOL_WORKER_RESOURCES`` (e.g. ``{"thinkpool_worker": 1}``: only nodes started with
``ray start --resources='{"thinkpool_worker": N}'`` host workers, N of them each). A task (all the requests that
share its ``task_id``: a controller's chunks and rounds) runs on one worker, where its prompt is held; its first
request picks the live worker with the most free KV bytes.

Recovery. Ray restarts an actor whose process or node died (``max_restarts=-1``) on a node that has its resources,
waiting until one has; an actor dead for good (killed, or its restart refused) is replaced by a new one with the
same config. :meth:`WorkerPool.health` pings every worker (bounded by ``ping_timeout_s``, the answer shared for
``health_ttl_s``): one that does not answer is down, on the node it last answered from. A request whose worker
died, or stopped answering, mid-run is sent again for the threads not yet reported, its task re-pinned to a live
worker (waiting for one, up to ``recovery_timeout_s``, while none is up). Each thread's result is yielded exactly
once: the pool keeps the set of sample indices still owed, and a thread's seed fixes its tokens, so a re-run
thread is the same thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator

import ray
import torch
from ray._private import ray_constants
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from workers.kv_budget import KVBudgetModel
from workers.records import ThreadResult, TokenProgress
from workers.runner import ThreadRunner, WorkerHealth
from workers.worker import ModelWorker, ProblemRequest, WorkerConfig, WorkerStats

WORKER_LOST = (RayActorError, ActorDiedError, ActorUnavailableError)
log = logging.getLogger(__name__)


class WorkerDown(RuntimeError):
    """A worker stopped answering pings while it owed a request results (Ray would hold the request until the
    actor is back, which may be never: its node died and no other node has its resources)."""


class NoWorkerUp(RuntimeError):
    """No worker came back within the pool's recovery timeout."""


class RayModelWorker(ModelWorker):
    """The ModelWorker a pool hosts as an actor: it also names the Ray node it runs on, for health reports."""

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


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


def worker_resources(text: str | None = None) -> dict[str, float]:
    """The custom Ray resources each worker asks for: ``$THINKPOOL_WORKER_RESOURCES``, a JSON object of positive
    amounts such as ``{"thinkpool_worker": 1}`` (``ValueError`` naming the variable otherwise)."""
    text = (os.environ.get("THINKPOOL_WORKER_RESOURCES", "") if text is None else text).strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value.values()):
        raise ValueError(f'THINKPOOL_WORKER_RESOURCES: expected a JSON object of positive amounts such as '
                         f'{{"thinkpool_worker": 1}}, got {text!r}')
    return {str(name): float(amount) for name, amount in value.items()}


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


class WorkerPool(ThreadRunner):
    def __init__(self, config: WorkerConfig | None = None, num_workers: int = 1, address: str | None = None,
                 max_retries: int = 3, resources: dict[str, float] | None = None, ping_timeout_s: float = 2.0,
                 health_ttl_s: float = 1.5, recovery_timeout_s: float = 600.0, replace_after_s: float = 10.0):
        self.config = config or WorkerConfig()
        ensure_ray(address, num_cpus=max(os.cpu_count() or 1, num_workers))
        # GPUs per actor: $THINKPOOL_WORKER_GPUS (a driver without a GPU, like the API container, placing
        # workers on GPU nodes), else one when this machine has a GPU.
        local = 1 if torch.cuda.is_available() and self.config.device in ("auto", "cuda") else 0
        gpus = float(os.environ.get("THINKPOOL_WORKER_GPUS", local))
        self.resources = worker_resources() if resources is None else dict(resources)
        # A GPU or a custom resource is what places a worker; otherwise each takes a CPU.
        options = {"max_restarts": -1, "num_cpus": 0 if gpus or self.resources else 1, "num_gpus": gpus}
        if self.resources:
            options["resources"] = self.resources
        self._actor = ray.remote(RayModelWorker).options(**options)
        self.workers = [self._actor.remote(self.config) for _ in range(num_workers)]
        ray.get([w.ping.remote() for w in self.workers])
        self._info = ray.get(self.workers[0].info.remote())
        self.budget_model = KVBudgetModel.from_dict(self._info["budget_model"])
        self.max_retries = max_retries
        self.ping_timeout_s = ping_timeout_s
        self.health_ttl_s = health_ttl_s
        self.recovery_timeout_s = recovery_timeout_s
        self.replace_after_s = replace_after_s
        self.replaced = 0  # workers replaced after dying for good
        self._pins: dict[str, int] = {}  # task id -> the worker it runs on
        self._outstanding = [0] * num_workers  # threads routed to each worker and not yet reported
        self._routed_bytes = [0] * num_workers  # what those threads (and their prompts) may reserve there
        self._cancelled: set[str] = set()  # tasks cancelled (their requests stop re-running)
        self._nodes: list[str | None] = [None] * num_workers  # the Ray node each worker last answered from
        self._replaced_at = [float("-inf")] * num_workers
        self._health: list[WorkerHealth] = []
        self._health_at = float("-inf")
        self._check: asyncio.Task | None = None  # the health check under way, shared by its callers
        self._node_table: asyncio.Task | None = None
        self._alive: dict[str, bool] = {}  # node id -> alive, from Ray's node table

    # -- health --------------------------------------------------------------------------------------
    async def health(self) -> list[WorkerHealth]:
        """Every worker's state: a ping each (at most ``ping_timeout_s``) and Ray's node table. The answer is
        reused for ``health_ttl_s`` and callers arriving meanwhile share one check, so probes cost little and a
        dead node delays an answer by the ping timeout at most."""
        if self._health and time.monotonic() - self._health_at < self.health_ttl_s:
            return self._health
        loop = asyncio.get_running_loop()
        if self._check is None or self._check.done() or self._check.get_loop() is not loop:
            self._check = loop.create_task(self._check_health())
        return await asyncio.shield(self._check)

    def _forget_health(self) -> None:
        """A request just lost its worker: the next health check pings afresh."""
        self._health_at = float("-inf")

    async def _check_health(self) -> list[WorkerHealth]:
        answers = await asyncio.gather(*(self._ping(i) for i in range(len(self.workers))), self._refresh_nodes())
        report = []
        for index, problem in enumerate(answers[:-1]):
            node = self._nodes[index]
            report.append(WorkerHealth(index, "up" if problem is None else "down", node,
                                       self._alive.get(node) if node else None, problem or ""))
        self._health, self._health_at = report, time.monotonic()
        return report

    async def _ping(self, index: int) -> str | None:
        """``None`` if worker ``index`` answered in time (noting its node), else why it is down."""
        worker = self.workers[index]
        ref = worker.node_id.remote()
        try:
            self._nodes[index] = await asyncio.wait_for(ref, self.ping_timeout_s)
            return None
        except asyncio.TimeoutError:
            cancel_quietly(ref)  # a restarting actor would otherwise get every queued ping when it is back
            return f"no answer to a ping within {self.ping_timeout_s:g} s (restarting, or no node has its resources)"
        except ActorDiedError as error:
            return self._replace(index, worker, error)
        except RayActorError:
            return "unavailable: its actor is restarting, or its node is unreachable"
        except Exception as error:  # Ray itself in trouble (its GCS unreachable): down, and say why
            return f"no answer: {type(error).__name__}: {first_line(error)}"

    def _replace(self, index: int, dead, error: BaseException) -> str:
        """Worker ``index`` is dead for good: start a new one with the same config, where Ray finds the resources."""
        if self.workers[index] is not dead:
            return "replaced; the new worker is starting"
        wait = self._replaced_at[index] + self.replace_after_s - time.monotonic()
        if wait > 0:  # its last replacement died too: not one new actor per health check
            return f"died ({first_line(error)}); replacing it in {wait:.0f} s"
        try:
            ray.kill(dead, no_restart=True)
        except Exception:  # already gone
            pass
        self.workers[index] = self._actor.remote(self.config)
        self._replaced_at[index] = time.monotonic()
        self.replaced += 1
        for task, pinned in list(self._pins.items()):
            if pinned == index:  # its held prompts died with it
                del self._pins[task]
        return f"died ({first_line(error)}); replaced, the new worker is starting"

    async def _refresh_nodes(self) -> None:
        """Ray's node table (alive or dead), read on a helper thread, one read at a time; a read that takes
        longer than a ping leaves the last known table in place."""
        loop = asyncio.get_running_loop()
        if self._node_table is None or self._node_table.done() or self._node_table.get_loop() is not loop:
            self._node_table = loop.create_task(asyncio.to_thread(ray.nodes))
        try:
            nodes = await asyncio.wait_for(asyncio.shield(self._node_table), self.ping_timeout_s)
        except Exception:  # the GCS is slow or gone: keep what we knew
            return
        self._alive = {node["NodeID"]: bool(node["Alive"]) for node in nodes}

    async def _up(self) -> list[int]:
        return [h.worker for h in await self.health() if h.state == "up"]

    # -- routing -------------------------------------------------------------------------------------
    async def _worker_stats(self, index: int) -> WorkerStats | None:
        ref = self.workers[index].stats.remote()
        try:
            return await asyncio.wait_for(ref, max(10.0, self.ping_timeout_s))
        except asyncio.TimeoutError:
            cancel_quietly(ref)
            return None
        except WORKER_LOST:
            return None

    def free_bytes(self, index: int, stats: WorkerStats) -> int:
        """Worker ``index``'s KV not yet spoken for: its pool, less what it has reserved for the threads it admitted
        or what this pool has sent it and not yet heard back about, whichever is more. The second counts a burst
        routed before the worker admitted (and so reserved memory for) any of it."""
        return stats.pool_bytes - max(stats.reserved_bytes, self._routed_bytes[index])

    async def pick(self) -> int:
        """The live worker with the most free KV bytes (ties: the fewest threads outstanding). While none is up,
        waits for one to come back, up to ``recovery_timeout_s`` (then ``NoWorkerUp``)."""
        deadline = time.monotonic() + self.recovery_timeout_s
        while True:
            up = await self._up()
            stats = await asyncio.gather(*(self._worker_stats(i) for i in up))
            free = {i: self.free_bytes(i, s) for i, s in zip(up, stats) if s is not None}
            if free:
                return max(free, key=lambda i: (free[i], -self._outstanding[i]))
            if time.monotonic() > deadline:
                down = "; ".join(h.describe() for h in self._health)
                raise NoWorkerUp(f"no worker came back within {self.recovery_timeout_s:g} s: {down}")
            await asyncio.sleep(self.health_ttl_s)

    async def pin(self, task_id: str) -> int:
        """The worker a task runs on (chosen now, if it has none)."""
        if task_id not in self._pins:
            self._pins[task_id] = await self.pick()
        return self._pins[task_id]

    def _request_bytes(self, request: ProblemRequest) -> tuple[int, int]:
        """(its prompt, each of its threads): the KV bytes a request may reserve, by the workers' budget model."""
        model, limit = self.budget_model, request.params.max_new_tokens
        try:
            return model.prompt_bytes(request.cr, len(request.prompt_ids)), model.thread_bytes(request.cr, limit)
        except KeyError:  # a ratio the workers do not serve: the worker refuses the request itself
            return 0, 0

    # -- requests ------------------------------------------------------------------------------------
    async def run(self, request: ProblemRequest, worker=None) -> AsyncIterator[ThreadResult | TokenProgress]:
        """Each thread's result as it finishes, exactly once, surviving worker and node deaths (and, when the request
        streams its tokens, the progress of the threads still owed)."""
        owed = set(request.samples)
        attempt = 0
        task = request.task
        if worker is not None:
            self._pins[task] = self.workers.index(worker)
        prompt_bytes, thread_bytes = self._request_bytes(request)
        while owed and task not in self._cancelled:
            index = await self.pin(task)
            target = self.workers[index]
            sent, routed = len(owed), prompt_bytes + thread_bytes * len(owed)
            self._outstanding[index] += sent
            self._routed_bytes[index] += routed
            stream = target.run.remote(replace(request, request_id=f"{request.request_id}/{attempt}", task_id=task,
                                               samples=tuple(sorted(owed))))
            try:
                while (ref := await self._next(stream, index)) is not None:
                    result: ThreadResult | TokenProgress = await ref
                    if isinstance(result, TokenProgress):
                        threads = tuple(t for t in result.threads if t.sample in owed)
                        if threads:
                            yield replace(result, problem_id=request.request_id, threads=threads)
                        continue
                    if result.sample in owed:
                        owed.discard(result.sample)
                        sent, routed = sent - 1, routed - thread_bytes
                        self._outstanding[index] -= 1
                        self._routed_bytes[index] -= thread_bytes
                        yield replace(result, problem_id=request.request_id)
                break  # the stream ended: done, or cancelled
            except (*WORKER_LOST, WorkerDown) as error:
                cancel_quietly(stream)
                self._forget_health()
                attempt += 1
                if attempt > self.max_retries:
                    raise
                log.warning("worker %d lost mid-request (%s: %s); re-sending the %d threads %s still owes",
                            index, type(error).__name__, first_line(error), len(owed), request.request_id)
                if self._pins.get(task) == index:  # its held prompt died with the worker: start afresh elsewhere
                    del self._pins[task]
            finally:
                self._outstanding[index] -= sent
                self._routed_bytes[index] -= routed
        if not request.keep_task:
            self._pins.pop(task, None)

    async def _next(self, stream, index: int):
        """The stream's next result (an object ref; ``None`` at its end). While waiting, the worker is checked
        every ``health_ttl_s``: one that stops answering raises ``WorkerDown``."""
        step = asyncio.ensure_future(stream.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({step}, timeout=self.health_ttl_s)
                if done:
                    try:
                        return step.result()
                    except StopAsyncIteration:
                        return None
                state = (await self.health())[index]
                if state.state != "up":
                    raise WorkerDown(state.describe())
        finally:
            if not step.done():
                step.cancel()  # waiting on a stream does not consume it: cancelling the wait is safe

    async def _call(self, index: int, method: str, *args, default=None):
        """``workers[index].method(*args)``, or ``default`` if the worker is gone or does not answer in time."""
        ref = getattr(self.workers[index], method).remote(*args)
        try:
            return await asyncio.wait_for(ref, max(10.0, self.ping_timeout_s))
        except asyncio.TimeoutError:
            cancel_quietly(ref)
            return default
        except WORKER_LOST:
            return default

    async def cancel(self, task_id: str) -> int:
        """Stop every thread of a task on its worker and free its KV; its requests end."""
        self._cancelled.add(task_id)
        index = self._pins.pop(task_id, None)
        if index is None:
            return 0
        return await self._call(index, "cancel", task_id, default=0)

    async def close_task(self, task_id: str) -> None:
        """A kept task is done: its worker frees its held prompts."""
        self._cancelled.discard(task_id)
        index = self._pins.pop(task_id, None)
        if index is not None:
            await self._call(index, "close_task", task_id)

    async def stats(self) -> list[WorkerStats | None]:
        """Each worker's stats (``None`` for one that is down)."""
        up = set(await self._up())
        return list(await asyncio.gather(*(self._worker_stats(i) if i in up else none()
                                           for i in range(len(self.workers)))))

    async def fit(self, prompt_ids: list[int], params, cr: float) -> int:
        return await self.workers[await self.pick()].fit.remote(prompt_ids, params, cr)

    async def reset_peaks(self) -> None:
        await asyncio.gather(*(self._call(i, "reset_peak") for i in await self._up()))

    def info(self) -> dict:
        return self._info | {"workers": len(self.workers)}

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)


async def none() -> None:
    return None


def cancel_quietly(ref) -> None:
    """Cancel an actor call or stream nobody waits for any more (best effort: it may be done, or its actor gone)."""
    try:
        ray.cancel(ref)
    except Exception:
        pass


def new_request_id() -> str:
    return uuid.uuid4().hex[:12]
