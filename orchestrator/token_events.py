"""A task's running threads as ``tokens`` events: the token ids the workers stream, decoded into text deltas.

Workers report each running thread's new token ids in small batches (``TokenProgress``); this turns them into one
``tokens`` event per thread and batch: ``{"task", "sample", "text", "tokens", "ids"}`` (the text the batch adds,
the thread's token count so far, the new ids), with ``logprobs`` and ``top_logprobs`` when the request asked.
Text is decoded incrementally (a window of ids around the new ones, held back while it ends inside a multi-byte
character), so a long thread costs no more per batch than a short one. When a thread finishes, its last tokens
(those after its last report) come as one more ``tokens`` event, so a thread's ``text`` deltas add up to its
result's text and its ``ids`` to its token ids. A thread re-run after its worker died reports from its start again,
with the same tokens; what was already told is not told twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from workers.records import ThreadResult, ThreadTokens, TokenProgress

EventListener = Callable[[str, dict], None]


@dataclass
class IncrementalDecoder:
    """One thread's ids and the text told so far; ``add`` returns the text new ids complete."""

    tokenizer: Any
    ids: list[int] = field(default_factory=list)
    text: str = ""
    _prefix: int = 0  # ids before this were decoded for good; [prefix, read) gives the next ids their context
    _read: int = 0

    def add(self, ids: list[int] | tuple[int, ...]) -> str:
        self.ids.extend(ids)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        now = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=True)
        if len(now) <= len(before) or now.endswith("\ufffd"):  # nothing new yet, or a character still incomplete
            return ""
        delta = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def rest(self, final_text: str) -> str:
        """What the finished thread's text adds to what was told (nothing if the two disagree)."""
        delta = final_text[len(self.text):] if final_text.startswith(self.text) else ""
        self.text += delta
        return delta


class TokenEvents:
    """Callable with a ``TokenProgress`` or a finished ``ThreadResult``; tells ``on_event`` the ``tokens`` events."""

    def __init__(self, task_id: str, tokenizer: Any, on_event: EventListener):
        self.task_id, self.tokenizer, self.on_event = task_id, tokenizer, on_event
        self.threads: dict[int, IncrementalDecoder] = {}

    def __call__(self, item: TokenProgress | ThreadResult) -> None:
        if isinstance(item, TokenProgress):
            for tokens in item.threads:
                self._progress(tokens)
        else:
            self._finished(item)

    def _decoder(self, sample: int) -> IncrementalDecoder:
        return self.threads.setdefault(sample, IncrementalDecoder(self.tokenizer))

    def _progress(self, tokens: ThreadTokens) -> None:
        decoder = self._decoder(tokens.sample)
        start = tokens.tokens - len(tokens.token_ids)  # the index of the first of these ids in the thread
        seen = len(decoder.ids)
        if start > seen or tokens.tokens <= seen:  # a gap (never expected) or only what was told already
            return
        skip = seen - start
        ids = tokens.token_ids[skip:]
        data = {"task": self.task_id, "sample": tokens.sample, "text": decoder.add(ids), "tokens": tokens.tokens,
                "ids": list(ids)}
        if tokens.token_logprobs:
            data["logprobs"] = list(tokens.token_logprobs[skip:])
            data["top_logprobs"] = [[list(pair) for pair in top] for top in tokens.top_logprobs[skip:]]
        self.on_event("tokens", data)

    def _finished(self, result: ThreadResult) -> None:
        decoder = self._decoder(result.sample)
        seen = len(decoder.ids)
        ids = list(result.token_ids[seen:])
        decoder.ids.extend(ids)
        text = decoder.rest(result.text)
        if not text and not ids:
            return
        data = {"task": self.task_id, "sample": result.sample, "text": text, "tokens": result.tokens, "ids": ids}
        if result.token_logprobs:
            data["logprobs"] = list(result.token_logprobs[seen:])
            data["top_logprobs"] = [[list(pair) for pair in top] for top in result.top_logprobs[seen:]]
        self.on_event("tokens", data)
