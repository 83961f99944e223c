"""The reference decode loop: batched generation over a Hugging Face cache, one group of threads at a time.

The engine (:mod:`workers.engine`) is what serves; this loop remains for the kvpress baselines, whose
presses shrink a dense Hugging Face cache, and as the simple reference the engine is checked against.

A plain decode loop over a transformers ``DynamicCache``: prompts are left-padded and prefilled in one
forward pass, every prompt's cache is repeated for its threads, and each step samples one token per
live thread. A thread that emits EOS or reaches its token limit is dropped from the batch (and from
the cache) at once, so no compute or memory is spent on finished threads. Every thread has its own
random generator seeded from (seed, problem, sample), so a thread's text does not depend on which
other threads share its batch.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from dms_runtime.cache import DMSCache
from policies.extraction import extract_chain_answer
from workers.sampler import sample_rows
from workers.thread import SamplingParams


@dataclass
class ThreadOutput:
    problem_index: int
    sample_index: int
    text: str
    tokens: int
    answer: str | None
    mean_logprob: float
    realized_cr: float = 1.0  # tokens processed / tokens held per head at the thread's end
    min_logprob: float = 0.0  # the least likely token chosen (as the engine's ThreadResult)


@dataclass
class GenerationResult:
    threads: list[ThreadOutput] = field(default_factory=list)
    tokens_generated: int = 0
    elapsed_s: float = 0.0
    kv_peak_bytes: int = 0

    @property
    def realized_cr(self) -> float:
        return sum(t.realized_cr for t in self.threads) / max(1, len(self.threads))


@dataclass
class KVPolicy:
    """How threads keep their KV cache: everything (vanilla), DMS gates, or a kvpress press.

    ``dms`` is a :class:`~dms_runtime.attach.DMSHandle` (its cache frees evicted slots);
    ``press`` is a kvpress press applied while decoding (it shrinks a dense cache; finished threads
    then stay in the batch until it ends, since presses keep per-batch state)."""

    dms: object | None = None
    press: object | None = None

    def new_cache(self):
        return self.dms.new_cache() if self.dms is not None else DynamicCache()


def cache_bytes(cache) -> int:
    """Bytes of K and V the cache really holds: occupied slots for DMS, whole tensors otherwise."""
    if isinstance(cache, DMSCache):
        return cache.bytes_held()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


def row_compression(cache, real_tokens: torch.Tensor) -> torch.Tensor:
    """Per row: tokens processed / tokens held per head (1.0 for a cache that keeps everything)."""
    if isinstance(cache, DMSCache):
        return cache.realized_compression()
    held = torch.tensor([float(layer.keys.shape[2]) for layer in cache.layers if layer.is_initialized]).mean()
    return real_tokens.float() / held


def thread_seed(seed: int, problem_index: int, sample_index: int) -> int:
    return (seed * 1_000_003 + problem_index * 7919 + sample_index) % (2**63)


def sample_next(logits: torch.Tensor, sampling: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row, every row with the same parameters (see :func:`workers.sampler.sample_rows`)."""
    rows = logits.shape[0]
    return sample_rows(logits, torch.full((rows,), sampling.temperature), torch.full((rows,), sampling.top_p), generators)


@torch.inference_mode()
def generate_group(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    threads: list[tuple[int, int]],
    sampling: SamplingParams,
    on_finish=None,
    kv: KVPolicy | None = None,
) -> tuple[list[ThreadOutput], int]:
    """Decode ``threads`` ((prompt index, sample index) pairs) together; return their outputs and the KV peak."""
    kv = kv or KVPolicy()
    with kv.press(model) if kv.press is not None else nullcontext():
        return _decode(model, tokenizer, prompts, threads, sampling, on_finish, kv)


def _decode(model, tokenizer, prompts, threads, sampling, on_finish, kv: KVPolicy):
    device = model.device
    # Each prompt is prefilled once and its cache shared by its threads; a press keeps per-row state
    # from the prefill on, so under a press every thread prefills its own row.
    used = sorted({p for p, _ in threads}) if kv.press is None else [p for p, _ in threads]
    encoded = tokenizer([prompts[p] for p in used], return_tensors="pt", padding=True).to(device)
    mask = encoded["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = kv.new_cache()
    logits = model(**encoded, position_ids=positions, past_key_values=cache, use_cache=True).logits[:, -1]
    row_of_prompt = {p: i for i, p in enumerate(used)}
    rows = torch.tensor([row_of_prompt[p] for p, _ in threads] if kv.press is None else range(len(threads)), device=device)
    if kv.press is None:
        cache.batch_select_indices(rows)
    logits, mask, next_position = logits[rows], mask[rows], positions[rows, -1] + 1
    real_tokens = mask.sum(-1)  # per row: tokens processed so far, padding excluded
    drop_finished = kv.press is None
    generators = [torch.Generator().manual_seed(thread_seed(sampling.seed, p, s)) for p, s in threads]
    live = list(range(len(threads)))
    tokens: list[list[int]] = [[] for _ in threads]
    logprob_sums = [0.0] * len(threads)
    logprob_mins = [0.0] * len(threads)
    outputs: list[ThreadOutput | None] = [None] * len(threads)
    peak = cache_bytes(cache)
    eos = tokenizer.eos_token_id
    while live:
        chosen = sample_next(logits, sampling, [generators[t] for t in live])
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, chosen[:, None])[:, 0]
        keep = []
        finishing = [row for row, t in enumerate(live) if outputs[t] is None and (int(chosen[row]) == eos or len(tokens[t]) + 1 >= sampling.max_new_tokens)]
        compression = row_compression(cache, real_tokens) if finishing else None
        for row, thread in enumerate(live):
            if outputs[thread] is not None:  # finished, kept in the batch for a press
                keep.append(row)
                continue
            token = int(chosen[row])
            logprob_sums[thread] += float(logprobs[row])
            logprob_mins[thread] = min(logprob_mins[thread], float(logprobs[row]))
            if token != eos:
                tokens[thread].append(token)
            if token == eos or len(tokens[thread]) >= sampling.max_new_tokens:
                text = tokenizer.decode(tokens[thread], skip_special_tokens=True)
                count = len(tokens[thread]) + (token == eos)
                problem, sample = threads[thread]
                outputs[thread] = ThreadOutput(
                    problem, sample, text, count, extract_chain_answer(text), logprob_sums[thread] / count,
                    realized_cr=float(compression[row]), min_logprob=logprob_mins[thread],
                )
                if on_finish is not None:
                    on_finish(outputs[thread])
                if not drop_finished:
                    keep.append(row)
            else:
                keep.append(row)
        if all(o is not None for o in outputs):
            break
        if len(keep) < len(live):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            chosen, mask, next_position = chosen[index], mask[index], next_position[index]
            real_tokens = real_tokens[index]
            live = [live[r] for r in keep]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
        logits = model(
            input_ids=chosen[:, None],
            # A press shrinks the cache under the mask's feet: its batches are never padded (see below).
            attention_mask=mask if kv.press is None else None,
            position_ids=next_position[:, None],
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
        next_position = next_position + 1
        real_tokens = real_tokens + 1
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
    kv: KVPolicy | None = None,
) -> GenerationResult:
    """Run ``samples`` threads for every prompt, at most ``batch_size`` threads decoding together."""
    if sampling.temperature == 0 and samples != 1:
        raise ValueError("greedy decoding (temperature 0) gives identical threads: use samples=1")
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    # Threads of similar prompt length (a proxy for difficulty) run together and finish together.
    order = sorted(((p, s) for p in range(len(prompts)) for s in range(samples)), key=lambda t: (-lengths[t[0]], t))
    groups = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if kv is not None and kv.press is not None:
        groups = _unpadded_groups(order, lengths, batch_size)
    result = GenerationResult()
    started = time.perf_counter()
    with tqdm(total=len(order), desc="threads", unit="thread", disable=not progress) as bar:
        for group in groups:
            outputs, peak = generate_group(
                model, tokenizer, prompts, group, sampling, on_finish=lambda _: bar.update(1), kv=kv
            )
            result.threads.extend(outputs)
            result.kv_peak_bytes = max(result.kv_peak_bytes, peak)
    result.tokens_generated = sum(t.tokens for t in result.threads)
    result.elapsed_s = time.perf_counter() - started
    result.threads.sort(key=lambda t: (t.problem_index, t.sample_index))
    return result


def _unpadded_groups(order: list[tuple[int, int]], lengths: list[int], batch_size: int) -> list[list[tuple[int, int]]]:
    """Batches whose prompts all have the same token length (kvpress presses compress unpadded batches)."""
    groups: list[list[tuple[int, int]]] = []
    for thread in order:
        if groups and len(groups[-1]) < batch_size and lengths[groups[-1][0][0]] == lengths[thread[0]]:
            groups[-1].append(thread)
        else:
            groups.append([thread])
    return groups
