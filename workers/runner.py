"""What every way of running threads offers on top of ``run``: collect them all, or block until done."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from workers.records import ThreadResult
from workers.worker import ProblemRequest


class ThreadRunner:
    """Base of ``LocalPool`` and ``WorkerPool``: subclasses stream results from ``run``."""

    def run(self, request: ProblemRequest, worker=None) -> AsyncIterator[ThreadResult]:
        raise NotImplementedError

    async def collect(self, request: ProblemRequest, on_result=None) -> list[ThreadResult]:
        results = []
        async for result in self.run(request):
            results.append(result)
            if on_result is not None:
                on_result(result)
        return results

    def solve(self, request: ProblemRequest, on_result=None) -> list[ThreadResult]:
        """Blocking :meth:`collect` (for scripts and the CLI)."""
        return asyncio.run(self.collect(request, on_result))
