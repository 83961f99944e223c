"""``ModelWorker``: one model, its DMS adapters and one engine, driven by a background loop.

The class is plain Python (usable in-process); :mod:`workers.pool` hosts it as a Ray actor. Requests
stream back one :class:`~workers.thread.ThreadResult` per thread as each finishes (``run`` is an async
generator: under Ray, a streaming actor method) and, when asked, their running threads' new tokens in small
batches (:class:`~workers.records.TokenProgress`). The engine is not thread-safe, so every call into it
holds one lock; the loop releases the lock between steps, so submits and cancels wait one step at most.
That wait happens on a helper thread (``_locked``), never on the event loop: an API server or a Ray actor
that resumes many requests at once stays responsive while the engine steps.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import AsyncIterator, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from dms_runtime.adapters import adapter_path, load_gates, model_fingerprint
from dms_runtime.gate_bank import AdapterSet
from dms_runtime.kv_growth import measured_growth, read_kv_growth
from dms_runtime.loading import default_model_path, kv_geometry, load_model
from dms_runtime.model_dir import context_length, eos_token_ids, generation_defaults, has_chat_template, read_config
from dms_runtime.nvidia_layout import NvidiaAdapterSet, load_nvidia_layout, read_dms_config
from tasks.families import TaskFamily, default_family, get_family
from workers.engine import Engine
from workers.records import ThreadResult, TokenProgress
from workers.thread import SamplingParams

DEFAULT_KV_BUDGET = 64 * 2**20


class WorkerConfig(BaseModel):
    """What a worker serves and with how much KV memory."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(default_factory=lambda: str(default_model_path()))
    kv_budget_bytes: int | None = Field(None, gt=0)  # None: DEFAULT_KV_BUDGET on CPU, gpu_memory_fraction on GPU
    gpu_memory_fraction: float = Field(0.5, gt=0, le=0.95)
    max_running: int = Field(256, ge=1)
    device: str = "auto"
    torch_threads: int | None = Field(None, ge=1)
    # What admission reserves per thread: each adapter's measured KV growth (``thinkpool kv-growth``), or DESIGN's
    # nominal 1/cr for every adapter (to compare the two, or when a measurement is not trusted).
    reserve: Literal["measured", "nominal"] = "measured"
    # How often running threads of a request that streams its tokens report them (seconds): small batches, so a
    # reader sees tokens as they are decoded without one message per token.
    token_report_s: float = Field(0.05, gt=0, le=10)


@dataclass(frozen=True)
class ProblemRequest:
    """Threads ``samples`` (indices) of one tokenized prompt; ``request_id`` is unique among a worker's requests.

    Requests with one ``task_id`` share the prompt's prefill and slots (default: the request is its own task);
    ``keep_task`` keeps the task, and its held prompt, open after the request ends, until ``close_task``.
    ``task_family`` (with the regex family's ``answer_pattern`` and any ``stop_strings``) is how the threads stop
    and what their answers are: plain data, so a Ray worker rebuilds the family (``tasks.families.get_family``).
    ``stream_tokens``: the running threads' new tokens stream back (``TokenProgress``) beside the results."""

    request_id: str
    prompt_ids: tuple[int, ...]
    samples: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    cr: float = 1.0
    task_id: str = ""
    keep_task: bool = False
    task_family: str = "chain"
    answer_pattern: str | None = None
    stop_strings: tuple[str, ...] = ()
    stream_tokens: bool = False

    def family(self) -> TaskFamily:
        return get_family(self.task_family, answer_pattern=self.answer_pattern, stop_strings=self.stop_strings or None)

    @property
    def task(self) -> str:
        return self.task_id or self.request_id


@dataclass
class WorkerStats:
    pool_bytes: int
    pool_used_bytes: int
    pool_peak_bytes: int
    reserved_bytes: int
    running: int
    waiting: int
    tokens_generated: int
    tokens_per_s: float
    preemptions: int
    busy_s: float = 0.0  # time the engine spent stepping
    ratios: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def available_ratios(model_dir: str | Path) -> list[float]:
    """The compression ratios served from a model directory: an NVIDIA-layout directory's ``dms_cr`` (none with
    ``dms_disable_eviction``), else those with an adapter file beside the model (``dms-<cr>x.safetensors``)."""
    nvidia = read_dms_config(model_dir)
    if nvidia is not None:
        return [] if nvidia.disable_eviction else [float(nvidia.cr)]
    ratios = []
    for path in Path(model_dir).glob("dms-*x.safetensors"):
        try:
            ratios.append(float(path.name[len("dms-") : -len("x.safetensors")]))
        except ValueError:
            continue
    return sorted(ratios)


def load_adapters(model, model_dir: str | Path, reserve: str = "measured") -> AdapterSet:
    """The gates a worker serves, with their measured KV growth (``reserve="measured"``): an NVIDIA-layout
    directory's own (ratio ``dms_cr``, read as they are; their growth from the directory's growth file, if measured
    on these weights), else thinkpool's ``dms-<cr>x`` adapters beside the model (their growth in their metadata)."""
    layout = load_nvidia_layout(model, model_dir)
    if layout is not None:
        growth = None
        if reserve == "measured" and layout.ratios:
            growth = measured_growth(model_dir, layout.ratio, lambda: model_fingerprint(model, layout.gates))
        return NvidiaAdapterSet(model, layout, growth)
    paths = {cr: adapter_path(model_dir, cr) for cr in available_ratios(model_dir)}
    adapters = {cr: load_gates(model, path) for cr, path in paths.items()}
    growth = {cr: read_kv_growth(path) for cr, path in paths.items()} if reserve == "measured" else {}
    return AdapterSet(model, adapters, growth)


def build_engine(config: WorkerConfig) -> Engine:
    """The model in its stored dtype on a GPU (fp32 on the CPU), its gates, and an engine that stops threads at
    every EOS id of its ``generation_config.json``."""
    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(config.model, device=device)
    adapters = load_adapters(model, config.model, config.reserve)
    budget = config.kv_budget_bytes
    if budget is None:
        budget = int(torch.cuda.mem_get_info()[0] * config.gpu_memory_fraction) if device == "cuda" else DEFAULT_KV_BUDGET
    return Engine(model, tokenizer, adapters, budget, config.max_running, eos_ids=eos_token_ids(config.model))


class ModelWorker:
    def __init__(self, config: WorkerConfig | None = None):
        config = config or WorkerConfig()
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.config = config
        self.engine = build_engine(config)
        # The served weights' identity, gates included (a retrained adapter or an NVIDIA directory's gates, which
        # transformers leaves out of the model, change it): results are cached by it.
        self.fingerprint = model_fingerprint(self.engine.model, self.engine.adapters.banks)
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._task_of: dict[str, str] = {}  # running request id -> its task
        self._streaming: set[str] = set()  # running requests that stream their threads' tokens
        self._reported_at = 0.0
        self._loop_thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._loop_thread.start()

    # -- the engine loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._work.wait()
            with self._lock:
                if not self.engine.has_work():
                    self._work.clear()
                    continue
                results = self.engine.step()
                progress = self._progress()
            for item in progress:
                self._deliver(item.problem_id, item)
            for result in results:
                self._deliver(result.problem_id, result)

    def _progress(self) -> list[TokenProgress]:
        """Every ``token_report_s``: the new tokens of the running threads of requests that stream them."""
        if not self._streaming or time.monotonic() - self._reported_at < self.config.token_report_s:
            return []
        self._reported_at = time.monotonic()
        by_request: dict[str, list] = {}
        for request_id, tokens in self.engine.progress(set(self._streaming)):
            by_request.setdefault(request_id, []).append(tokens)
        return [TokenProgress(request_id, tuple(threads)) for request_id, threads in by_request.items()]

    def _deliver(self, request_id: str, item) -> None:
        listener = self._listeners.get(request_id)
        if listener is not None:
            loop, queue = listener
            loop.call_soon_threadsafe(queue.put_nowait, item)

    # -- the API -------------------------------------------------------------------------------------
    async def _locked(self, call, *args):
        """Run ``call(*args)`` under the engine lock on a helper thread (the event loop never blocks on it)."""

        def locked_call():
            with self._lock:
                return call(*args)

        return await asyncio.to_thread(locked_call)

    async def run(self, request: ProblemRequest) -> AsyncIterator[ThreadResult | TokenProgress]:
        """Yield each thread's result as it finishes (all of ``request.samples``, unless cancelled) and, when the
        request streams its tokens, the running threads' new tokens every ``token_report_s``."""
        if request.request_id in self._listeners:
            raise ValueError(f"request {request.request_id!r} is already running on this worker")
        queue: asyncio.Queue = asyncio.Queue()
        self._listeners[request.request_id] = (asyncio.get_running_loop(), queue)
        self._task_of[request.request_id] = request.task
        if request.stream_tokens:
            self._streaming.add(request.request_id)
        try:
            await self._locked(self.engine.submit, request.request_id, list(request.prompt_ids), list(request.samples),
                               request.params, request.cr, request.task, request.keep_task, request.family())
            self._work.set()
            owed = len(request.samples)
            while owed:
                item = await queue.get()
                if item is None:  # cancelled
                    return
                owed -= isinstance(item, ThreadResult)
                yield item
        finally:
            self._listeners.pop(request.request_id, None)
            self._task_of.pop(request.request_id, None)
            self._streaming.discard(request.request_id)
            # a consumer that went away frees its threads (the helper thread finishes even if this await is cancelled)
            await self._locked(self.engine.cancel, request.request_id)

    async def cancel(self, task_id: str) -> int:
        """Stop every thread of a task (all its requests) and free its held prompts: its KV slots are free when
        this returns. Returns how many threads stopped."""
        stopped = await self._locked(self.engine.close_task, task_id)
        for request_id, task in list(self._task_of.items()):
            if task == task_id:
                self._deliver(request_id, None)
        return stopped

    async def close_task(self, task_id: str) -> None:
        """A kept task is done: free its held prompts."""
        await self._locked(self.engine.close_task, task_id)

    async def fit(self, prompt_ids: list[int], params: SamplingParams, cr: float) -> int:
        return await self._locked(self.engine.fit, prompt_ids, params, cr)

    async def stats(self) -> WorkerStats:
        def snapshot() -> WorkerStats:
            s = self.engine.stats()
            reserved = self.engine.scheduler.reserved() * self.engine.pool.slot_bytes
            return WorkerStats(s.pool_bytes, s.pool_used_bytes, s.pool_peak_bytes, reserved, s.running, s.waiting,
                               s.tokens_generated, s.tokens_per_s, s.preemptions, s.busy_s, list(self.engine.adapters.ratios))

        return await self._locked(snapshot)

    async def reset_peak(self) -> None:
        """Start a new high-water mark (a measurement that wants its own KV peak)."""

        def reset() -> None:
            self.engine.pool.high_water = self.engine.pool.used

        await self._locked(reset)

    def info(self) -> dict:
        """What the service checks requests against: ratios, KV budget and geometry, and the model directory's own
        settings (its default task family, context length, sampling defaults, chat template, gate layout)."""
        model_dir = self.config.model
        return {
            "model": self.config.model,
            "fingerprint": self.fingerprint,
            "ratios": [1.0] + list(self.engine.adapters.ratios),
            "budget_model": self.engine.budget_model.as_dict(),
            "kv_budget_bytes": self.engine.pool.budget_bytes,
            "geometry": kv_geometry(self.engine.model).as_dict(),
            "device": str(self.engine.pool.keys.device),
            "task": default_family(model_dir),
            "context_length": context_length(read_config(model_dir)),
            "generation": generation_defaults(model_dir),
            "chat_template": has_chat_template(model_dir),
            "layout": "nvidia" if isinstance(self.engine.adapters, NvidiaAdapterSet) else "thinkpool",
        }

    def ping(self) -> float:
        return time.time()
