"""OpenAI's request and response bodies, as thinkpool serves them (``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``), with thinkpool's own knobs beside OpenAI's fields.

An OpenAI client sends thinkpool's knobs in ``extra_body``, which arrives as top-level fields: ``samples`` (threads
to vote over, or ``"auto"`` for the controller), ``cr``, ``kv_budget``, ``task``, ``answer_pattern``,
``deadline_s``. The vote comes back in the ``thinkpool`` field of a response (a stream's last chunk): the voted
answer, the votes, the threads run, their compression and the KV peak. Fields OpenAI has and thinkpool does not
implement are refused (422 naming them), not ignored; the penalties are accepted at 0 only.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator

from orchestrator.schemas import (MAX_DEADLINE_S, MAX_SAMPLES, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, SAMPLES_SCHEMA,
                                  JsonBody, StopString)
from tasks.families import FAMILIES, MAX_PROMPT_CHARS

MAX_TOKENS = 8192
OPTIONAL_SAMPLES = {"anyOf": [*SAMPLES_SCHEMA["anyOf"], {"type": "null"}]}
MAX_LEGACY_LOGPROBS = 5  # OpenAI's limit for /v1/completions


class ContentPart(JsonBody):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class ChatMessage(JsonBody):
    """A message of the chat: text, or text parts (``developer`` is read as ``system``)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | list[ContentPart] | None = None
    name: str | None = Field(None, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class StreamOptions(JsonBody):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class ThinkpoolOptions(JsonBody):
    """thinkpool's knobs (an OpenAI client sends them in ``extra_body``)."""

    samples: Annotated[int | Literal["auto"] | None, WithJsonSchema(OPTIONAL_SAMPLES)] = Field(
        None, description="threads to run and vote over (at least n; default n), or 'auto' for the controller")
    cr: float | None = Field(None, ge=1, le=64, description="DMS compression ratio")
    kv_budget: int | None = Field(None, gt=0, description="KV bytes the threads may hold at once")
    task: str | None = Field(None, description=f"task family: {', '.join(FAMILIES)} (default: the model's)")
    answer_pattern: str | None = Field(None, max_length=1000, description="the regex task's answer pattern")
    deadline_s: float | None = Field(None, gt=0, le=MAX_DEADLINE_S, description="stop the work after this long")

    @field_validator("samples")
    @classmethod
    def _samples_in_range(cls, value):
        if isinstance(value, int) and not 1 <= value <= MAX_SAMPLES:
            raise ValueError(f"samples must be between 1 and {MAX_SAMPLES} (or 'auto')")
        return value


class _Sampling(ThinkpoolOptions):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, max_length=4096, description="the served model's id (default: it)")
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**62)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"up to {MAX_STOP_STRINGS} strings; the text ends before the first")
    frequency_penalty: float | None = Field(None, ge=0, le=0, description="thinkpool applies no penalties: 0 only")
    presence_penalty: float | None = Field(None, ge=0, le=0, description="thinkpool applies no penalties: 0 only")
    user: str | None = Field(None, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        return ([value] if isinstance(value, str) else value) or None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="as max_tokens (wins over it)")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="needs logprobs: true")

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value


class CompletionRequest(_Sampling):
    """The legacy completion: the prompt is the problem, formatted by the model's task family (the chat template
    for a chat model, the chain format for a chain model)."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    logprobs: int | None = Field(None, ge=0, le=MAX_LEGACY_LOGPROBS,
                                 description="the log-probability of each token and of the most likely ones")
    echo: bool = Field(False, description="the prompt before the generated text")


# -- responses ----------------------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int = Field(description="the model input's tokens (chat template included), counted once for n")
    completion_tokens: int
    total_tokens: int


class ThinkpoolVote(BaseModel):
    """The extension field ``thinkpool``: what the threads voted."""

    answer: str | None = Field(description="the voted answer (by the task family: the last \\boxed{} for math)")
    votes: dict[str, int]
    samples: int = Field(description="threads run")
    cr: float
    realized_cr: float
    kv_peak_bytes: int
    task: str
    stop_reason: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(None, description="a thinking model's thinking (before </think>)")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    thinkpool: ThinkpoolVote | None = None


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (``data: {...}``; the stream ends ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    thinkpool: ThinkpoolVote | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(BaseModel):
    """A completion, or (``object`` the same) one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    thinkpool: ThinkpoolVote | None = None


class Model(BaseModel):
    id: str = Field(description="the model directory's base name")
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "thinkpool"
    ratios: list[float] = Field(description="DMS compression ratios served (1: none)")
    task: str | None = Field(None, description="the model's default task family")
    context_length: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
