"""Every error the API answers, in one of two shapes, and their place in the OpenAPI spec.

thinkpool's routes answer ``{"detail": "why"}``, and 422 as ``{"detail": [{"loc", "msg", "type"}]}`` (the field's
path and what its limit is), whether pydantic or the service refused the request. The OpenAI routes (``/v1/chat/
completions``, ``/v1/completions``, ``/v1/models``) answer OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` for every error, 422 included (``param`` names the field). The exception handlers here pick the shape
by path, so a 401, 404, 413 or 429 raised anywhere comes out right.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "server_error", 504: "timeout_error"}


class ErrorBody(BaseModel):
    """thinkpool's error body."""

    detail: str


class ValidationIssue(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorBody(BaseModel):
    """thinkpool's 422 body: each refused field's path (``["body", "samples"]``) and what its limit is."""

    detail: list[ValidationIssue]


class OpenAIErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """OpenAI's error body, on every error of the OpenAI routes."""

    error: OpenAIErrorInfo


def is_openai(path: str) -> bool:
    return path.startswith(OPENAI_PATHS)


def unprocessable(field: str, message: str) -> JSONResponse:
    """thinkpool's 422 for a request the service refused (``ValueError("field: message")``)."""
    issue = {"loc": ["body", *field.split(".")], "msg": message, "type": "value_error"}
    return JSONResponse(status_code=422, content={"detail": [issue]})


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": OPENAI_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}
    return JSONResponse(status_code=status, content=body, headers=headers)


def error_response(path: str, status: int, message: str, headers: dict[str, str] | None = None,
                   code: str | None = None) -> JSONResponse:
    """An error in the shape of the route at ``path``."""
    if is_openai(path):
        return openai_error(status, message, code=code, headers=headers)
    return JSONResponse(status_code=status, content={"detail": message}, headers=headers)


# How pydantic names the branch of a union (``stop.list[constrained-str]``) in an error's path: not a field.
UNION_BRANCH = re.compile(r"^(?:str|int|float|bool|list|dict|none|[\w-]+\[.*\]|constrained-\w+|function-\w+.*)$")
TYPE_MISMATCH = ("literal_error", "none_required", "is_instance_of", "model_type", "model_attributes_type")


def _issues(error: RequestValidationError) -> list[dict[str, Any]]:
    """pydantic's errors as ``{loc, msg, type}``, their paths naming fields only; for a field that may be one of
    several types (a union), the errors of the type the value has come first."""
    issues = [{"loc": [p for p in e["loc"] if isinstance(p, int) or not UNION_BRANCH.match(str(p))], "msg": e["msg"],
               "type": e["type"]} for e in error.errors()]
    return sorted(issues, key=lambda e: e["type"].endswith("_type") or e["type"] in TYPE_MISMATCH)


async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    detail = error.detail if isinstance(error.detail, str) else str(error.detail)
    headers = dict(error.headers or {})
    if error.status_code == 405:  # Allow: every method of the path (its routes each know only their own)
        headers["Allow"] = ", ".join(allowed_methods(request))
    return error_response(request.url.path, error.status_code, detail, headers)


def allowed_methods(request: Request) -> list[str]:
    methods = set()
    for route in request.app.router.routes:
        if isinstance(route, Route) and route.matches(request.scope)[0] != Match.NONE:
            methods |= set(route.methods or ()) - {"HEAD"}
    return sorted(methods)


async def on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    issues = _issues(error)
    if not is_openai(request.url.path):
        return JSONResponse(status_code=422, content={"detail": issues})
    first = issues[0] if issues else {"loc": [], "msg": "invalid request"}
    path = [str(p) for p in first["loc"] if p != "body"]
    param = ".".join(path) or None
    return openai_error(422, f"{param}: {first['msg']}" if param else first["msg"], param, "invalid_value")


def responses(*statuses: int, openai: bool = False) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for these error statuses, in the route family's shape."""
    model = OpenAIErrorBody if openai else ErrorBody
    described = {
        400: "the body is not UTF-8 (bodies are UTF-8 JSON)",
        401: "missing or unknown API key",
        404: "no such job or model (or not this key's)",
        413: "the body is over the size limit (limits.max_body_bytes), chunked or not",
        422: "invalid request: names the field and its limit",
        429: "rate limit of this key, or the queue is full (retry after Retry-After seconds)",
        500: "the solve failed, or a store it needs (Redis) did not answer: the message says what",
        504: "deadline_s passed before the work finished",
    }
    entries: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": model, "description": described[status]}
        if status == 422 and not openai:
            entry["model"] = ValidationErrorBody
        if status == 429:
            entry["headers"] = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
        entries[status] = entry
    return entries
