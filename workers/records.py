"""The thread record: what a finished thread reports, from the engine to the API (plain data, no torch), so the
HTTP SDK and the job store read it without loading a model stack; and the progress of running threads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadResult:
    """What a finished thread reports: the one thread record, from the engine through the pool, the controller
    and the service to the API's response (where every field is also a JSON key)."""

    problem_id: str  # the request it came in
    sample: int  # its index among its task's threads (seeds derive from it)
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
    # The most KV bytes this thread's task (all its threads, rounds and held prompt) held at once, up to when it
    # finished: the largest over a task's threads is the request's own KV peak.
    kv_peak_bytes: int = 0
    # Only when its sampling parameters ask (``logprobs``): the generated token ids (no EOS), each one's
    # log-probability and, with ``top_logprobs`` k, the k most likely (id, log-probability) pairs at each position.
    token_ids: tuple[int, ...] = ()
    token_logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass(frozen=True)
class ThreadTokens:
    """A running thread's tokens since its last report: ``token_ids`` are its tokens ``tokens - len(token_ids)``
    to ``tokens`` (a thread re-run after its worker died reports from its start again, with the same tokens)."""

    sample: int
    token_ids: tuple[int, ...]
    tokens: int  # its tokens so far
    token_logprobs: tuple[float, ...] = ()  # when its sampling parameters ask, as in ThreadResult
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass(frozen=True)
class TokenProgress:
    """What a request's running threads decoded since the last report: streamed beside the finished threads'
    ``ThreadResult``s when the request asks (``ProblemRequest.stream_tokens``)."""

    problem_id: str
    threads: tuple[ThreadTokens, ...]
