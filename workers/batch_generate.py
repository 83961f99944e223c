"""Batched generation for many threads: each prompt prefilled once, finished threads leave the batch.

A plain decode loop over a transformers ``DynamicCache``: prompts are left-padded and prefilled in one
forward pass, every prompt's cache is repeated for its threads, and each step samples one token per
live thread. A thread that emits EOS or reaches its token limit is dropped from the batch (and from
the cache) at once, so no compute or memory is spent on finished threads. Every thread has its own
random generator seeded from (seed, problem, sample), so a thread's text does not depend on which
other threads share its batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from policies.extraction import extract_chain_answer


@dataclass(frozen=True)
class SamplingParams:
    """How threads are decoded: ``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 1536
    seed: int = 0


@dataclass
class ThreadOutput:
    problem_index: int
    sample_index: int
    text: str
    tokens: int
    answer: str | None
    mean_logprob: float


@dataclass
class GenerationResult:
    threads: list[ThreadOutput] = field(default_factory=list)
    tokens_generated: int = 0
    elapsed_s: float = 0.0
    kv_peak_bytes: int = 0


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes of K and V tensors the cache really holds (padding included)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


def thread_seed(seed: int, problem_index: int, sample_index: int) -> int:
    return (seed * 1_000_003 + problem_index * 7919 + sample_index) % (2**63)


def sample_next(logits: torch.Tensor, sampling: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row: argmax when greedy, else temperature + nucleus sampling with per-row generators."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > sampling.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    uniform = torch.stack([torch.rand(1, generator=g) for g in generators]).to(probs.device)
    # Inverse-CDF sampling: one uniform draw per row, from that row's own generator.
    cdf = probs.cumsum(dim=-1)
    index = (cdf < uniform * cdf[:, -1:]).sum(dim=-1)
    return index.clamp_max(probs.shape[-1] - 1)


@torch.inference_mode()
def generate_group(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    threads: list[tuple[int, int]],
    sampling: SamplingParams,
    on_finish=None,
) -> tuple[list[ThreadOutput], int]:
    """Decode ``threads`` ((prompt index, sample index) pairs) together; return their outputs and the KV peak."""
    device = model.device
    used = sorted({p for p, _ in threads})
    encoded = tokenizer([prompts[p] for p in used], return_tensors="pt", padding=True).to(device)
    mask = encoded["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache()
    logits = model(**encoded, position_ids=positions, past_key_values=cache, use_cache=True).logits[:, -1]
    row_of_prompt = {p: i for i, p in enumerate(used)}
    rows = torch.tensor([row_of_prompt[p] for p, _ in threads], device=device)
    cache.batch_select_indices(rows)
    logits, mask, next_position = logits[rows], mask[rows], positions[rows, -1] + 1
    generators = [torch.Generator().manual_seed(thread_seed(sampling.seed, p, s)) for p, s in threads]
    live = list(range(len(threads)))
    tokens: list[list[int]] = [[] for _ in threads]
    logprob_sums = [0.0] * len(threads)
    outputs: list[ThreadOutput | None] = [None] * len(threads)
    peak = cache_bytes(cache)
    eos = tokenizer.eos_token_id
    while live:
        chosen = sample_next(logits, sampling, [generators[t] for t in live])
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, chosen[:, None])[:, 0]
        keep = []
        for row, thread in enumerate(live):
            token = int(chosen[row])
            logprob_sums[thread] += float(logprobs[row])
            if token != eos:
                tokens[thread].append(token)
            if token == eos or len(tokens[thread]) >= sampling.max_new_tokens:
                text = tokenizer.decode(tokens[thread], skip_special_tokens=True)
                count = len(tokens[thread]) + (token == eos)
                problem, sample = threads[thread]
                outputs[thread] = ThreadOutput(problem, sample, text, count, extract_chain_answer(text), logprob_sums[thread] / count)
                if on_finish is not None:
                    on_finish(outputs[thread])
            else:
                keep.append(row)
        if not keep:
            break
        if len(keep) < len(live):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            chosen, mask, next_position = chosen[index], mask[index], next_position[index]
            live = [live[r] for r in keep]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
        logits = model(
            input_ids=chosen[:, None], attention_mask=mask, position_ids=next_position[:, None],
            past_key_values=cache, use_cache=True,
        ).logits[:, -1]
        next_position = next_position + 1
        peak = max(peak, cache_bytes(cache))
    return [o for o in outputs if o is not None], peak


def generate_threads(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    samples: int,
    sampling: SamplingParams,
    batch_size: int = 64,
    progress: bool = True,
) -> GenerationResult:
    """Run ``samples`` threads for every prompt, at most ``batch_size`` threads decoding together."""
    if sampling.temperature == 0 and samples != 1:
        raise ValueError("greedy decoding (temperature 0) gives identical threads: use samples=1")
    lengths = [len(p) for p in prompts]
    # Threads of similar prompt length (a proxy for difficulty) run together and finish together.
    order = sorted(((p, s) for p in range(len(prompts)) for s in range(samples)), key=lambda t: (-lengths[t[0]], t))
    result = GenerationResult()
    started = time.perf_counter()
    with tqdm(total=len(order), desc="threads", unit="thread", disable=not progress) as bar:
        for start in range(0, len(order), batch_size):
            outputs, peak = generate_group(
                model, tokenizer, prompts, order[start : start + batch_size], sampling, on_finish=lambda _: bar.update(1)
            )
            result.threads.extend(outputs)
            result.kv_peak_bytes = max(result.kv_peak_bytes, peak)
    result.tokens_generated = sum(t.tokens for t in result.threads)
    result.elapsed_s = time.perf_counter() - started
    result.threads.sort(key=lambda t: (t.problem_index, t.sample_index))
    return result
