"""Where a retrofit's training text comes from: batches of token ids (the KL is taken on their completion tokens)
and the lengths a compression ratio is averaged over (``training.retrofit.eviction_target``).

* :class:`ChainText`: generated chain problems with their reference chain of thought, the shipped recipe's text
  (exactly the batches it always drew).
* :class:`ProblemText`: a problem file's prompts with the frozen model's own sampled completions
  (``training.completions``), for any model and task family.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol

from tasks.chain_tokenizer import writes_reversed_minus_lines
from training.chain_data import Batch, difficulty_batch, pad_examples, sample_lengths
from training.completions import Completion


class TrainingText(Protocol):
    def batch(self, offset: int) -> Batch:
        """The batch of seed ``offset``: each use of batches (warm start, calibration, training) has its own stream."""
        ...

    def lengths(self) -> list[int]:
        """Example lengths (prompt and completion), the population a ratio's eviction target is averaged over."""
        ...


@dataclass(frozen=True)
class ChainText:
    """Chain problems of one random difficulty per batch, drawn as the base model was trained (any order, ``-``
    lines in both forms when its tokenizer says it writes them so)."""

    tokenizer: Any
    seed: int
    k_min: int
    k_max: int
    tokens_per_batch: int
    any_order: bool = False

    @classmethod
    def from_config(cls, config, tokenizer) -> ChainText:
        """From a ``RetrofitConfig``'s seed, difficulties, batch size and ``any_order``."""
        return cls(tokenizer, config.seed, config.k_min, config.k_max, config.tokens_per_batch, config.any_order)

    def batch(self, offset: int, k_min: int | None = None, k_max: int | None = None) -> Batch:
        """``k_min``/``k_max``: draw the difficulty from this range instead (the role labels' plan, one k at a time)."""
        return difficulty_batch(self.tokenizer, random.Random(self.seed * 1_000_003 + offset), k_min or self.k_min,
                                k_max or self.k_max, self.tokens_per_batch, self.any_order,
                                writes_reversed_minus_lines(self.tokenizer))

    def lengths(self) -> list[int]:
        return sample_lengths(self.tokenizer, self.k_min, self.k_max)


@dataclass(frozen=True)
class ProblemText:
    """Prompt + completion examples; a batch is a run of examples of neighbouring lengths (little padding) from a
    random place, about ``tokens_per_batch`` tokens, each example at most once."""

    examples: tuple[tuple[tuple[int, ...], int], ...]  # (token ids, prompt length), shortest first
    seed: int
    tokens_per_batch: int
    pad_id: int

    @classmethod
    def from_completions(cls, completions: list[Completion], seed: int, tokens_per_batch: int,
                         pad_id: int) -> ProblemText:
        if not completions:
            raise ValueError("problems: no completions to train on")
        examples = sorted(((tuple(c.prompt_ids + c.completion_ids), len(c.prompt_ids)) for c in completions),
                          key=lambda e: len(e[0]))
        return cls(tuple(examples), seed, tokens_per_batch, pad_id)

    def batch(self, offset: int) -> Batch:
        rng = random.Random(self.seed * 1_000_003 + offset)
        start = rng.randrange(len(self.examples))
        # from ``start`` towards longer examples, then (past the longest) towards shorter ones from ``start``
        order = list(range(start, len(self.examples))) + list(range(start - 1, -1, -1))
        chosen: list[tuple[list[int], int]] = []
        total = 0
        for index in order:
            if chosen and total >= self.tokens_per_batch:
                break
            ids, prompt_len = self.examples[index]
            chosen.append((list(ids), prompt_len))
            total += len(ids)
        return pad_examples(chosen, self.pad_id)

    def spread_batches(self, batches: int, per_batch: int = 4) -> list[Batch]:
        """``batches`` small batches of neighbouring lengths whose examples are spread evenly over every length: a
        calibration sample that sees each length alike (a :meth:`batch` is a run of one length)."""
        count = min(len(self.examples), batches * per_batch)
        last = len(self.examples) - 1
        chosen = [self.examples[round(i * last / max(1, count - 1))] for i in range(count)]
        return [pad_examples([(list(ids), prompt_len) for ids, prompt_len in chosen[i:i + per_batch]], self.pad_id)
                for i in range(0, count, per_batch)]

    def lengths(self) -> list[int]:
        return [len(ids) for ids, _ in self.examples]


def training_text(config, tokenizer, completions: list[Completion] | None = None) -> TrainingText:
    """A ``RetrofitConfig``'s text: its problem file's ``completions`` when it names one, else chain problems."""
    if config.problems is None:
        return ChainText.from_config(config, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return ProblemText.from_completions(completions or [], config.seed, config.tokens_per_batch, pad_id or 0)
