"""The REST API's request and response bodies (pydantic): one schema for the API, the SDK and the job store."""

from __future__ import annotations

import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator

from tasks.families import FAMILIES, MAX_PROMPT_CHARS
from workers.records import ThreadResult

MAX_SAMPLES = 256
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_DEADLINE_S = 24 * 3600
# What the samples validator checks, in the OpenAPI schema too (a union's bounds are not derived from a validator).
StopString = Annotated[str, Field(min_length=1, max_length=200)]
SAMPLES_SCHEMA = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_SAMPLES},
                            {"const": "auto", "type": "string"}]}


def _kinds(annotation: Any) -> set:
    """The plain types a field's annotation admits (through Annotated, unions and literals)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _kinds(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return set().union(*(_kinds(arg) for arg in get_args(annotation)))
    if origin is Literal:
        return {type(arg) for arg in get_args(annotation)}
    return {origin or annotation}


class JsonBody(BaseModel):
    """A request body read as its schema says: a JSON scalar of the wrong type (``true`` or ``"5"`` for a number,
    ``1`` for a boolean) is refused, not converted as pydantic's lax mode would (its strict mode would also refuse
    ``5.0`` for an integer, which JSON Schema allows)."""

    @field_validator("*", mode="before")
    @classmethod
    def _scalars_as_typed(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, (bool, int, float, str)) and info.field_name in cls.model_fields:
            kinds = _kinds(cls.model_fields[info.field_name].annotation)
            scalars = kinds & {bool, int, float, str}
            given = type(value)
            number = given in (int, float) and bool(kinds & {int, float})  # pydantic then checks 5.5 for an int
            if scalars and given not in kinds and not number:
                raise ValueError(f"must be {' or '.join(sorted({JSON_NAMES[k] for k in scalars}))}, not "
                                 f"{JSON_NAMES[given]}")
        return value


JSON_NAMES = {bool: "a boolean", int: "a number", float: "a number", str: "a string"}


class ChatTurn(JsonBody):
    """One message of a chat (``messages``): the model's chat template turns the chat into model input."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_PROMPT_CHARS)


class SolveRequest(JsonBody):
    """A multi-sample solve: fixed ``samples`` threads at ratio ``cr``, or ``samples="auto"`` (the controller)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS,
                        description="the problem: a chain problem (a=1;b=2;c=a+b;?c) or free text, by its task")
    task: str | None = Field(None, description=f"task family: {', '.join(FAMILIES)} (default: the model's, from its "
                                               "directory's thinkpool.json)")
    answer_pattern: str | None = Field(None, max_length=1000, description="the regex task's answer pattern (the last "
                                                                          "match's first group is the answer)")
    samples: Annotated[int | Literal["auto"], WithJsonSchema(SAMPLES_SCHEMA)] = Field(
        "auto", description="threads (1 = greedy) or 'auto' for the controller")
    cr: float | None = Field(None, ge=1, le=64, description="DMS compression ratio (fixed samples only; default 1)")
    kv_budget: int | None = Field(None, gt=0, description="KV bytes the threads may hold at once (default: the pool)")
    max_tokens: int | None = Field(None, ge=1, le=8192, description="token limit per thread")
    temperature: float | None = Field(None, ge=0, le=5)
    seed: int = Field(0, ge=0, lt=2**62)
    max_threads: int = Field(32, ge=1, le=MAX_SAMPLES, description="threads the controller may run in all")
    mode: Literal["controller", "fixed"] | None = Field(
        None, description="controller: it picks ratio and threads; fixed: exactly `samples` threads (default: "
                          "controller when samples is 'auto')")
    run_async: bool = Field(False, alias="async", description="answer 202 with a job id at once")
    messages: list[ChatTurn] | None = Field(
        None, min_length=1, max_length=256,
        description="a chat, through the model's chat template as it is (default: the prompt as the task family "
                    "formats it); `prompt` is then the problem the answer belongs to (its last user message)")
    stop: list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS,
                                          description=f"up to {MAX_STOP_STRINGS} strings that end a thread")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling (default: the model's, else 1)")
    greedy: bool | None = Field(None, description="true: every thread takes the most likely token; false: every "
                                                  "thread samples (default: one thread is greedy, more sample)")
    logprobs: bool = Field(False, description="threads report their token ids and each token's log-probability")
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS,
                              description="and the most likely tokens at each position (fixed samples)")
    deadline_s: float | None = Field(None, gt=0, le=MAX_DEADLINE_S,
                                     description="seconds from acceptance after which the work is stopped and the job "
                                                 "is timed_out")

    @field_validator("stop")
    @classmethod
    def _no_empty_list(cls, value: list[str] | None) -> list[str] | None:
        return value or None

    @field_validator("samples")
    @classmethod
    def _samples_in_range(cls, value):
        if isinstance(value, int) and not 1 <= value <= MAX_SAMPLES:
            raise ValueError(f"samples must be between 1 and {MAX_SAMPLES} (or 'auto')")
        return value

    @field_validator("prompt")
    @classmethod
    def _stripped(cls, value: str) -> str:
        """Only the shape here: the prompt is checked against its task family (``family.validate``) by the
        service, which knows the model's default family when ``task`` is not given."""
        if not value.strip():
            raise ValueError("must not be empty")
        return value.strip()

    @field_validator("task")
    @classmethod
    def _known_task(cls, value: str | None) -> str | None:
        if value is not None and value not in FAMILIES:
            raise ValueError(f"unknown task family {value!r}; known: {', '.join(FAMILIES)}")
        return value

    @field_validator("answer_pattern")
    @classmethod
    def _a_regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as error:
                raise ValueError(f"not a regular expression ({error})") from None
        return value


class SolveResult(BaseModel):
    answer: str | None
    task: str = "chain"  # the task family the answer was read and compared by
    votes: dict[str, int]
    threads: list[ThreadResult]
    samples: int
    cr: float
    realized_cr: float
    kv_peak_bytes: int
    tokens: int
    prompt_tokens: int = 0  # the model input's tokens (chat template included)
    time_s: float
    stop_reason: str | None = None
    rounds: list[dict] = Field(default_factory=list, description="the controller's plan, rounds and escalations")


JobState = Literal["queued", "running", "done", "failed", "cancelled", "timed_out"]


class Job(BaseModel):
    id: str
    state: JobState
    request: SolveRequest
    result: SolveResult | None = None
    error: str | None = None
    created_s: float
    updated_s: float
    owner: str | None = Field(None, description="the API key's id (a hash) that created the job; only it sees it")
