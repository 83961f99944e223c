"""Sharing the workers among many tasks: the next threads go where they buy the most accuracy per KV byte.

Every controller round asks the allocator for the KV bytes its threads may grow to, with a priority: the
accuracy the round is expected to add (from the calibration profile: vote accuracy with the round's
threads minus vote accuracy without them) per byte it reserves. While the grants in force leave room, a
request is granted at once; otherwise it waits, and whenever bytes come back the waiting requests are
granted highest priority first (ties: first come). So a new task's first round (large gain: from nothing
to a few votes) goes ahead of a long-running task's tenth escalation, and a cheap high-ratio round goes
ahead of an equally useful vanilla one that costs eight times the memory.

A task's held prompt (its worker keeps it for the task's life, shared by every round) is counted with
:meth:`ThreadAllocator.hold` at once, without waiting: its first round has been granted, so its prompt is
already there. A round larger than what is free is granted alone, once no other round holds bytes (held
prompts aside), rather than never: the engine's own admission control still keeps its pool from being
overrun.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator


@dataclass(order=True)
class _Waiter:
    sort_key: tuple[float, int]
    nbytes: int = field(compare=False)
    task_id: str = field(compare=False)
    granted: asyncio.Future = field(compare=False)


class ThreadAllocator:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.in_use = 0
        self.held = 0  # of in_use: the tasks' held prompts
        self._waiting: list[_Waiter] = []
        self._arrivals = itertools.count()
        self.grants: list[str] = []  # task ids in the order they were granted (for stats and tests)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @asynccontextmanager
    async def grant(self, task_id: str, nbytes: int, priority: float) -> AsyncIterator[None]:
        """Hold ``nbytes`` of the capacity for the block; waits, by ``priority``, until they are free."""
        await self.acquire(task_id, nbytes, priority)
        try:
            yield
        finally:
            self.release(nbytes)

    async def acquire(self, task_id: str, nbytes: int, priority: float) -> None:
        waiter = _Waiter((-priority, next(self._arrivals)), nbytes, task_id, asyncio.get_running_loop().create_future())
        heapq.heappush(self._waiting, waiter)
        self._grant_waiting()
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.release(nbytes)  # granted just as it was cancelled: give the bytes back
            else:
                self._waiting.remove(waiter)
                heapq.heapify(self._waiting)
            raise

    def release(self, nbytes: int) -> None:
        self.in_use -= nbytes
        self._grant_waiting()

    def hold(self, nbytes: int) -> None:
        """Count a task's held prompt now (it exists: no waiting)."""
        self.in_use += nbytes
        self.held += nbytes

    def unhold(self, nbytes: int) -> None:
        """A task's held prompts are gone."""
        self.held -= nbytes
        self.release(nbytes)

    def _grant_waiting(self) -> None:
        """Grant from the top of the queue while the top fits (strict priority: nothing jumps a waiting
        higher-priority request, so a large useful round is not starved by a stream of small ones)."""
        while self._waiting:
            top = self._waiting[0]
            if top.granted.cancelled():
                heapq.heappop(self._waiting)
                continue
            if self.in_use + top.nbytes > self.capacity_bytes and self.in_use > self.held:
                return
            heapq.heappop(self._waiting)
            self.in_use += top.nbytes
            self.grants.append(top.task_id)
            top.granted.set_result(None)
