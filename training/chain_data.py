"""Training batches from the chain task: prompt + reference chain of thought + EOS, and the role of each token."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tasks.chain import generate_problem
from tasks.cot import render_cot
from tasks.prompt import format_prompt

IGNORE = -100


def encode_example(tokenizer, problem, order_rng: random.Random | None = None, reversed_minus: bool = False
                   ) -> tuple[list[int], int]:
    """Token ids of one full example and the length of its prompt part (``order_rng``, ``reversed_minus``: see
    ``render_cot``)."""
    prompt = tokenizer(format_prompt(problem.text))["input_ids"]
    completion = tokenizer(render_cot(problem, order_rng, reversed_minus), add_special_tokens=False)["input_ids"]
    completion += [tokenizer.eos_token_id]
    return prompt + completion, len(prompt)


@dataclass
class Batch:
    """Right-padded examples of one difficulty (similar lengths, so little padding)."""

    input_ids: torch.Tensor  # [n, L]
    labels: torch.Tensor  # [n, L]: the token itself on completion positions, IGNORE elsewhere
    lengths: torch.Tensor  # [n]: tokens per example
    k: int | None  # the chain problems' difficulty; None for text of another task

    @property
    def loss_mask(self) -> torch.Tensor:
        """[n, L]: positions whose *next* token is a completion token (where predictions are scored)."""
        mask = torch.zeros_like(self.labels, dtype=torch.bool)
        mask[:, :-1] = self.labels[:, 1:] != IGNORE
        return mask


def difficulty_batch(tokenizer, rng: random.Random, k_min: int, k_max: int, tokens: int,
                     any_order: bool = False, reversed_minus: bool = False) -> Batch:
    """About ``tokens`` tokens of problems with one random difficulty k in ``k_min..k_max``; ``any_order``:
    every line in any of its forms (``render_cot``; ``-`` lines too with ``reversed_minus``), drawn from a
    stream of their own."""
    k = rng.randint(k_min, k_max)
    order_rng = random.Random(str(rng.getstate())) if any_order else None  # seeded by, not drawn from, rng
    examples: list[tuple[list[int], int]] = []
    total = 0
    while total < tokens or not examples:
        ids, prompt_len = encode_example(tokenizer, generate_problem(rng, k), order_rng, reversed_minus)
        examples.append((ids, prompt_len))
        total += len(ids)
    return pad_examples(examples, tokenizer.pad_token_id, k)


def pad_examples(examples: list[tuple[list[int], int]], pad_id: int, k: int | None = None) -> Batch:
    """Examples (token ids, prompt length) right-padded into one batch; the tokens after each prompt are labelled."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), IGNORE)
    for row, (ids, prompt_len) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
    return Batch(input_ids, labels, torch.tensor([len(ids) for ids, _ in examples]), k)


def sample_lengths(tokenizer, k_min: int, k_max: int, n: int = 2000, seed: int = 12345) -> list[int]:
    """Lengths of ``n`` examples with k uniform in ``k_min..k_max`` (the population a ratio is averaged over)."""
    rng = random.Random(seed)
    return [len(encode_example(tokenizer, generate_problem(rng, rng.randint(k_min, k_max)))[0]) for _ in range(n)]


# The regions of a chain-task example, by what a token is for (the line formats are in ``tasks/cot.py``).
REGIONS = ("prompt", "line_var", "header", "header_y", "header_op", "header_z", "operands", "facts", "register",
           "newline", "answer")
# Where the values live that are read long after they are written: the problem itself and the register lines.
# Everything else is scratch, dead a few tokens after it is written.
LONG_LIVED = ("prompt", "register")


def token_regions(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The region of every token of one example (prompt positions carry the label ``IGNORE``)."""
    out, line = [], ""
    for token, label in zip(ids, labels):
        char = tokenizer.decode([token])
        if label == IGNORE:
            out.append("prompt")
            continue
        if char == "\n":
            out.append("newline")
            line = ""
            continue
        line += char
        if line.startswith("#"):
            out.append("answer")
        elif "|" in line:
            out.append("facts" if line.count("|") == 2 and char != "|" else "operands")  # "|a:07+b:42|" are operands
        elif len(line) == 1:
            out.append("line_var")
        elif line[1] == ":":
            out.append("register")
        else:
            out.append({3: "header_y", 4: "header_op", 5: "header_z"}.get(len(line), "header"))
    return out


def long_lived_mask(tokenizer, batch: Batch) -> torch.Tensor:
    """``[n, L]`` bool: the tokens of ``LONG_LIVED`` regions (padding is not)."""
    mask = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    for row, length in enumerate(batch.lengths.tolist()):
        found = token_regions(tokenizer, batch.input_ids[row, :length].tolist(), batch.labels[row, :length].tolist())
        mask[row, :length] = torch.tensor([region in LONG_LIVED for region in found])
    return mask
