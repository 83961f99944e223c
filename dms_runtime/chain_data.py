"""Training sequences from the chain task: prompt + reference chain of thought + EOS, packed into rows."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tasks.chain import generate_problem
from tasks.cot import render_cot
from tasks.prompt import format_prompt


def encode_example(tokenizer, problem) -> tuple[list[int], int]:
    """Token ids of one full example and the length of its prompt part."""
    prompt = tokenizer(format_prompt(problem.text))["input_ids"]
    completion = tokenizer(render_cot(problem), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + completion, len(prompt)


@dataclass
class PackedBatch:
    """Rows of concatenated examples. ``segments[r]`` lists (start, end, prompt_len) of each example in row r."""

    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L], restarting at 0 for every example
    loss_mask: torch.Tensor  # [R, L]: True where the *next* token is a completion token to predict
    segments: list[list[tuple[int, int, int]]]


def packed_batch(tokenizer, rng: random.Random, k_min: int, k_max: int, rows: int, row_len: int) -> PackedBatch:
    """``rows`` rows of at most ``row_len`` tokens, filled first-fit with problems of uniform random k.

    Mixing difficulties in every batch makes batch statistics (such as the mean compression ratio)
    estimates of the same statistic over the whole difficulty range."""
    input_ids = torch.full((rows, row_len), tokenizer.pad_token_id)
    position_ids = torch.zeros((rows, row_len), dtype=torch.long)
    loss_mask = torch.zeros((rows, row_len), dtype=torch.bool)
    segments: list[list[tuple[int, int, int]]] = [[] for _ in range(rows)]
    fill = [0] * rows
    failures = 0
    while failures < 8:
        ids, prompt_len = encode_example(tokenizer, generate_problem(rng, rng.randint(k_min, k_max)))
        if len(ids) > row_len:
            raise ValueError(f"an example of {len(ids)} tokens does not fit rows of {row_len}")
        row = next((r for r in range(rows) if fill[r] + len(ids) <= row_len), None)
        if row is None:
            failures += 1
            continue
        start, end = fill[row], fill[row] + len(ids)
        input_ids[row, start:end] = torch.tensor(ids)
        position_ids[row, start:end] = torch.arange(len(ids))
        loss_mask[row, start + prompt_len - 1 : end - 1] = True
        segments[row].append((start, end, prompt_len))
        fill[row] = end
    for row in range(rows):  # padding continues as one more "example" that is never scored
        position_ids[row, fill[row] :] = torch.arange(row_len - fill[row])
    return PackedBatch(input_ids, position_ids, loss_mask, segments)
