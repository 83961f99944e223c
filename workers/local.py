"""``LocalPool``: one ModelWorker in this process, behind the same async interface as the Ray ``WorkerPool``.

For tests, notebooks and the in-process SDK client: no cluster, no serialization, the same engine.
"""

from __future__ import annotations

from typing import AsyncIterator

from workers.records import ThreadResult, TokenProgress
from workers.thread import SamplingParams
from workers.runner import ThreadRunner, WorkerHealth
from workers.worker import ModelWorker, ProblemRequest, WorkerConfig, WorkerStats


class LocalPool(ThreadRunner):
    def __init__(self, config: WorkerConfig | None = None):
        self.worker = ModelWorker(config)
        self.config = self.worker.config

    async def run(self, request: ProblemRequest, worker=None) -> AsyncIterator[ThreadResult | TokenProgress]:
        async for result in self.worker.run(request):
            yield result

    async def pin(self, task_id: str) -> int:
        return 0

    async def cancel(self, task_id: str) -> int:
        return await self.worker.cancel(task_id)

    async def close_task(self, task_id: str) -> None:
        await self.worker.close_task(task_id)

    async def stats(self) -> list[WorkerStats | None]:
        return [await self.worker.stats()]

    async def health(self) -> list[WorkerHealth]:
        return [WorkerHealth(0, "up")]  # in this process: up while the process is

    async def fit(self, prompt_ids: list[int], params: SamplingParams, cr: float) -> int:
        return await self.worker.fit(prompt_ids, params, cr)

    async def reset_peaks(self) -> None:
        await self.worker.reset_peak()

    def info(self) -> dict:
        return self.worker.info() | {"workers": 0}

    def shutdown(self) -> None:
        pass
