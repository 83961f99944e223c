"""One OpenAI choice's text as its thread's tokens arrive: thinking apart from the answer, stop strings cut,
log-probabilities per token. The same code builds a finished choice (all tokens at once) and a streamed one (a
batch at a time), so a stream's deltas add up to what the same request answers unstreamed.

* A thinking model's reply (its chat template writes ``<think>``, and the prompt does not close an empty thinking
  block, which is how templates turn thinking off) is thinking up to the ``</think>`` token, then the answer:
  ``reasoning_content`` and ``content``, each stripped of the whitespace around the tags. Other replies are
  ``content`` only, exactly the thread's text.
* The text ends before the first of the caller's stop strings (OpenAI's rule; the thread itself stopped there).
  While a choice streams, its last ``len(longest stop) - 1`` characters wait, as they may begin a stop string,
  and so does a character whose bytes have not all arrived.
* ``logprobs`` cover the tokens of ``content`` (a thinking model's thinking has none), each token as its own
  text, with the most likely alternatives when asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"


def think_end_id(tokenizer: Any) -> int | None:
    """The ``</think>`` token of a thinking model (its chat template writes ``<think>``), else None."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str) or THINK_START not in template:
        return None
    return tokenizer.get_vocab().get(THINK_END)


def replies_with_thinking(tokenizer: Any, prompt_ids: list[int] | tuple[int, ...], end_id: int | None) -> bool:
    """Whether a reply to this model input starts with thinking: a thinking model, and thinking not turned off
    (an empty ``<think></think>`` block closing the prompt)."""
    if end_id is None:
        return False
    return not tokenizer.decode(list(prompt_ids[-8:]), skip_special_tokens=False).rstrip().endswith(THINK_END)


@dataclass(frozen=True)
class OutputFormat:
    tokenizer: Any
    think_end: int | None = None  # the </think> id when the reply starts with thinking
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0


@dataclass(frozen=True)
class TokenEntry:
    """One generated token: its text, log-probability and the most likely (text, log-probability) at its place."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@dataclass
class ChoiceText:
    """A choice being built: ``add`` what its thread decoded, ``delta`` what that adds to what was told."""

    fmt: OutputFormat
    ids: list[int] = field(default_factory=list)
    text: str = ""  # the thread's text so far (its decoded tokens, special tokens skipped)
    logprobs: list[float] = field(default_factory=list)
    tops: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    told_reasoning: str = ""
    told_content: str = ""
    told_entries: int = 0  # content tokens whose log-probabilities were told

    def add(self, text: str, ids=(), logprobs=(), tops=()) -> None:
        self.text += text
        self.ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.tops.extend(tuple(tuple(pair) for pair in top) for top in tops)

    def delta(self, final: bool = False) -> tuple[str, str, list[TokenEntry]]:
        """(thinking, answer, token entries) added since the last delta; ``final``: the thread has finished."""
        reasoning, content = self._parts(final)
        new_reasoning, self.told_reasoning = _extend(self.told_reasoning, reasoning)
        new_content, self.told_content = _extend(self.told_content, content)
        start = self._content_start()
        entries = []
        if start is not None and self.logprobs:
            first = start + self.told_entries
            entries = [self._entry(i) for i in range(first, min(len(self.ids), len(self.logprobs)))]
            self.told_entries += len(entries)
        return new_reasoning, new_content, entries

    def _content_start(self) -> int | None:
        """The index of the first answer token (None while the reply is still thinking)."""
        end = self.fmt.think_end
        if end is None:
            return 0
        return self.ids.index(end) + 1 if end in self.ids else None

    def _parts(self, final: bool) -> tuple[str, str]:
        decode = self.fmt.tokenizer.decode
        start = self._content_start()
        if self.fmt.think_end is None:
            reasoning, content, growing = "", self.text, "content"
        else:
            thinking_ids = self.ids if start is None else self.ids[: start - 1]
            reasoning = decode(thinking_ids, skip_special_tokens=True).lstrip().removeprefix(THINK_START)
            content = "" if start is None else decode(self.ids[start:], skip_special_tokens=True)
            growing = "reasoning" if start is None else "content"
        cut = _first_stop(reasoning, self.fmt.stop)
        if cut is not None:
            reasoning, content = reasoning[:cut], ""
        elif (cut := _first_stop(content, self.fmt.stop)) is not None:
            content = content[:cut]
        elif not final:  # what may still turn out to begin a stop string, or an incomplete character, waits
            hold = max((len(s) for s in self.fmt.stop), default=1) - 1
            if growing == "reasoning":
                reasoning = _settled(reasoning, hold)
            else:
                content = _settled(content, hold)
        if self.fmt.think_end is not None:  # the whitespace around the tags is the template's, not the reply's
            reasoning, content = reasoning.strip(), content.lstrip()
        return reasoning, content

    def _entry(self, index: int) -> TokenEntry:
        decode = self.fmt.tokenizer.decode
        top = self.tops[index] if index < len(self.tops) else ()
        return TokenEntry(decode([self.ids[index]], skip_special_tokens=True), self.logprobs[index],
                          tuple((decode([token], skip_special_tokens=True), logprob)
                                for token, logprob in top[: self.fmt.top_logprobs]))


def _extend(told: str, target: str) -> tuple[str, str]:
    """What ``target`` adds to ``told`` (nothing, should they ever disagree)."""
    if target.startswith(told):
        return target[len(told):], target
    return "", told


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _settled(text: str, hold: int) -> str:
    text = text.rstrip("\ufffd")
    return text[: len(text) - hold] if hold else text


def finish_reason(thread_reason: str | None) -> str:
    """OpenAI's ``finish_reason`` of a thread's: ``length`` when it ran out of tokens (or of KV memory)."""
    return "length" if thread_reason in ("length", "kv_budget") else "stop"


def chat_logprobs(entries: list[TokenEntry]) -> list[dict]:
    """Entries in the chat shape: ``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``."""
    return [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e.top]}
            for e in entries]


def legacy_logprobs(entries: list[TokenEntry], offset: int, with_top: bool) -> dict:
    """Entries in the legacy completion shape: tokens, token_logprobs, top_logprobs, text_offset (each token's
    first character in the returned text, from ``offset``)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            # Two tokens may read the same (special tokens read as ""): the more likely one keeps its place.
            "top_logprobs": [dict(reversed(e.top)) for e in entries] if with_top else None, "text_offset": offsets}
