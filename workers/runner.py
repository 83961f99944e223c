"""What every way of running threads offers on top of ``run``: collect them all, or block until done; and the
shape of a worker's health report."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import AsyncIterator, Callable, Literal

from workers.records import ThreadResult, TokenProgress
from workers.worker import ProblemRequest


@dataclass(frozen=True)
class WorkerHealth:
    """One worker as the last health check saw it: ``up`` (it answered a ping in time) or ``down`` (its process
    or its Ray node died, it is being restarted, or it did not answer), with the Ray node it runs or last ran on
    (``None`` in-process) and whether Ray still counts that node alive."""

    worker: int
    state: Literal["up", "down"]
    node: str | None = None
    node_alive: bool | None = None
    detail: str = ""

    def describe(self) -> str:
        where = "" if self.node is None else f" on Ray node {self.node}"
        where += " (dead)" if self.node_alive is False else ""
        return f"worker {self.worker}{where} is {self.state}" + (f": {self.detail}" if self.detail else "")

    def as_dict(self) -> dict:
        return asdict(self)


class ThreadRunner:
    """Base of ``LocalPool`` and ``WorkerPool``: subclasses stream results (and, when a request streams its tokens,
    ``TokenProgress``) from ``run``."""

    def run(self, request: ProblemRequest, worker=None) -> AsyncIterator[ThreadResult | TokenProgress]:
        raise NotImplementedError

    async def health(self) -> list[WorkerHealth]:
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
