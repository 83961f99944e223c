"""The generation engine: continuous batching of many threads inside one fixed KV pool.

Threads belong to tasks. A task's prompt is prefilled once per ratio, in chunks, and held (:class:`HeldPrompt`)
for the task's life: every thread of the task, in any request or round, starts from it and shares its slots,
and a preempted thread resumes from it, replaying only its own tokens. A task opened with ``keep=True`` lives
until :meth:`Engine.close_task`; any other closes when its last thread ends.

Each :meth:`Engine.step` first admits what the scheduler allows, then makes room for the decode step
(preempting the newest threads if the pool is short), then decodes one token for every running thread, each
with its own sampling parameters and DMS ratio. Finished threads leave the batch and free their slots at once;
so do cancelled ones. The pool counts each task's slots, so a thread reports its task's own KV peak.

A decode step runs on the device from end to end (the cache's bookkeeping, the pool, the rows' state in
:class:`~workers.row_state.RowState`, sampling with counter-based random streams) and reads it back once
(:meth:`Engine._read_step`): the tokens and log-probs, with the pool's slots in use and each layer's longest line,
which is all the host needs to admit, make room and size the tables. With ``cuda_graphs`` the step's device work is
replayed as a CUDA graph while the batch keeps its shape (:mod:`workers.decode_graph`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dms_runtime.gate_bank import AdapterSet
from dms_runtime.kv_growth import CURVE_POINTS
from dms_runtime.kv_pool import MAX_OWNERS, KVPool
from dms_runtime.loading import kv_geometry
from dms_runtime.paged_cache import PagedDMSCache
from workers.decode_graph import DecodeGraph
from workers.kv_budget import KVBudgetModel
from workers.records import ThreadResult
from workers.row_state import RowState
from workers.sampler import sample_rows
from workers.scheduler import Scheduler
from workers.records import ThreadTokens
from workers.sync_probe import read_to_host
from tasks.families import TaskFamily
from workers.thread import SamplingParams, StopRule, Thread

PREFILL_CHUNK = 128  # prompt tokens per prefill pass: bounds the slots a prefill holds before eviction


class _PoolShort(Exception):
    """Not enough free slots to start a thread now (it goes back to the queue)."""


class BudgetError(ValueError):
    """A request that cannot run within the worker's KV pool, whatever else is running."""


def _defined(points: tuple[int, ...], fractions: list[float]) -> tuple[tuple[int, float], ...]:
    """The curve's points a thread reached (NaN marks those it did not)."""
    return tuple((p, f) for p, f in zip(points, fractions) if not math.isnan(f))


def thread_seed(seed: int, sample_index: int) -> int:
    """The seed of thread ``sample_index`` of a request seeded ``seed``."""
    return (seed * 1_000_003 + sample_index * 7919) % (2**63)


@dataclass
class HeldPrompt:
    """A task's prompt prefilled at one ratio: its one-row cache and the logits after its last token."""

    cache: PagedDMSCache
    logits: torch.Tensor  # [vocab]
    tokens: int


@dataclass
class EngineTask:
    owner: int  # the pool's owner id for its slots
    keep: bool  # lives until close_task (else: until its last thread ends)
    prompts: dict[float, HeldPrompt] = field(default_factory=dict)
    live: int = 0  # threads waiting or running


@dataclass
class EngineStats:
    pool_bytes: int
    pool_used_bytes: int
    pool_peak_bytes: int
    running: int
    waiting: int
    tokens_generated: int
    busy_s: float
    preemptions: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_generated / self.busy_s if self.busy_s else 0.0


class Engine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, adapters: AdapterSet,
                 kv_budget_bytes: int, max_running: int = 256, eos_ids: Iterable[int] = (), cuda_graphs: bool = False):
        """``cuda_graphs``: replay the decode step as a CUDA graph while the batch keeps its shape
        (:mod:`workers.decode_graph`; CUDA only, off by default)."""
        self.model, self.tokenizer, self.adapters = model, tokenizer, adapters
        geometry = kv_geometry(model)
        parameter = next(model.parameters())
        self.pool = KVPool(kv_budget_bytes, geometry.head_dim, parameter.dtype, parameter.device)
        self.layers, self.kv_heads = geometry.num_layers, geometry.num_kv_heads
        self.slots_per_token = geometry.num_layers * geometry.num_kv_heads
        self.cache = self._new_cache()
        self.budget_model = KVBudgetModel(geometry.kv_bytes_per_token, adapters.windows, adapters.growths)
        self.scheduler = Scheduler(self.pool.capacity, self.slots_per_token, self.budget_model, max_running)
        # The chain family's rule (threads of other families carry their own); ``eos_ids``: every EOS id of the
        # model's generation_config.json, which ends a thread of any family.
        self.eos_ids = tuple(eos_ids)
        self.stop = StopRule.for_tokenizer(tokenizer, eos_ids=self.eos_ids)
        self._stops: dict[tuple, StopRule] = {}
        self.rows: list[Thread] = []  # the running threads, in the cache's row order
        self.row_state = RowState(parameter.device)  # their per-row state on the device, in the same order
        self._arrivals = 0
        self.tokens_generated = 0
        self.busy_s = 0.0
        self.preemptions = 0
        self.prompt_prefills = 0  # prompts prefilled (once per task and ratio)
        self.tasks: dict[str, EngineTask] = {}
        self._free_owners = list(range(MAX_OWNERS - 1, 0, -1))  # owner 0: slots of no task
        self.graphs = DecodeGraph(self) if cuda_graphs and parameter.is_cuda else None

    def _new_cache(self) -> PagedDMSCache:
        return PagedDMSCache(self.pool, self.layers, self.kv_heads)

    # -- requests ------------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], samples: list[int], params: SamplingParams, cr: float = 1.0,
               task_id: str | None = None, keep: bool = False, family: TaskFamily | None = None) -> list[Thread]:
        """Queue threads ``samples`` (their indices in the task) of a tokenized prompt; thread i is seeded
        ``thread_seed(params.seed, i)``. ``task_id`` (default: the request) groups requests that share a prompt;
        ``keep`` holds the task (and its prompt) until :meth:`close_task`; ``family`` (default: chain) says how
        its threads stop and what their answers are."""
        self.adapters.index(cr)  # an unknown ratio fails here, before any work
        task_id = task_id or request_id
        stop = self._stop_rule(family)
        threads = []
        for index in samples:
            thread_params = dataclasses.replace(params, seed=thread_seed(params.seed, index))
            thread = Thread(request_id, index, list(prompt_ids), thread_params, cr, task_id=task_id, seq=self._arrivals,
                            stop=stop)
            if family is not None:
                thread.family = family
            self._arrivals += 1
            need = self.scheduler.reservation(thread)
            if need > self.pool.capacity:
                raise BudgetError(
                    f"kv_budget: one thread of {thread.total_length} tokens at {cr:g}x needs {need * self.pool.slot_bytes} "
                    f"bytes of KV, the pool holds {self.pool.budget_bytes}"
                )
            threads.append(thread)
        task = self._task(task_id, keep)
        task.live += len(threads)
        self.scheduler.add(threads)
        return threads

    def _stop_rule(self, family: TaskFamily | None) -> StopRule | None:
        """A family's stop rule, built once per family (``None``: the chain family, which reads ``self.stop``)."""
        if family is None or (family.name == "chain" and not family.stop_strings):
            return None
        key = (family.name, tuple(family.stop_strings))
        if key not in self._stops:
            self._stops[key] = StopRule.for_tokenizer(self.tokenizer, family, self.eos_ids)
        return self._stops[key]

    def encode(self, prompt: str) -> list[int]:
        """A prompt's token ids (for callers that drive the engine directly with text)."""
        return self.tokenizer(prompt)["input_ids"]

    def _task(self, task_id: str, keep: bool) -> EngineTask:
        task = self.tasks.get(task_id)
        if task is None:
            if not self._free_owners:
                raise BudgetError(f"tasks: at most {MAX_OWNERS - 1} open at once on one engine")
            owner = self._free_owners.pop()
            self.pool.reset_owner(owner)
            task = self.tasks[task_id] = EngineTask(owner, keep)
        task.keep |= keep
        return task

    def cancel(self, request_id: str) -> int:
        """Stop every thread of one request now; their slots are free when this returns. Returns how many stopped."""
        return self._stop(lambda t: t.problem_id == request_id)

    def close_task(self, task_id: str) -> int:
        """Stop what is left of a task and free its held prompts. Returns how many threads stopped."""
        stopped = self._stop(lambda t: t.task_id == task_id)
        task = self.tasks.pop(task_id, None)
        if task is not None:
            for held in task.prompts.values():
                held.cache.remove_rows([0])
            self.scheduler.release(task_id)
            self._free_owners.append(task.owner)
        return stopped

    def _stop(self, match: Callable[[Thread], bool]) -> int:
        waiting, running = self.scheduler.drop(match)
        self._drop(running)
        self._ended(waiting + running)
        return len(waiting) + len(running)

    def _ended(self, threads: list[Thread]) -> None:
        """Threads left their tasks; a task that is not kept closes with its last thread."""
        for thread in threads:
            task = self.tasks.get(thread.task_id)
            if task is not None:
                task.live -= 1
        for task_id in {t.task_id for t in threads}:
            task = self.tasks.get(task_id)
            if task is not None and task.live <= 0 and not task.keep:
                self.close_task(task_id)

    def task_peak_bytes(self, task_id: str) -> int:
        """The most KV bytes the task has held at once (0 for a task that is not open)."""
        task = self.tasks.get(task_id)
        return self.pool.owner_peak_bytes(task.owner) if task is not None else 0

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def fit(self, prompt_ids: list[int], params: SamplingParams, cr: float) -> int:
        """How many threads of this request the whole pool holds at once (they share the prompt)."""
        self.adapters.index(cr)  # an unknown ratio fails here
        fit = self.budget_model.threads_that_fit(self.pool.budget_bytes, cr, len(prompt_ids), params.max_new_tokens)
        return min(fit, self.scheduler.max_running)

    def close(self) -> None:
        """Detach the gate banks from the model (another engine or a DMS handle may then use it)."""
        self.adapters.detach()

    def stats(self) -> EngineStats:
        return EngineStats(self.pool.budget_bytes, self.pool.used_bytes, self.pool.high_water_bytes,
                           len(self.scheduler.running), len(self.scheduler.waiting), self.tokens_generated,
                           self.busy_s, self.preemptions)

    # -- the loop ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[ThreadResult]:
        """Admit, make room, decode one token per running thread; returns the threads that finished."""
        began = time.perf_counter()
        finished: list[ThreadResult] = []
        while group := self.scheduler.next_admission():
            try:
                finished += self._start(group)
            except _PoolShort:  # threads outgrew their reservations: wait for memory to free up
                self.scheduler.unadmit(group)
                break
        if self.rows:
            finished += self._make_room()
        if self.rows:
            threads = list(self.rows)
            replayed = self.graphs.step() if self.graphs is not None else None
            if replayed is not None:
                finished += self._advance(threads, None, packed=replayed)
            else:
                finished += self._advance(threads, self._decode_logits())
        self.busy_s += time.perf_counter() - began
        return finished

    def _decode_logits(self) -> torch.Tensor:
        """The decode step's forward pass: one token of every running row, the next logits ``[rows, vocab]``."""
        gated = self.row_state.any_gated()
        self.adapters.use_rows(self.row_state.adapter, gated)
        self.cache.set_evicting(gated)
        return self._forward(self.cache, self.row_state.next_input[:, None], self.cache.lengths()[:, None])

    def run(self, on_result=None) -> list[ThreadResult]:
        """Step until nothing is waiting or running."""
        results = []
        while self.has_work():
            for result in self.step():
                results.append(result)
                if on_result is not None:
                    on_result(result)
        return results

    def _forward(self, cache: PagedDMSCache, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        device = self.pool.keys.device
        return self.model(  # the positions copied: the cache advances its lengths in place during the pass
            input_ids=input_ids.to(device), position_ids=position_ids.to(device).clone(), past_key_values=cache,
            use_cache=True,
            attention_mask=None,  # what each query sees comes from the cache's slot tables, not a mask
            cache_position=torch.arange(input_ids.shape[1], device=device),
        ).logits[:, -1]

    def _prefill(self, token_ids: list[int], cr: float, rows_after: int, owner: int,
                 start: HeldPrompt | None = None) -> tuple[PagedDMSCache, torch.Tensor | None]:
        """A one-row cache holding ``start``'s prompt (if given) and then ``token_ids`` (in chunks), and the logits
        after its last token (None when there was nothing to run)."""
        cache = self._new_cache()
        if start is not None:
            cache.extend(start.cache, keep_source=True)
        else:
            cache.add_rows([self.adapters.window(cr)], [owner])
        offset = start.tokens if start is not None else 0
        self.adapters.set_rows([cr])
        cache.set_evicting(cr != 1)
        ids = torch.tensor(token_ids, dtype=torch.long)
        logits = None
        for first in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[first : first + PREFILL_CHUNK]
            # Room for this chunk and for the next decode step of every row, the new ones included.
            if not self.pool.has_free((len(chunk) + len(self.rows) + rows_after) * self.slots_per_token):
                cache.remove_rows([0])
                raise _PoolShort
            positions = torch.arange(offset + first, offset + first + len(chunk))
            logits = self._forward(cache, chunk[None], positions[None])
        return cache, logits

    def _held_prompt(self, thread: Thread, rows_after: int) -> HeldPrompt:
        """The task's prompt at the thread's ratio: held already, or prefilled now and held from here on."""
        task = self.tasks[thread.task_id]
        held = task.prompts.get(thread.cr)
        if held is None:
            cache, logits = self._prefill(thread.prompt_ids, thread.cr, rows_after, task.owner)
            held = task.prompts[thread.cr] = HeldPrompt(cache, logits[0], len(thread.prompt_ids))
            self.prompt_prefills += 1
            self.scheduler.hold((thread.task_id, thread.cr), len(thread.prompt_ids))
        return held

    def _start(self, group: list[Thread]) -> list[ThreadResult]:
        first = group[0]
        held = self._held_prompt(first, len(group))
        adapter = self.adapters.index(first.cr)
        if first.tokens:  # resume a preempted thread: its prompt is held; replay its own tokens
            cache, _ = self._prefill(first.tokens[:-1], first.cr, 1, 0, start=held)
            self.cache.extend(cache)
            self.rows.append(first)
            self.row_state.add([first], [adapter], first.tokens[-1:])
            return []
        self.cache.extend(held.cache, repeat=len(group), keep_source=True)
        begin = len(self.rows)
        self.rows += group
        self.row_state.add(group, [adapter] * len(group), [0] * len(group))
        return self._advance(group, held.logits.expand(len(group), -1), slice(begin, begin + len(group)))

    def _advance(self, threads: list[Thread], logits: torch.Tensor | None, rows: slice = slice(None),
                 packed: torch.Tensor | None = None) -> list[ThreadResult]:
        """Sample one token for each of ``threads`` (the batch's ``rows``, rows of ``logits``, in order); retire the
        finished. ``packed``: what a replayed decode graph sampled already (:meth:`_sample`'s output)."""
        tops = self.top_logprobs_wanted(threads)
        if packed is None:
            packed = self._sample(logits, rows, tops)
        tokens, logprobs, alternatives = self._read_step(packed, len(threads), tops)
        done = [t for t, token, lp, top in zip(threads, tokens, logprobs, alternatives)
                if t.append(token, lp, t.stop or self.stop, top[:t.params.top_logprobs] if t.params.logprobs else ())]
        self.tokens_generated += len(threads)
        return self._retire(done)

    @staticmethod
    def top_logprobs_wanted(threads: list[Thread]) -> int:
        """How many most likely alternatives the step ranks per row: the most any of ``threads`` asks for (0: none,
        and the step ranks nothing)."""
        return max((t.params.top_logprobs for t in threads if t.params.logprobs), default=0)

    def _sample(self, logits: torch.Tensor, rows: slice, tops: int = 0) -> torch.Tensor:
        """On the device: draw ``rows``' tokens, record them in the batch, and pack what the host reads of the step
        (the tokens, their log-probs, the pool's slots in use, each layer's longest line and, when ``tops``, every
        row's ``tops`` most likely tokens and their log-probs) into one tensor."""
        chosen = sample_rows(logits, *self.row_state.sampling(rows))
        all_logprobs = torch.log_softmax(logits.float(), dim=-1)
        logprobs = all_logprobs.gather(-1, chosen[:, None])[:, 0]
        self.row_state.record(chosen, rows)
        parts = [chosen.double(), logprobs.double(), self.pool.used_counter().double(), self.cache.widest_lines().double()]
        if tops:
            values, ids = all_logprobs.topk(min(tops, all_logprobs.shape[-1]), dim=-1)
            parts += [ids.double().flatten(), values.double().flatten()]
        return torch.cat(parts)

    def _read_step(self, packed: torch.Tensor, count: int, tops: int = 0) \
            -> tuple[list[int], list[float], list[tuple[tuple[int, float], ...]]]:
        """The step's one read of the device (:meth:`_sample`'s tensor), so that the host admits, makes room and sizes
        the tables without another: returns the ``count`` tokens, their log-probs and each row's ranked
        alternatives (empty without ``tops``)."""
        values = read_to_host(packed)
        self.pool.observe(int(values[2 * count]))
        layers = len(self.cache.layers)
        self.cache.observe_widest([int(w) for w in values[2 * count + 1 : 2 * count + 1 + layers]])
        ranked: list[tuple[tuple[int, float], ...]] = [()] * count
        if tops:
            start = 2 * count + 1 + layers
            ids, logprobs = values[start : start + count * tops], values[start + count * tops : start + 2 * count * tops]
            ranked = [tuple((int(i), float(lp)) for i, lp in zip(ids[r * tops:(r + 1) * tops],
                                                                 logprobs[r * tops:(r + 1) * tops])) for r in range(count)]
        return [int(t) for t in values[:count]], values[count : 2 * count], ranked

    def progress(self, request_ids: set[str]) -> list[tuple[str, ThreadTokens]]:
        """The tokens each running thread of ``request_ids`` decoded since its last report (a finished thread's last
        tokens travel in its ``ThreadResult``); each thread's are reported once."""
        found = []
        for thread in self.rows:
            if thread.problem_id in request_ids and len(thread.tokens) > thread.reported:
                start, end = thread.reported, len(thread.tokens)
                details = (tuple(thread.token_logprobs[start:end]), tuple(thread.top_logprobs[start:end])) \
                    if thread.params.logprobs else ()
                found.append((thread.problem_id,
                              ThreadTokens(thread.sample_index, tuple(thread.tokens[start:end]), end, *details)))
                thread.reported = end
        return found

    def _retire(self, threads: list[Thread]) -> list[ThreadResult]:
        """Results for finished ``threads`` (what their rows held, read in one go), then their rows leave."""
        if not threads:
            return []
        rows = self._row_indices(threads)
        device = self.pool.keys.device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        prompts = torch.tensor([len(t.prompt_ids) for t in threads], dtype=torch.long, device=device)
        owners = torch.tensor([self.tasks[t.task_id].owner for t in threads], dtype=torch.long, device=device)
        columns = [self.cache.realized_compression()[index], self.cache.memory_compression()[index],
                   *self.cache.kept_fractions(rows, prompts), self.pool.owner_peak[owners]]
        curves = self.cache.generated_kept_curve(rows, prompts, CURVE_POINTS)
        table = read_to_host(torch.cat([torch.stack([c.double() for c in columns], dim=1), curves.double()], dim=1))
        results = [t.result(self.tokenizer, realized, memory, (prompt_kept, generated_kept),
                            _defined(CURVE_POINTS, curve), int(peak) * self.pool.slot_bytes)
                   for t, (realized, memory, prompt_kept, generated_kept, peak, *curve) in zip(threads, table)]
        self.scheduler.finish(threads)
        self._drop(threads)
        self._ended(threads)
        return results

    def _row_indices(self, threads: list[Thread]) -> list[int]:
        row = {id(t): i for i, t in enumerate(self.rows)}
        return [row[id(t)] for t in threads]

    def _drop(self, threads: list[Thread]) -> None:
        """Take ``threads``' rows out of the batch; their slots go back to the pool now."""
        if not threads:
            return
        rows = self._row_indices(threads)
        self.cache.remove_rows(rows)
        leaving = set(rows)
        kept = [row for row in range(len(self.rows)) if row not in leaving]
        self.row_state.keep(kept)
        self.rows = [self.rows[row] for row in kept]

    def _make_room(self) -> list[ThreadResult]:
        """Preempt the newest threads until this decode step's new tokens fit in the free slots."""
        while not self.pool.has_free(len(self.rows) * self.slots_per_token):
            victim = self.scheduler.pick_victim()
            if victim is None:  # one thread alone outgrew the pool (it compressed far less than its ratio)
                self.rows[0].finish_reason = "kv_budget"
                return self._retire(self.rows[:1])
            self._drop([victim])
            self.scheduler.preempt(victim)
            self.preemptions += 1
        return []
