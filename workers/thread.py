"""One reasoning thread: a prompt, its own sampling parameters and DMS ratio, and the tokens it has made.

A thread is ``WAITING`` until the scheduler admits it, ``RUNNING`` while it has rows in the engine's
batch, back to ``WAITING`` when preempted (its tokens are kept, and its random stream, which is its seed and
its token count (:func:`~workers.sampler.counter_uniforms`), goes on where it stopped; its cache is rebuilt
on resume), and ``FINISHED`` when it stops: at its answer, at EOS, at a stop string, at its token limit, or
cancelled. How it stops and what its answer is belong to its task family (``tasks/families.py``): the chain
family's ``#`` rule works on token ids, as it always has; a thread of any family stops at one of its stop
strings (the family's own and the caller's).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tasks.families import ChainFamily, TaskFamily
from workers.records import ThreadResult

CHAIN = ChainFamily()


@dataclass(frozen=True)
class SamplingParams:
    """How a thread is decoded: ``temperature == 0`` is greedy; ``seed`` fixes its random stream; ``top_k`` 0 and
    ``min_p`` 0 are off (a model's ``generation_config.json`` may set them, as Qwen3's does). ``logprobs``: the
    thread reports its token ids and each one's log-probability (the model's own, whatever the temperature);
    ``top_logprobs`` k > 0: also the k most likely tokens at each position (OpenAI's ``top_logprobs``)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 1536
    seed: int = 0
    top_k: int = 0
    min_p: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class StopRule:
    """What ends a thread: ``eos`` or any of ``extra_eos`` (every EOS id of ``generation_config.json``); for the
    chain family, the first non-digit after the answer marker ``#`` and its digits; for any family, a stop string
    in the text (``decode`` turns token ids into text; only the last few tokens are decoded, once per token)."""

    eos: int | None
    marker: int | None = None
    digits: frozenset[int] = frozenset()
    extra_eos: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = field(default=None, compare=False)

    @classmethod
    def for_tokenizer(cls, tokenizer, family: TaskFamily | None = None, eos_ids: Iterable[int] = ()) -> "StopRule":
        """The rule of ``family`` (default: the chain family) with this tokenizer. Only the chain family stops
        at ``#`` and its digits: a Qwen tokenizer has single-character digits too, and "#1" is not its answer."""
        family = family or CHAIN
        extra = frozenset(eos_ids) - {tokenizer.eos_token_id}
        stops = tuple(family.stop_strings)  # a family's own, and a caller's (OpenAI's ``stop``), for any family
        decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if stops else None
        if family.name == "chain":
            vocab = tokenizer.get_vocab()
            digits = frozenset(vocab[d] for d in "0123456789" if d in vocab)
            marker = vocab.get("#") if len(digits) == 10 else None
            return cls(tokenizer.eos_token_id, marker, digits, extra, stops, decode)
        return cls(tokenizer.eos_token_id, extra_eos=extra, stop_strings=stops, decode=decode)

    def is_eos(self, token: int) -> bool:
        return token == self.eos or token in self.extra_eos

    def hit_stop_string(self, tokens: list[int]) -> bool:
        """Whether the text now ends inside a stop string: the last ``len(stop) + 2`` tokens hold any stop
        string that the newest token completed (a token decodes to at least one character)."""
        if not self.stop_strings or self.decode is None:
            return False
        tail = self.decode(tokens[-(max(map(len, self.stop_strings)) + 2):])
        return any(stop in tail for stop in self.stop_strings)


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
    family: TaskFamily = CHAIN  # how its answer is read
    stop: StopRule | None = None  # how it stops (None: the engine's rule, the chain family's)
    _in_answer: bool = False
    # With ``params.logprobs``: each token's log-probability and (``top_logprobs``) the most likely alternatives.
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    reported: int = 0  # tokens already reported as progress (``Engine.progress``)

    def __post_init__(self) -> None:
        self.task_id = self.task_id or self.problem_id

    @property
    def key(self) -> tuple[str, int]:
        return self.problem_id, self.sample_index

    @property
    def total_length(self) -> int:
        return len(self.prompt_ids) + self.params.max_new_tokens

    def append(self, token: int, logprob: float, stop: StopRule | None = None,
               top: tuple[tuple[int, float], ...] = ()) -> bool:
        """Record a sampled token (``top``: the most likely alternatives, when asked); returns True when the thread
        has stopped (``stop``: its own rule by default)."""
        stop = stop or self.stop
        self.logprob_sum += logprob
        self.logprob_min = min(self.logprob_min, logprob)
        if stop.is_eos(token):
            self.finish_reason = "eos"
            return True
        self.tokens.append(token)
        if self.params.logprobs:
            self.token_logprobs.append(logprob)
            self.top_logprobs.append(top)
        if self._in_answer and token not in stop.digits:
            self.finish_reason = "answer"
            return True
        if token == stop.marker:
            self._in_answer = True
        if stop.hit_stop_string(self.tokens):
            self.finish_reason = "stop"
            return True
        if len(self.tokens) >= self.params.max_new_tokens:
            self.finish_reason = "length"
            return True
        return False

    def result(self, tokenizer, realized_cr: float, kv_cr: float = 1.0, kept: tuple[float, float] = (1.0, 1.0),
               kept_curve: tuple[tuple[int, float], ...] = (), kv_peak_bytes: int = 0) -> ThreadResult:
        text = tokenizer.decode(self.tokens, skip_special_tokens=True)
        count = len(self.tokens) + (self.finish_reason == "eos")
        mean = self.logprob_sum / count if count else -math.inf
        details = ((tuple(self.tokens), tuple(self.token_logprobs), tuple(self.top_logprobs))
                   if self.params.logprobs else ())
        return ThreadResult(
            self.problem_id, self.sample_index, text, count, self.family.extract(text), mean, realized_cr,
            self.cr, self.finish_reason or "cancelled", self.preemptions, kv_cr, self.logprob_min, *kept, kept_curve,
            kv_peak_bytes, *details,
        )
