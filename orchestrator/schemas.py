"""The REST API's request and response bodies (pydantic): one schema for the API, the SDK and the job store."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.chain import ProblemError, parse_problem
from workers.records import ThreadResult

MAX_SAMPLES = 256


class SolveRequest(BaseModel):
    """A multi-sample solve: fixed ``samples`` threads at ratio ``cr``, or ``samples="auto"`` (the controller)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    prompt: str = Field(min_length=1, max_length=4096, description="a chain problem, e.g. a=1;b=2;c=a+b;?c")
    samples: int | Literal["auto"] = Field("auto", description="threads (1 = greedy) or 'auto' for the controller")
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

    @field_validator("samples")
    @classmethod
    def _samples_in_range(cls, value):
        if isinstance(value, int) and not 1 <= value <= MAX_SAMPLES:
            raise ValueError(f"samples must be between 1 and {MAX_SAMPLES} (or 'auto')")
        return value

    @field_validator("prompt")
    @classmethod
    def _valid_problem(cls, value: str) -> str:
        try:
            parse_problem(value.strip())
        except ProblemError as error:
            raise ValueError(str(error)) from None
        return value.strip()


class SolveResult(BaseModel):
    answer: str | None
    votes: dict[str, int]
    threads: list[ThreadResult]
    samples: int
    cr: float
    realized_cr: float
    kv_peak_bytes: int
    tokens: int
    time_s: float
    stop_reason: str | None = None
    rounds: list[dict] = Field(default_factory=list, description="the controller's plan, rounds and escalations")


JobState = Literal["queued", "running", "done", "failed", "cancelled"]


class Job(BaseModel):
    id: str
    state: JobState
    request: SolveRequest
    result: SolveResult | None = None
    error: str | None = None
    created_s: float
    updated_s: float
