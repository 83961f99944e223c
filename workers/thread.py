"""One reasoning thread: a prompt, its own sampling parameters and DMS ratio, and the tokens it has made.

A thread is ``WAITING`` until the scheduler admits it, ``RUNNING`` while it has rows in the engine's
batch, back to ``WAITING`` when preempted (its tokens and random stream are kept; its cache is rebuilt
on resume), and ``FINISHED`` when it stops: at its answer, at EOS, at its token limit, or cancelled.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from policies.extraction import extract_chain_answer
from workers.records import ThreadResult


@dataclass(frozen=True)
class SamplingParams:
    """How a thread is decoded: ``temperature == 0`` is greedy; ``seed`` fixes its random stream."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 1536
    seed: int = 0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class StopRule:
    """Token ids that end a thread: EOS, and the first non-digit after the answer marker ``#`` and its digits."""

    eos: int
    marker: int | None = None
    digits: frozenset[int] = frozenset()

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "StopRule":
        vocab = tokenizer.get_vocab()
        digits = frozenset(vocab[d] for d in "0123456789" if d in vocab)
        marker = vocab.get("#") if len(digits) == 10 else None
        return cls(tokenizer.eos_token_id, marker, digits)


@dataclass(eq=False)
class Thread:
    problem_id: str  # the request it came in
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    cr: float = 1.0
    task_id: str = ""  # the task it belongs to (its threads share one held prompt); default: its request
    seq: int = 0  # arrival order, set by the engine
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)
    logprob_sum: float = 0.0
    logprob_min: float = 0.0
    preemptions: int = 0
    finish_reason: str | None = None
    _in_answer: bool = False

    def __post_init__(self) -> None:
        self.task_id = self.task_id or self.problem_id
        self.generator = torch.Generator().manual_seed(self.params.seed % (2**63))

    @property
    def key(self) -> tuple[str, int]:
        return self.problem_id, self.sample_index

    @property
    def total_length(self) -> int:
        return len(self.prompt_ids) + self.params.max_new_tokens

    def append(self, token: int, logprob: float, stop: StopRule) -> bool:
        """Record a sampled token; returns True when the thread has stopped."""
        self.logprob_sum += logprob
        self.logprob_min = min(self.logprob_min, logprob)
        if token == stop.eos:
            self.finish_reason = "eos"
            return True
        self.tokens.append(token)
        if self._in_answer and token not in stop.digits:
            self.finish_reason = "answer"
            return True
        if token == stop.marker:
            self._in_answer = True
        if len(self.tokens) >= self.params.max_new_tokens:
            self.finish_reason = "length"
            return True
        return False

    def result(self, tokenizer, realized_cr: float, kv_cr: float = 1.0, kept: tuple[float, float] = (1.0, 1.0),
               kept_curve: tuple[tuple[int, float], ...] = (), kv_peak_bytes: int = 0) -> ThreadResult:
        text = tokenizer.decode(self.tokens, skip_special_tokens=True)
        count = len(self.tokens) + (self.finish_reason == "eos")
        mean = self.logprob_sum / count if count else -math.inf
        return ThreadResult(
            self.problem_id, self.sample_index, text, count, extract_chain_answer(text), mean, realized_cr,
            self.cr, self.finish_reason or "cancelled", self.preemptions, kv_cr, self.logprob_min, *kept, kept_curve,
            kv_peak_bytes,
        )
