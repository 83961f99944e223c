"""OpenAI's API: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``; bodies in ``orchestrator/openai_schemas.py``, errors in OpenAI's shape.

A request becomes one ``SolveRequest`` with fixed samples (``n``, or thinkpool's ``samples`` to vote over; ``"auto"``
for the controller): a chat goes through the model's chat template as it is, a legacy prompt through the model's
task family. Each choice is a thread: unstreamed, the threads that reached the voted answer come first; streamed
(``stream: true``), threads ``0..n-1`` stream as they decode, as OpenAI's chunks (each naming its choice's index),
ending ``data: [DONE]``, the vote and usage in the last chunk. A client that leaves stops its threads.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from orchestrator.api_errors import openai_error, responses
from orchestrator.api_keys import Caller
from orchestrator.api_runtime import ApiRuntime, DeadlineExceeded, QueueFull
from orchestrator.openai_output import (ChoiceText, OutputFormat, TokenEntry, chat_logprobs, finish_reason,
                                        legacy_logprobs, replies_with_thinking, think_end_id)
from orchestrator.openai_schemas import (ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Completion,
                                         CompletionRequest, Model, ModelList, ThinkpoolVote, Usage)
from orchestrator.routes.route_deps import caller, runtime
from orchestrator.schemas import ChatTurn, SolveRequest, SolveResult
from workers.records import ThreadResult

router = APIRouter(tags=["openai"], responses=responses(400, 401, 413, 429, 500, openai=True))

SOLVE_FIELDS = ("samples", "cr", "kv_budget", "task", "answer_pattern", "deadline_s")


class Refused(Exception):
    """An OpenAI error answer, raised where it is found."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers

    def response(self) -> JSONResponse:
        return openai_error(self.status, str(self), self.param, self.code, self.headers)


# -- the model --------------------------------------------------------------------------------------------------
def model_card(rt: ApiRuntime) -> Model:
    info = rt.service.info
    path = Path(info["model"])
    config = path / "config.json"
    created = int(os.path.getmtime(config)) if config.is_file() else 0
    return Model(id=path.name or str(path), created=created, ratios=info["ratios"], task=info.get("task"),
                 context_length=info.get("context_length"))


def check_model(rt: ApiRuntime, name: str | None) -> str:
    """The served model's id, for a request naming it by id or by path (None: the served one); else 404."""
    card = model_card(rt)
    if name is None:
        return card.id
    served = rt.service.info["model"]
    if name in (card.id, served) or _same_path(name, served):
        return card.id
    raise Refused(404, f"The model '{name}' does not exist; this server serves '{card.id}'", "model",
                  "model_not_found")


def _same_path(name: str, served: str) -> bool:
    try:
        return Path(name).expanduser().resolve() == Path(served).resolve()
    except (OSError, ValueError, RuntimeError):
        return False


@router.get("/v1/models", dependencies=[Depends(caller)])
async def list_models(rt: ApiRuntime = Depends(runtime)) -> ModelList:
    return ModelList(data=[model_card(rt)])


@router.get("/v1/models/{model_id:path}", dependencies=[Depends(caller)], response_model=Model,
            responses=responses(404, openai=True))
async def retrieve_model(model_id: str, rt: ApiRuntime = Depends(runtime)):
    try:
        check_model(rt, model_id)
    except Refused as refused:
        return refused.response()
    return model_card(rt)


# -- requests -> SolveRequest -----------------------------------------------------------------------------------
def solve_request(body: ChatCompletionRequest | CompletionRequest, prompt: str, messages: list[ChatTurn] | None,
                  logprobs: bool, top_logprobs: int, names: dict[str, str]) -> SolveRequest:
    """The thinkpool request behind an OpenAI one; Refused (422, naming the OpenAI field) when it cannot be."""
    if body.samples == "auto" and body.n > 1:
        raise Refused(422, "n: at most 1 with samples 'auto' (the controller decides how many threads run)", "n")
    if isinstance(body.samples, int) and body.samples < body.n:
        raise Refused(422, f"n: at most samples ({body.samples}): each choice is one of the threads", "n")
    greedy = True if body.temperature == 0 or body.top_p == 0 else (False if body.temperature is not None else None)
    fields: dict[str, Any] = {name: getattr(body, name) for name in SOLVE_FIELDS if getattr(body, name) is not None}
    fields["samples"] = body.samples if body.samples is not None else body.n
    if fields["samples"] != "auto":
        fields["mode"] = "fixed"
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    try:
        # No seed: a fresh one, as OpenAI's samples differ from call to call (thinkpool's own default is 0).
        seed = body.seed if body.seed is not None else secrets.randbelow(2**62)
        return SolveRequest(prompt=prompt, messages=messages, max_tokens=max_tokens, seed=seed,
                            temperature=body.temperature, top_p=body.top_p or None, greedy=greedy, stop=body.stop,
                            logprobs=logprobs, top_logprobs=top_logprobs, **fields)
    except ValidationError as error:
        first = error.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "prompt"
        param = names.get(field, field)
        raise Refused(422, f"{param}: {first['msg']}", param, "invalid_value") from None


def checked(rt: ApiRuntime, who: Caller, request: SolveRequest, names: dict[str, str]) -> list[int]:
    """The request's model input (token ids), after the key's limits and the deployment's; Refused (422)."""
    try:
        if who.limits is not None:
            who.limits.check(request)
        return list(rt.service.prepare(request).prompt_ids)
    except ValueError as error:
        field, _, message = str(error).partition(": ")
        param = names.get(field, field)
        raise Refused(422, f"{param}: {message or error}", param, "invalid_value") from None


def start(rt: ApiRuntime, request: SolveRequest, on_event=None):
    try:
        rt.admit()
    except QueueFull as full:
        raise Refused(429, str(full), code="queue_full", headers={"Retry-After": str(full.retry_after_s)}) from None
    task_id = f"oai-{uuid.uuid4().hex[:12]}"
    return task_id, rt.start_request(request, task_id, on_event)


def fingerprint(rt: ApiRuntime) -> str:
    """OpenAI's ``system_fingerprint``: the served weights' fingerprint (same seed and fingerprint, same tokens)."""
    return f"fp_{rt.service.model_id[:16]}"


def vote(result: SolveResult) -> ThinkpoolVote:
    return ThinkpoolVote(answer=result.answer, votes=result.votes, samples=result.samples, cr=result.cr,
                         realized_cr=result.realized_cr, kv_peak_bytes=result.kv_peak_bytes, task=result.task,
                         stop_reason=result.stop_reason)


def usage(result: SolveResult) -> Usage:
    # The prompt is prefilled once for all threads, as OpenAI counts it once for n; every thread run is counted.
    return Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.tokens,
                 total_tokens=result.prompt_tokens + result.tokens)


def ranked(rt: ApiRuntime, request: SolveRequest, result: SolveResult, n: int) -> list[ThreadResult]:
    """The n choices: the threads that reached the voted answer first, then the others, each in sample order."""
    family = rt.service.family(request)
    won = [t for t in result.threads if result.answer is not None and family.same(t.answer, result.answer)]
    return (won + [t for t in result.threads if t not in won])[:n]


async def finished(task) -> SolveResult:
    try:
        return await task
    except DeadlineExceeded as error:
        raise Refused(504, str(error), "deadline_s", "deadline_exceeded") from None


async def final_choices(rt: ApiRuntime, request: SolveRequest, task, route: str, n: int,
                        fmt: OutputFormat) -> tuple[SolveResult, list[tuple[ThreadResult, str, str, list[TokenEntry]]]]:
    """Wait for a non-streamed solve and render its n ranked threads: (thread, reasoning, content, logprob entries)."""
    with rt.metrics.latency.labels(route).time():
        result = await finished(task)
    rendered = []
    for thread in ranked(rt, request, result, n):
        choice = ChoiceText(fmt)
        choice.add(thread.text, thread.token_ids, thread.token_logprobs, thread.top_logprobs)
        rendered.append((thread, *choice.delta(final=True)))
    return result, rendered


def error_event(refused: Refused | Exception) -> str:
    if not isinstance(refused, Refused):
        refused = Refused(500, f"{type(refused).__name__}: {refused}")
    body = {"error": {"message": str(refused), "type": "server_error" if refused.status >= 500 else
                      "invalid_request_error", "param": refused.param, "code": refused.code}}
    return f"data: {json.dumps(body)}\n\n"


class Streamed:
    """The events of a streaming request's solve, and the choices they build (threads 0..n-1)."""

    def __init__(self, rt: ApiRuntime, fmt: OutputFormat, n: int):
        self.rt, self.n = rt, n
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices = {index: ChoiceText(fmt) for index in range(n)}

    def on_event(self, name: str, data: dict) -> None:
        if name in ("tokens", "thread") and data.get("sample", self.n) < self.n:
            self.queue.put_nowait((name, data))

    async def events(self, task_id: str, task) -> AsyncIterator[tuple[str, Any]]:
        """("delta", (index, thinking, answer, entries, finish)) as choices grow, then ("end", result) or
        ("error", why); a reader that leaves stops the solve."""
        getter = None
        try:
            while True:
                getter = asyncio.ensure_future(self.queue.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    name, data = getter.result()
                    choice = self.choices[data["sample"]]
                    if name == "tokens":
                        choice.add(data["text"], data["ids"], data.get("logprobs", ()), data.get("top_logprobs", ()))
                        yield "delta", (data["sample"], *choice.delta(), None)
                    else:
                        yield "delta", (data["sample"], *choice.delta(final=True),
                                        finish_reason(data.get("finish_reason")))
                    continue
                getter.cancel()
                try:
                    yield "end", await finished(task)
                except Exception as error:
                    yield "error", error
                return
        finally:
            if getter is not None and not getter.done():
                getter.cancel()
            await asyncio.shield(self.rt.stop_soon(task_id, task))


def sse(payload: Any) -> str:
    return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"


# -- /v1/chat/completions -----------------------------------------------------------------------------------------
CHAT_200 = {200: {"model": ChatCompletion, "description": "the completion; with stream: true, server-sent "
                  "ChatCompletionChunk events ending data: [DONE]",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


@router.post("/v1/chat/completions", response_model=None,
             responses={**CHAT_200, **responses(404, 422, 504, openai=True)})
async def chat_completions(body: ChatCompletionRequest, who: Caller = Depends(caller),
                           rt: ApiRuntime = Depends(runtime)):
    try:
        return await _chat(body, who, rt)
    except Refused as refused:
        return refused.response()


async def _chat(body: ChatCompletionRequest, who: Caller, rt: ApiRuntime):
    model = check_model(rt, body.model)
    turns = [ChatTurn(role="system" if m.role == "developer" else m.role, content=m.text()) for m in body.messages]
    users = [t.content for t in turns if t.role == "user"]
    if not users:
        raise Refused(422, "messages: a chat needs a user message", "messages", "invalid_value")
    end_id = think_end_id(rt.service.tokenizer)
    top = body.top_logprobs or 0
    names = {"prompt": "messages", "messages": "messages", "samples": "samples" if body.samples else "n",
             "max_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
             "greedy": "temperature"}
    request = solve_request(body, users[-1], turns, body.logprobs or end_id is not None, top, names)
    prompt_ids = checked(rt, who, request, names)
    thinking = replies_with_thinking(rt.service.tokenizer, prompt_ids, end_id)
    if thinking and not request.logprobs:  # the controller's threads carry no token ids to split thinking by
        thinking = False
    fmt = OutputFormat(rt.service.tokenizer, end_id if thinking else None, tuple(body.stop or ()), top)
    completion_id, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    if body.stream:
        streamed = Streamed(rt, fmt, body.n)
        task_id, task = start(rt, request, streamed.on_event)
        return StreamingResponse(_chat_stream(streamed, task_id, task, body, model, completion_id, created,
                                              fingerprint(rt)), media_type="text/event-stream")
    _, task = start(rt, request)
    result, rendered = await final_choices(rt, request, task, "chat", body.n, fmt)
    choices = [{"index": index, "message": {"role": "assistant", "content": content,
                                            "reasoning_content": reasoning or None},
                "logprobs": {"content": chat_logprobs(entries)} if body.logprobs else None,
                "finish_reason": finish_reason(thread.finish_reason)}
               for index, (thread, reasoning, content, entries) in enumerate(rendered)]
    return ChatCompletion(id=completion_id, created=created, model=model, choices=choices, usage=usage(result),
                          system_fingerprint=fingerprint(rt), thinkpool=vote(result))


async def _chat_stream(streamed: Streamed, task_id: str, task, body: ChatCompletionRequest, model: str,
                       completion_id: str, created: int, system_fingerprint: str) -> AsyncIterator[str]:
    def chunk(choices: list[dict], **extra) -> str:
        return sse(ChatCompletionChunk(id=completion_id, created=created, model=model, choices=choices,
                                       system_fingerprint=system_fingerprint, **extra))

    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}} for i in range(body.n)])
    async with aclosing(streamed.events(task_id, task)) as events:
        async for kind, payload in events:
            if kind == "delta":
                index, reasoning, content, entries, finish = payload
                delta = {"reasoning_content": reasoning or None, "content": content or None}
                logprobs = {"content": chat_logprobs(entries)} if body.logprobs and entries else None
                if reasoning or content or logprobs:
                    yield chunk([{"index": index, "delta": delta, "logprobs": logprobs}])
                if finish is not None:
                    yield chunk([{"index": index, "delta": {}, "finish_reason": finish}])
            elif kind == "end":
                include_usage = body.stream_options is not None and body.stream_options.include_usage
                yield chunk([], usage=usage(payload) if include_usage else None, thinkpool=vote(payload))
            else:
                yield error_event(payload)
    yield "data: [DONE]\n\n"


# -- /v1/completions ----------------------------------------------------------------------------------------------
COMPLETION_200 = {200: {"model": Completion, "description": "the completion; with stream: true, server-sent "
                        "Completion chunks ending data: [DONE]",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


@router.post("/v1/completions", response_model=None,
             responses={**COMPLETION_200, **responses(404, 422, 504, openai=True)})
async def completions(body: CompletionRequest, who: Caller = Depends(caller), rt: ApiRuntime = Depends(runtime)):
    try:
        return await _completion(body, who, rt)
    except Refused as refused:
        return refused.response()


async def _completion(body: CompletionRequest, who: Caller, rt: ApiRuntime):
    model = check_model(rt, body.model)
    if body.echo and body.logprobs is not None:
        raise Refused(422, "echo: with logprobs it needs the prompt's log-probabilities, which thinkpool does not "
                      "compute; leave out one of them", "echo", "unsupported")
    names = {"samples": "samples" if body.samples else "n", "top_logprobs": "logprobs", "greedy": "temperature"}
    top = body.logprobs or 0
    request = solve_request(body, body.prompt, None, body.logprobs is not None, top, names)
    checked(rt, who, request, names)
    fmt = OutputFormat(rt.service.tokenizer, None, tuple(body.stop or ()), top)
    completion_id, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    echo = body.prompt if body.echo else ""
    if body.stream:
        streamed = Streamed(rt, fmt, body.n)
        task_id, task = start(rt, request, streamed.on_event)
        return StreamingResponse(_completion_stream(streamed, task_id, task, body, model, completion_id, created,
                                                    fingerprint(rt)), media_type="text/event-stream")
    _, task = start(rt, request)
    result, rendered = await final_choices(rt, request, task, "completions", body.n, fmt)
    choices = [{"index": index, "text": echo + text,
                "logprobs": legacy_logprobs(entries, len(echo), top > 0) if body.logprobs is not None else None,
                "finish_reason": finish_reason(thread.finish_reason)}
               for index, (thread, _, text, entries) in enumerate(rendered)]
    return Completion(id=completion_id, created=created, model=model, choices=choices, usage=usage(result),
                      system_fingerprint=fingerprint(rt), thinkpool=vote(result))


async def _completion_stream(streamed: Streamed, task_id: str, task, body: CompletionRequest, model: str,
                             completion_id: str, created: int, system_fingerprint: str) -> AsyncIterator[str]:
    offsets = {i: len(body.prompt) if body.echo else 0 for i in range(body.n)}

    def chunk(choices: list[dict], **extra) -> str:
        return sse(Completion(id=completion_id, created=created, model=model, choices=choices,
                              system_fingerprint=system_fingerprint, **extra))

    if body.echo:
        yield chunk([{"index": i, "text": body.prompt} for i in range(body.n)])
    async with aclosing(streamed.events(task_id, task)) as events:
        async for kind, payload in events:
            if kind == "delta":
                index, _, text, entries, finish = payload
                logprobs = None
                if body.logprobs is not None and entries:
                    logprobs = legacy_logprobs(entries, offsets[index], (body.logprobs or 0) > 0)
                    offsets[index] += sum(len(e.token) for e in entries)
                if text or logprobs or finish:
                    yield chunk([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}])
            elif kind == "end":
                include_usage = body.stream_options is not None and body.stream_options.include_usage
                yield chunk([], usage=usage(payload) if include_usage else None, thinkpool=vote(payload))
            else:
                yield error_event(payload)
    yield "data: [DONE]\n\n"

