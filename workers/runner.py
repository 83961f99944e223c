"""What every way of running threads offers on top of ``run``: collect them all, or block until done."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from workers.records import ThreadResult, TokenProgress
from workers.worker import ProblemRequest


class ThreadRunner:
    """Base of ``LocalPool`` and ``WorkerPool``: subclasses stream results (and, when a request streams its tokens,
    ``TokenProgress``) from ``run``."""

    def run(self, request: ProblemRequest, worker=None) -> AsyncIterator[ThreadResult | TokenProgress]:
        raise NotImplementedError

    async def collect(self, request: ProblemRequest, on_result: Callable[[ThreadResult], None] | None = None,
                      on_tokens: Callable[[TokenProgress], None] | None = None) -> list[ThreadResult]:
        """Every thread's result; ``on_result`` hears each as it finishes, ``on_tokens`` each batch of progress."""
        results = []
        async for item in self.run(request):
            if isinstance(item, TokenProgress):
                if on_tokens is not None:
                    on_tokens(item)
                continue
            results.append(item)
            if on_result is not None:
                on_result(item)
        return results

    def solve(self, request: ProblemRequest, on_result=None) -> list[ThreadResult]:
        """Blocking :meth:`collect` (for scripts and the CLI)."""
        return asyncio.run(self.collect(request, on_result))
