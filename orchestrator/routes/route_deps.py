"""What every route depends on: the shared runtime, and the caller (authenticated and counted against its rate
limit) as FastAPI dependencies; and the bounded queue's refusal as a 429."""

from __future__ import annotations

from fastapi import HTTPException, Request

from orchestrator.api_keys import Caller, RateLimited, Unauthorized
from orchestrator.api_runtime import ApiRuntime, QueueFull


def runtime(request: Request) -> ApiRuntime:
    return request.app.state.runtime


def caller(request: Request) -> Caller:
    """The caller's key (``X-API-Key`` or ``Authorization: Bearer``): 401 when keys are configured and it is not
    one of them, 429 with ``Retry-After`` past its rate limit."""
    given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    try:
        return runtime(request).gate.admit(given, request.client.host if request.client else "")
    except Unauthorized as error:
        raise HTTPException(status_code=401, detail=str(error), headers={"WWW-Authenticate": "Bearer"}) from None
    except RateLimited as error:
        raise HTTPException(status_code=429, detail=str(error),
                            headers={"Retry-After": str(error.retry_after_s)}) from None


def admit(runtime: ApiRuntime) -> None:
    """New work enters the queue, or 429 with ``Retry-After`` when it is full."""
    try:
        runtime.admit()
    except QueueFull as error:
        raise HTTPException(status_code=429, detail=str(error),
                            headers={"Retry-After": str(error.retry_after_s)}) from None
