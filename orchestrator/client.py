"""The Python SDK: ``Client`` (HTTP, sync and async, retries with backoff) and ``LocalClient`` (in-process).

Both return typed :class:`~orchestrator.schemas.SolveResult` objects:

    from orchestrator import Client
    client = Client("http://127.0.0.1:8000", api_key="...")
    result = client.solve("a=7;b=42;c=a+b;d=c*a;e=d-b;?e", samples=16)
    print(result.answer, result.votes)

A request names its task family with ``task=`` (``"math"``, ``"regex"`` with ``answer_pattern=``; default: the
model's). ``LocalClient.solve(..., verifier=check)`` picks the best of the threads' answers by your
``check(problem, answer) -> bool | float`` (best-of-N) instead of the majority.

``solve_tool(client)`` wraps either one as a LangChain tool for a LangGraph agent.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from orchestrator.schemas import Job, SolveRequest, SolveResult
from policies.voting import Verifier

RETRY_STATUS = {429, 502, 503, 504}


class ClientError(RuntimeError):
    """A request the service refused (the message carries its reason) or a service that stayed unreachable."""


class Client:
    def __init__(self, url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 4, backoff_s: float = 0.5):
        self.url = url.rstrip("/")
        self.headers = {"X-API-Key": api_key} if api_key else {}
        self.timeout, self.retries, self.backoff_s = timeout, retries, backoff_s

    # -- sync ----------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        response = None
        for attempt in range(self.retries + 1):
            try:
                response = httpx.request(method, self.url + path, headers=self.headers, timeout=self.timeout, **kwargs)
                if response.status_code not in RETRY_STATUS:
                    return _checked(response)
            except httpx.TransportError as error:
                if attempt == self.retries:
                    raise ClientError(f"{self.url} unreachable: {error}") from error
            if attempt < self.retries:
                time.sleep(self._wait_s(response, attempt))
        return _checked(response)

    def _wait_s(self, response: httpx.Response | None, attempt: int) -> float:
        """The server's ``Retry-After`` (a full queue, a rate limit), else exponential backoff."""
        retry_after = response.headers.get("retry-after", "") if response is not None else ""
        return float(retry_after) if retry_after.isdigit() else self.backoff_s * 2**attempt

    def solve(self, prompt: str, **options) -> SolveResult:
        body = SolveRequest(prompt=prompt, **options).model_dump(by_alias=True, exclude_none=True)
        return SolveResult.model_validate(self._request("POST", "/v1/solve", json=body).json())

    def submit(self, prompt: str, **options) -> str:
        body = SolveRequest(prompt=prompt, **options).model_dump(by_alias=True, exclude_none=True) | {"async": True}
        return self._request("POST", "/v1/solve", json=body).json()["id"]

    def job(self, job_id: str) -> Job:
        return Job.model_validate(self._request("GET", f"/v1/jobs/{job_id}").json())

    def cancel(self, job_id: str) -> Job:
        return Job.model_validate(self._request("DELETE", f"/v1/jobs/{job_id}").json())

    # -- async ---------------------------------------------------------------------------------------
    async def _arequest(self, method: str, path: str, **kwargs) -> httpx.Response:
        response = None
        async with httpx.AsyncClient(headers=self.headers, timeout=self.timeout) as http:
            for attempt in range(self.retries + 1):
                try:
                    response = await http.request(method, self.url + path, **kwargs)
                    if response.status_code not in RETRY_STATUS:
                        return _checked(response)
                except httpx.TransportError as error:
                    if attempt == self.retries:
                        raise ClientError(f"{self.url} unreachable: {error}") from error
                if attempt < self.retries:
                    await asyncio.sleep(self._wait_s(response, attempt))
        return _checked(response)

    async def asolve(self, prompt: str, **options) -> SolveResult:
        body = SolveRequest(prompt=prompt, **options).model_dump(by_alias=True, exclude_none=True)
        return SolveResult.model_validate((await self._arequest("POST", "/v1/solve", json=body)).json())


def _checked(response: httpx.Response) -> httpx.Response:
    if response.status_code >= 400:
        raise ClientError(f"{response.status_code}: {response.text}")
    return response


class LocalClient:
    """The same interface with the service in this process (no server)."""

    def __init__(self, model: str | None = None, kv_budget: int | None = None):
        from dms_runtime.loading import default_model_path
        from orchestrator.service import service_factory

        self.service = service_factory(model or default_model_path(), kv_budget, 0)()

    def solve(self, prompt: str, verifier: Verifier | None = None, **options) -> SolveResult:
        return asyncio.run(self.asolve(prompt, verifier, **options))

    async def asolve(self, prompt: str, verifier: Verifier | None = None, **options) -> SolveResult:
        """``verifier(problem, answer)`` (a Python callable, so in-process only) scores each distinct answer once;
        the best wins (ties: the more frequent)."""
        return await self.service.solve(SolveRequest(prompt=prompt, **options), verifier=verifier)


def solve_tool(client):
    """A LangChain tool (for a LangGraph agent) that solves a chain problem with many threads."""
    from langchain_core.tools import tool

    @tool
    def solve_chain_problem(problem: str, samples: int = 8) -> str:
        """Solve a chain arithmetic problem such as 'a=7;b=42;c=a+b;?c' by majority vote of sampled reasoning threads."""
        result = client.solve(problem, samples=samples)
        return f"answer {result.answer} (votes {result.votes})"

    return solve_chain_problem
