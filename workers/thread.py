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


@dataclass(frozen=True)
class ThreadResult:
    """What a finished thread reports (the engine's, the worker's and the pool's unit of output)."""

    problem_id: str
    sample_index: int
    text: str
    tokens: int
    answer: str | None
    mean_logprob: float
    realized_cr: float
    cr: float
    finish_reason: str  # "answer" | "eos" | "length" | "cancelled"
    preemptions: int = 0
    # Tokens processed x KV heads / KV entries held: the memory saving. realized_cr averages per-head
    # ratios instead, so heads that evict almost everything raise it more than they save memory.
    kv_cr: float = 1.0
    # The least likely token the thread chose (the model's own log-probability, whatever the temperature):
    # one near-tie decided the wrong way is how a chain of thought goes wrong, so a thread whose every
    # choice was clear-cut is the one to trust (DeepConf's "lowest confidence" signal).
    min_logprob: float = 0.0
    # Of the tokens past the window at the end, the fractions still held (layers and heads pooled): of the prompt
    # and of the thread's own tokens. What ``thinkpool kv-growth`` measures an adapter's reservation from.
    prompt_kept: float = 1.0
    generated_kept: float = 1.0
    # (p, f): of its first p own tokens past the window the thread still holds f, at each of
    # ``dms_runtime.kv_growth.CURVE_POINTS`` it reached; a token's fate is final once it leaves the window, so
    # this is what it held of its own tokens when it was that long: the growth curve reservations read.
    generated_kept_curve: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)
class Thread:
    problem_id: str
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    cr: float = 1.0
    seq: int = 0  # arrival order, set by the engine
    prefill_group: int = -1  # while running: which admission it came in with (the threads sharing its prefill)
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)
    logprob_sum: float = 0.0
    logprob_min: float = 0.0
    preemptions: int = 0
    finish_reason: str | None = None
    _in_answer: bool = False

    def __post_init__(self) -> None:
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
               kept_curve: tuple[tuple[int, float], ...] = ()) -> ThreadResult:
        text = tokenizer.decode(self.tokens, skip_special_tokens=True)
        count = len(self.tokens) + (self.finish_reason == "eos")
        mean = self.logprob_sum / count if count else -math.inf
        return ThreadResult(
            self.problem_id, self.sample_index, text, count, extract_chain_answer(text), mean, realized_cr,
            self.cr, self.finish_reason or "cancelled", self.preemptions, kv_cr, self.logprob_min, *kept, kept_curve,
        )
