"""``thinkpool bench gpu``: the one prepared GPU benchmark (``python -m evaluation.gpu_bench [--out DIR]``).

It runs on the device machine as it is (python, torch, transformers, numpy; no pydantic, ray, kvpress,
langgraph, fastapi or redis), so this module and everything it imports stay off those: the engine is built from
its parts (``workers.engine`` and ``dms_runtime``), never through ``workers.worker``, and the retrofit step is
written here from ``dms_runtime``'s training attention rather than imported from ``training`` (pydantic).

What it measures, in order, each section under its own time limit (the whole command within about 4-5 minutes on
one H200): the environment and the device's copy bandwidth; the CUDA tests (``tests/test_cuda.py`` and the decode
kernel's CUDA test, through pytest when it is installed); a Qwen3-8B-shaped model made from its config with random
bf16 weights on the device (nothing is loaded from anywhere), with DMS gates whose bias makes them mark about
``1 - 1/cr`` of the tokens (so past the window they evict toward ``cr``); then, at one KV budget,

* Hugging Face ``generate`` on the vanilla model (its default ``DynamicCache``) with the largest batch that fits;
* the engine at CR 1 and at DMS-``cr`` with as many threads as its admission lets in, each timed eagerly and then
  with its decode step replayed as a CUDA graph (``graphs`` in its report; :mod:`workers.decode_graph`);

and one adapter-only retrofit training step (gates trained, weights frozen) at 4K tokens.

**Caches are prefilled synthetically, then a few decode steps are timed.** Generating 8K-token threads for real
would take thousands of decode steps (minutes per run), past the budget of the whole command. So each engine run
prefills its 1K-token prompt through the model (the shared held prompt, its gates deciding what the prompt keeps),
then writes each thread's own tokens up to ``--context`` through the cache's own interface (``set_gate_logits``,
``update``: what the attention path calls, as prefill chunks), with random K/V and gate logits that mark a token with
probability ``1 - 1/cr``, and so the pool holds what an 8K-token thread at that ratio holds. Hugging Face's
``DynamicCache`` is filled with random K/V of the same length. The timed steps are then real: the model, the gates,
eviction, sampling, the engine's bookkeeping. What is not measured is prefill and the long-run scheduling of
threads that finish and are replaced.

Every run reports its threads, tokens/s, the median decode step, the step's bandwidth bound (the weights read per
step, the input embedding aside, plus the KV bytes held, over the measured copy bandwidth), their ratio, the KV
held, and the host-device synchronisations per decode step, counted from the warnings of
``torch.cuda.set_sync_debug_mode("warn")`` over a few more steps after the timed ones, since raising the warnings
costs time (CUDA only). The engine's runs also count, on any device, what would make the host wait
(:class:`~workers.sync_probe.SyncProbe`: ``probe_syncs_per_step``, 0 for a decode step) apart from the reads the
engine means (``reads_per_step``: one, its tokens, log-probs and counters). JSON goes to stdout and to
``DIR/gpu_bench.json``, a
PNG to ``DIR/gpu_bench.png`` (skipped, with a note, without matplotlib). ``--tiny --device cpu`` runs every
section on a tiny model in seconds: the suite's smoke test (``tests/test_gpu_bench.py``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import math
import platform
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
from transformers import (DynamicCache, LogitsProcessor, LogitsProcessorList, Qwen3Config, Qwen3ForCausalLM,
                          StoppingCriteria, StoppingCriteriaList)

from dms_runtime.attach import attach_dms
from dms_runtime.config import DMSConfig
from dms_runtime.gate_bank import AdapterSet
from dms_runtime.gates import build_gates
from dms_runtime.loading import kv_geometry
from dms_runtime.paged_cache import PagedDMSCache
from workers.decode_graph import DecodeGraph
from workers.engine import Engine
from workers.sync_probe import SyncProbe
from workers.thread import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1_000_000.0, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False)
TASK = "gpu-bench"
MAX_THREADS = 4096


@dataclass(frozen=True)
class Plan:
    """The sizes and time limits one invocation runs at (``--tiny`` shrinks them all)."""

    shape: dict
    kv_budget_bytes: int
    prompt: int
    context: int
    window: int
    cr: float
    warmup: int
    steps: int
    sync_steps: int  # decode steps after the timed ones, with the sync counter on (its warnings cost time)
    fill_chunk: int
    train_tokens: int
    copy_bytes: int
    limits: dict  # section -> seconds


def make_plan(args) -> Plan:
    tiny = args.tiny
    limits = {"tests": 100, "hf_generate": 45, "engine_cr1": 60, "engine_dms": 60, "training": 40}
    if tiny:
        limits = {"tests": 60, "hf_generate": 15, "engine_cr1": 15, "engine_dms": 15, "training": 15}
    return Plan(
        shape=TINY if tiny else QWEN3_8B,
        kv_budget_bytes=int((args.kv_budget_gb if args.kv_budget_gb is not None else (0.004 if tiny else 40)) * 1e9),
        prompt=args.prompt or (64 if tiny else 1024),
        context=args.context or (384 if tiny else 8192),
        window=args.window or (32 if tiny else 512),
        cr=args.cr,
        warmup=args.warmup if args.warmup is not None else (1 if tiny else 2),
        steps=args.steps or (3 if tiny else 8),
        sync_steps=1 if tiny else 2,
        fill_chunk=16 if tiny else 128,
        train_tokens=args.train_tokens or (256 if tiny else 4096),
        copy_bytes=(32 if tiny else 4096) * 2**20,
        limits=limits,
    )


def log(message: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- timing and sync counting ----------------------------------------------------------------------------
class Clock:
    """Marks on the device's timeline (CUDA events: recording one does not wait for the device) or the host's."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_s(self, first: int = 0) -> list[float]:
        """Seconds between consecutive marks from mark ``first`` on (waits for the device)."""
        marks = self.marks[first:]
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in zip(marks, marks[1:])]
        return [b - a for a, b in zip(marks, marks[1:])]


class SyncCounter:
    """Host-device synchronisations while armed, counted from the warnings ``set_sync_debug_mode("warn")`` raises
    (``count`` stays None off CUDA, where there is nothing to count)."""

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        self.count: int | None = None
        self._armed = False

    def __enter__(self) -> "SyncCounter":
        if self.enabled:
            self._catcher = warnings.catch_warnings(record=True)
            self._caught = self._catcher.__enter__()
            warnings.simplefilter("always")
        return self

    def arm(self) -> None:
        if self.enabled and not self._armed:
            torch.cuda.set_sync_debug_mode("warn")
            self._armed = True

    def disarm(self) -> None:
        if self._armed:
            torch.cuda.set_sync_debug_mode("default")
            self._armed = False

    def __exit__(self, *exc) -> None:
        self.disarm()
        if self.enabled:
            self._catcher.__exit__(*exc)
            self.count = sum("synchroniz" in str(w.message) for w in self._caught)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- environment ---------------------------------------------------------------------------------------
def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device, copy_bytes: int) -> dict:
    """Versions, the device, and its copy bandwidth: one large device-to-device copy, bytes read plus written."""
    env = {"python": platform.python_version(), "platform": platform.platform(),
           **{name: version(name) for name in ("torch", "transformers", "triton", "numpy", "safetensors", "matplotlib",
                                               "pytest")},
           "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"device_name": props.name, "cuda": torch.version.cuda, "sm_count": props.multi_processor_count,
                "memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}"}
    else:
        env |= {"device_name": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    source = torch.ones(copy_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    clock, repeats = Clock(device), 10
    clock.mark()
    for _ in range(repeats):
        target.copy_(source)
    clock.mark()
    elapsed = sum(clock.intervals_s())
    env["copy_bytes"] = copy_bytes
    env["copy_ms"] = round(1000 * elapsed / repeats, 4)
    env["bandwidth_bytes_per_s"] = 2 * copy_bytes * repeats / elapsed
    del source, target
    free_memory(device)
    return env


def cuda_tests(device: torch.device, limit_s: float) -> dict:
    """The CUDA tests, in a subprocess (before the big model takes the device's memory)."""
    if importlib.util.find_spec("pytest") is None:
        return {"status": "skipped", "note": "pytest is not installed"}
    tests = ["tests/test_cuda.py"]
    if device.type == "cuda":
        tests.append("tests/test_decode_attention.py::test_cuda_kernel_matches_reference")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *tests]
    began = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "tests": tests, "seconds": round(time.perf_counter() - began, 1),
                "note": f"stopped after {limit_s:g} s"}
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    summary = lines[-1].strip("= ") if lines else ""
    status = "failed" if done.returncode else ("passed" if "passed" in summary else "skipped")
    report = {"status": status, "tests": tests, "summary": summary, "seconds": round(time.perf_counter() - began, 1)}
    if done.returncode:
        report["output_tail"] = (done.stdout + done.stderr)[-3000:]
    return report


# -- the model and its gates -----------------------------------------------------------------------------
def build_model(shape: dict, device: torch.device, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """A Qwen3 of ``shape`` with random weights made on the device, in ``dtype`` from the start."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(Qwen3Config(**shape))
    finally:
        torch.set_default_dtype(previous)
    model.config.use_cache = True
    return model.to(dtype).eval().requires_grad_(False)


def weight_bytes(model) -> tuple[int, int]:
    """All parameter bytes, and those one decode step reads (the input embedding reads only its rows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    return total, total - embedding.numel() * embedding.element_size()


def calibrated_gates(model, window: int, cr: float, prompt: int,
                     seed: int = 0) -> tuple[torch.nn.ModuleList, DMSConfig, dict]:
    """Random gates plus one bias, chosen on this model's own attention inputs so that about ``1 - 1/cr`` of all
    decisions (every layer and head) mark their token: past the window they then evict toward ``cr``."""
    generator = torch.Generator().manual_seed(seed)
    zero = DMSConfig(window=window, init_offset=0.0)
    gates = build_gates(model, zero)
    hidden = model.config.hidden_size
    for gate in gates:
        gate.weight.data.copy_(torch.randn(gate.weight.shape, generator=generator) / (100.0 * hidden**0.5))
    device = next(model.parameters()).device
    gates.to(device)
    logits: list[torch.Tensor] = []

    def recorder(gate):
        def hook(module, args, kwargs):
            logits.append(gate(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).flatten().float())
        return hook

    hooks = [layer.self_attn.register_forward_pre_hook(recorder(gate), with_kwargs=True)
             for layer, gate in zip(model.model.layers, gates)]
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=generator).to(device)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    pooled = torch.cat(logits)
    if pooled.numel() > 2**24:  # torch.quantile's limit
        pooled = pooled[torch.randperm(pooled.numel(), device=pooled.device)[: 2**24]]
    offset = -float(torch.quantile(pooled, 1 / cr))  # raw logits above their 1/cr quantile mark
    config = DMSConfig(window=window, init_offset=offset)
    for gate in gates:
        gate.config = config
    return gates, config, {"window": window, "cr": cr, "offset": round(offset, 4),
                           "marked_fraction": round(float((pooled + offset > 0).float().mean()), 4)}


# -- runs ---------------------------------------------------------------------------------------------------
def step_report(method: str, cr: float, threads: int, intervals: list[float], kv_held: int, weights_read: int,
                bandwidth: float, syncs: int | None, sync_steps: int) -> dict:
    """What every run reports about its timed decode steps (and the syncs of the ``sync_steps`` after them)."""
    median = statistics.median(intervals)
    bound = (weights_read + kv_held) / bandwidth
    return {"method": method, "cr": cr, "threads": threads, "steps": len(intervals),
            "tokens_per_s": round(threads * len(intervals) / sum(intervals), 2),
            "median_step_ms": round(1000 * median, 4), "bound_ms": round(1000 * bound, 4),
            "ratio_to_bound": round(median / bound, 3), "kv_held_bytes": int(kv_held),
            "syncs": syncs, "sync_steps": sync_steps,
            "syncs_per_step": None if syncs is None else round(syncs / sync_steps, 2)}


class _StepClock(LogitsProcessor):
    """Marks the clock at every token ``generate`` chooses; the sync counter is on between calls ``arm`` and
    ``disarm`` (0-based), so it counts whole steps and not the warnings' cost inside the timed ones."""

    def __init__(self, clock: Clock, counter: SyncCounter, arm: int, disarm: int):
        self.clock, self.counter, self.arm, self.disarm = clock, counter, arm, disarm

    def __call__(self, input_ids, scores):
        self.clock.mark()
        call = len(self.clock.marks) - 1
        if call == self.arm:
            self.counter.arm()
        elif call == self.disarm:
            self.counter.disarm()
        return scores


class _Deadline(StoppingCriteria):
    def __init__(self, deadline: float):
        self.deadline = deadline

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), time.perf_counter() > self.deadline, dtype=torch.bool,
                          device=input_ids.device)


def hf_generate_run(model, plan: Plan, bandwidth: float, weights_read: int, deadline: float) -> dict:
    """Hugging Face ``generate``, greedy, on a ``DynamicCache`` already holding ``context`` random tokens per row,
    with the largest batch whose cache fits the budget at the last step."""
    device = next(model.parameters()).device
    geometry = kv_geometry(model)
    forwards = plan.warmup + plan.steps + plan.sync_steps + 1
    batch = plan.kv_budget_bytes // (geometry.kv_bytes_per_token * (plan.context + forwards))
    if batch < 1:
        return {"method": "hf_generate", "cr": 1.0, "error": "the budget holds no thread of this length"}
    began = time.perf_counter()
    cache = DynamicCache(config=model.config)
    dtype = next(model.parameters()).dtype
    shape = (batch, geometry.num_kv_heads, plan.context, geometry.head_dim)
    for layer in range(geometry.num_layers):
        keys, values = (torch.randn(shape, dtype=dtype, device=device) for _ in range(2))
        cache.update(keys, values, layer)
    ids = torch.randint(1, model.config.vocab_size, (batch, plan.context + 1), device=device)  # 0 pads
    synchronize(device)
    fill_s = time.perf_counter() - began
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    clock, counter = Clock(device), SyncCounter(device)
    timed_end = plan.warmup + plan.steps
    step_clock = _StepClock(clock, counter, arm=timed_end, disarm=timed_end + plan.sync_steps)
    with counter:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=forwards, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([step_clock]),
                             stopping_criteria=StoppingCriteriaList([_Deadline(deadline)]))
    intervals = clock.intervals_s(first=plan.warmup)[: plan.steps]
    held = cache.get_seq_length() * batch * geometry.kv_bytes_per_token
    counted = len(clock.marks) - 1 - timed_end  # the counter's steps (fewer if the deadline stopped generate)
    syncs = counter.count if counted == plan.sync_steps else None
    report = {**step_report("hf_generate", 1.0, batch, intervals, held, weights_read, bandwidth, syncs,
                            plan.sync_steps),
              "context_tokens": plan.context, "fill_s": round(fill_s, 2), "new_tokens": out.shape[1] - ids.shape[1]}
    del cache, out, ids
    return report


def fill_synthetic(cache: PagedDMSCache, target: int, chunk: int, mark_fraction: float, deadline: float) -> int:
    """Write random tokens into every row of ``cache`` until each holds ``target`` positions (or time runs out),
    ``chunk`` at a time, through the interface the attention path uses: the gate logits (marking a token with
    probability ``mark_fraction``), then ``update``, which decides, releases what has expired and packs each head's
    line as a prefill chunk does. Returns the rows' length reached."""
    layer0 = cache.layers[0]
    rows, heads = layer0.table.shape[0], layer0.table.shape[1]
    pool = cache.pool
    length = int(cache.lengths().min())
    noise = torch.randn(rows, heads, chunk, pool.head_dim, dtype=pool.keys.dtype, device=pool.keys.device)
    cache.set_evicting(mark_fraction > 0)
    while length < target and time.perf_counter() < deadline:
        q = min(chunk, target - length)
        states = noise[:, :, :q]
        for index in range(len(cache.layers)):
            if mark_fraction > 0:
                marks = torch.rand(rows, q, heads, device=pool.keys.device) < mark_fraction
                cache.set_gate_logits(index, torch.where(marks, 1.0, -1.0))
            cache.update(states, states, index)
        length += q
    return length


class _NoText:
    """The engine's tokenizer for token ids that mean nothing: no EOS and no answer marker, so no thread stops."""

    eos_token_id = -1

    def get_vocab(self) -> dict:
        return {}

    def decode(self, ids, **kwargs) -> str:
        return ""


def engine_run(model, adapters: dict, cr: float, plan: Plan, bandwidth: float, weights_read: int,
               deadline: float, seed: int = 0) -> dict:
    """The engine at ``cr``: as many threads of one 1K-token prompt as admission lets in, the prompt prefilled
    through the model once, each thread's own tokens written synthetically up to ``context``, then decode steps."""
    device = next(model.parameters()).device
    method = "engine" if cr == 1 else "engine_dms"
    gate_banks = AdapterSet(model, adapters)
    try:
        engine = Engine(model, _NoText(), gate_banks, plan.kv_budget_bytes, max_running=MAX_THREADS)
    except BaseException:
        gate_banks.detach()
        raise
    try:
        generator = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, model.config.vocab_size, (plan.prompt,), generator=generator).tolist()
        # Headroom past the timed steps for the fill's transient: one chunk per head in one layer, in tokens of
        # the limit that a thread's reservation keeps at its ratio.
        slack = math.ceil(2 * plan.fill_chunk * cr / engine.layers) + plan.warmup + plan.steps + plan.sync_steps + 2
        own = plan.context - plan.prompt + slack
        params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=own, seed=seed)
        threads = engine.fit(prompt, params, cr)
        if threads < 1:
            return {"method": method, "cr": cr, "error": "the budget holds no thread of this length"}
        began = time.perf_counter()
        engine.submit(TASK, prompt, list(range(threads)), params, cr=cr)
        engine.step()  # prefill the shared prompt, admit every thread, decode one token
        admitted = len(engine.rows)
        with torch.inference_mode():  # the engine's cache tensors are inference tensors
            marked = 1 - 1 / cr if cr > 1 else 0.0
            reached = fill_synthetic(engine.cache, plan.context, plan.fill_chunk, marked, deadline)
        synchronize(device)
        fill_s = time.perf_counter() - began
        for _ in range(plan.warmup):
            engine.step()
        clock, counter = Clock(device), SyncCounter(device)
        clock.mark()
        for _ in range(plan.steps):
            engine.step()
            clock.mark()
            if time.perf_counter() > deadline:
                break
        cache, pool = engine.cache, engine.pool
        held = pool.used_bytes  # at the last timed step
        with counter:
            counter.arm()
            for _ in range(plan.sync_steps):
                engine.step()
        with SyncProbe() as probe:  # on any device: what would make the host wait, and the reads the engine means
            for _ in range(plan.sync_steps):
                engine.step()
        intervals = clock.intervals_s()
        report = step_report(method, cr, len(engine.rows), intervals, held, weights_read, bandwidth,
                             counter.count, plan.sync_steps)
        report |= {
            "probe_syncs_per_step": round(probe.syncs / plan.sync_steps, 2), "probe_ops": dict(probe.ops),
            "reads_per_step": round(probe.reads / plan.sync_steps, 2),
            "admitted": admitted, "context_tokens": reached, "prompt_tokens": plan.prompt, "fill_s": round(fill_s, 2),
            "kv_read_bytes": int(cache.held_slots().sum()) * pool.slot_bytes,  # each row reads the shared prompt
            "kv_peak_bytes": pool.high_water_bytes, "kv_budget_bytes": pool.budget_bytes,
            "memory_compression": round(float(cache.memory_compression().mean()), 3),
            "preemptions": engine.preemptions,
        }
        report["graphs"] = graph_steps(engine, plan, device, report["bound_ms"], deadline)
        engine.cancel(TASK)
        report["slots_in_use_after"] = pool.used
        return report
    finally:
        engine.close()


def graph_steps(engine: Engine, plan: Plan, device: torch.device, bound_ms: float, deadline: float) -> dict:
    """The same engine's decode steps as CUDA graphs (:mod:`workers.decode_graph`): one eager step at the shape, the
    capture, ``warmup`` replays, then ``steps`` timed ones (recaptured if a table grows meanwhile)."""
    if device.type != "cuda":
        return {"skipped": "CUDA graphs need a CUDA device"}
    engine.graphs = DecodeGraph(engine)
    try:
        for _ in range(2 + plan.warmup):
            engine.step()
        clock = Clock(device)
        clock.mark()
        for _ in range(plan.steps):
            engine.step()
            clock.mark()
            if time.perf_counter() > deadline:
                break
        intervals = clock.intervals_s()
        graphs = engine.graphs
        median = statistics.median(intervals) if intervals else math.nan
        return {"steps": len(intervals), "median_step_ms": round(1000 * median, 4),
                "tokens_per_s": round(len(engine.rows) * len(intervals) / sum(intervals), 2) if intervals else None,
                "ratio_to_bound": round(1000 * median / bound_ms, 3), "captures": graphs.captures,
                "replays": graphs.replays, "failure": graphs.failure}
    finally:
        engine.graphs = None
        engine.cache.static_bounds = False


def retrofit_step(model, source: torch.nn.ModuleList, config: DMSConfig, tokens: int, cr: float, seed: int = 0) -> dict:
    """One adapter-only retrofit step (what ``training/retrofit.py`` does per step, without its data and schedule):
    the frozen model as its own teacher (gates off), the student with trainable gates in DMS training attention,
    forward KL on every token plus the one-sided compression loss toward ``1 - 1/cr`` evicted past the window."""
    device = next(model.parameters()).device
    gates = build_gates(model, config).to(device)
    gates.load_state_dict(source.state_dict())
    gates.requires_grad_(True)
    handle = attach_dms(model, gates, config)
    optimizer = torch.optim.AdamW(gates.parameters(), lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=generator).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        synchronize(device)
        began = time.perf_counter()
        with torch.no_grad(), handle.mode("off"):
            teacher = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), dim=-1)
        handle.set_mode("train")
        student = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), dim=-1)
        kl = (teacher.exp() * (teacher - student)).sum(-1).mean()
        del teacher, student
        alphas = torch.stack([a.float() for a in handle.alphas()])  # [layers, 1, decisions, T]
        left = torch.arange(tokens, device=device) < tokens - config.window - 1  # keys past the last query's window
        evicted = alphas[..., left].mean() if bool(left.any()) else alphas.sum() * 0
        loss = kl + torch.relu((1 - 1 / cr) - evicted)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        synchronize(device)
        elapsed = time.perf_counter() - began
        grads = [p.grad for p in gates.parameters() if p.grad is not None]
        report = {"tokens": tokens, "step_s": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 1),
                  "kl": round(kl.item(), 5), "evicted_fraction": round(evicted.item(), 4),
                  "loss": round(loss.item(), 5),
                  "trainable_parameters": sum(p.numel() for p in gates.parameters()),
                  "frozen_parameters": sum(p.numel() for p in model.parameters()),
                  "grads_finite": bool(grads) and all(bool(torch.isfinite(g).all()) for g in grads)}
        if device.type == "cuda":
            report["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        return report
    finally:
        handle.detach()
        del gates, optimizer


# -- the whole command ---------------------------------------------------------------------------------------
def section(report: dict, name: str, limit_s: float, total_deadline: float, work) -> None:
    """Run one section under its time limit; a failure is reported in its place and the next section still runs."""
    began = time.perf_counter()
    if began > total_deadline:
        report["sections"][name] = {"skipped": "the command's time limit had passed"}
        return
    deadline = min(began + limit_s, total_deadline)
    log(f"{name} (limit {limit_s:g} s)")
    try:
        work(deadline)
        outcome = {"seconds": round(time.perf_counter() - began, 2)}
    except Exception as error:  # noqa: BLE001: every section must leave a report behind
        outcome = {"seconds": round(time.perf_counter() - began, 2), "error": f"{type(error).__name__}: {error}"[:2000]}
        log(f"{name} failed: {outcome['error']}")
    if time.perf_counter() > deadline + 1:
        outcome["over_limit"] = True
    report["sections"][name] = outcome


def draw(report: dict, path: Path) -> str | None:
    """Tokens/s per run and each run's median step against its bound; returns a note when it cannot draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG"
    runs = [r for r in report["runs"] if "tokens_per_s" in r]
    if not runs:
        return "no run finished: no PNG"
    labels = [f"{r['method']}\n{r['cr']:g}x, {r['threads']} thr" for r in runs]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.bar(labels, [r["tokens_per_s"] for r in runs], color=["#888", "#4a7", "#27c"][: len(runs)])
    left.set_ylabel("decode tokens/s")
    budget = report["config"]["kv_budget_bytes"] / 1e9
    left.set_title(f"{report['environment'].get('device_name', '')}, KV budget {budget:g} GB")
    x = range(len(runs))
    right.bar([i - 0.2 for i in x], [r["median_step_ms"] for r in runs], 0.4, label="median step")
    right.bar([i + 0.2 for i in x], [r["bound_ms"] for r in runs], 0.4, label="bandwidth bound")
    right.set_xticks(list(x), labels)
    right.set_ylabel("ms per decode step (log)")
    right.set_yscale("log")
    right.legend()
    for i, r in enumerate(runs):
        right.annotate(f"{r['ratio_to_bound']:.1f}x", (i - 0.2, r["median_step_ms"]), ha="center", va="bottom",
                       fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0].strip("`: "))
    p.add_argument("--out", type=Path, default=Path("."), help="where gpu_bench.json and gpu_bench.png go (default: .)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny: the smoke test)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and sizes: every section in seconds")
    p.add_argument("--kv-budget-gb", type=float, default=None,
                   help="the KV budget of every run, in 10^9 bytes (default 40; tiny 0.004)")
    p.add_argument("--cr", type=float, default=8.0, help="the DMS ratio the gates evict toward (default 8)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 1024)")
    p.add_argument("--context", type=int, default=None, help="thread length at the timed steps (default 8192)")
    p.add_argument("--window", type=int, default=None, help="the DMS window (default 512)")
    p.add_argument("--warmup", type=int, default=None, help="untimed decode steps first (default 2)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per run (default 8)")
    p.add_argument("--train-tokens", type=int, default=None, help="tokens of the retrofit step (default 4096)")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds for the whole command (default 300)")
    p.add_argument("--skip", nargs="+", default=[], help="sections to leave out",
                   choices=["tests", "hf_generate", "engine_cr1", "engine_dms", "training"])
    return p


def run(args, argv: list[str], prog: str | None = None) -> dict:
    began = time.perf_counter()
    total_deadline = began + args.time_limit
    device = torch.device(args.device)
    plan = make_plan(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    report: dict = {
        "command": " ".join([prog or "python -m evaluation.gpu_bench", *(shlex.quote(a) for a in argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {"model": "tiny" if args.tiny else "qwen3-8b-shaped (random bf16 weights)", "shape": plan.shape,
                   "dtype": str(dtype).removeprefix("torch."), "kv_budget_bytes": plan.kv_budget_bytes,
                   "prompt_tokens": plan.prompt, "context_tokens": plan.context, "window": plan.window, "cr": plan.cr,
                   "warmup_steps": plan.warmup, "timed_steps": plan.steps, "train_tokens": plan.train_tokens,
                   "method": "caches prefilled synthetically, then timed decode steps (see the module docstring)"},
        "sections": {}, "runs": [], "notes": [],
    }
    log("environment and copy bandwidth")
    report["environment"] = environment(device, plan.copy_bytes)
    bandwidth = report["environment"]["bandwidth_bytes_per_s"]
    log(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + written)")
    if "tests" in args.skip:
        report["cuda_tests"] = {"status": "skipped", "note": "--skip tests"}
    else:
        section(report, "tests", plan.limits["tests"], total_deadline,
                lambda deadline: report.__setitem__("cuda_tests",
                                                    cuda_tests(device, max(1.0, deadline - time.perf_counter()))))
        log(f"tests: {report.get('cuda_tests', {}).get('status')} {report.get('cuda_tests', {}).get('summary', '')}")

    log("model")
    built = time.perf_counter()
    model = build_model(plan.shape, device, dtype)
    synchronize(device)
    total, read = weight_bytes(model)
    geometry = kv_geometry(model)
    report["model"] = {"parameters": sum(p.numel() for p in model.parameters()), "weight_bytes": total,
                       "weight_bytes_read_per_step": read, "kv_bytes_per_token": geometry.kv_bytes_per_token,
                       "attention": model.config._attn_implementation, "build_s": round(time.perf_counter() - built, 2)}
    gates, dms, report["gates"] = calibrated_gates(model, plan.window, plan.cr, plan.prompt)
    log(f"gates marking {report['gates']['marked_fraction']:.3f} of tokens (target {1 - 1 / plan.cr:.3f})")

    def add_run(name, work):
        def body(deadline):
            outcome = work(deadline)
            report["runs"].append(outcome)
            if "median_step_ms" in outcome:
                log(f"{name}: {outcome['threads']} threads, {outcome['tokens_per_s']} tokens/s, step "
                    f"{outcome['median_step_ms']} ms, bound {outcome['bound_ms']} ms, "
                    f"syncs/step {outcome['syncs_per_step']}, graphs {outcome.get('graphs')}")
        if name in args.skip:
            report["sections"][name] = {"skipped": f"--skip {name}"}
            return
        section(report, name, plan.limits[name], total_deadline, body)
        free_memory(device)

    adapters = {plan.cr: (gates, dms)}
    add_run("hf_generate", lambda deadline: hf_generate_run(model, plan, bandwidth, read, deadline))
    add_run("engine_cr1", lambda deadline: engine_run(model, adapters, 1.0, plan, bandwidth, read, deadline))
    add_run("engine_dms", lambda deadline: engine_run(model, adapters, plan.cr, plan, bandwidth, read, deadline))
    by_method = {r["method"]: r for r in report["runs"] if "tokens_per_s" in r}
    if "engine_dms" in by_method:
        dms_rate = by_method["engine_dms"]["tokens_per_s"]
        report["speedups"] = {f"engine_dms_over_{m}": round(dms_rate / by_method[m]["tokens_per_s"], 3)
                              for m in ("hf_generate", "engine") if m in by_method}

    def training(deadline):
        tokens = plan.train_tokens
        while True:
            try:
                report["training"] = retrofit_step(model, gates, dms, tokens, plan.cr)
                return
            except torch.cuda.OutOfMemoryError:
                if tokens < 1024 or time.perf_counter() > deadline:
                    raise
            free_memory(device)  # out here, the failed step's tensors are no longer held by the traceback
            report["notes"].append(f"the retrofit step ran out of memory at {tokens} tokens; retried at {tokens // 2}")
            tokens //= 2

    if "training" in args.skip:
        report["sections"]["training"] = {"skipped": "--skip training"}
    else:
        section(report, "training", plan.limits["training"], total_deadline, training)
        if "training" in report:
            log(f"retrofit step: {report['training']['tokens']} tokens in {report['training']['step_s']} s")

    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "gpu_bench.png"
    note = draw(report, png)
    report["plot"] = None if note else str(png)
    if note:
        report["notes"].append(note)
    report["total_s"] = round(time.perf_counter() - began, 1)
    (args.out / "gpu_bench.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"done in {report['total_s']} s")
    return report


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser(prog).parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here; use --tiny --device cpu for the smoke run", file=sys.stderr)
        return 2
    report = run(args, argv, prog)
    print(json.dumps(report))
    failed = [name for name, s in report["sections"].items() if "error" in s]
    return 1 if failed or report.get("cuda_tests", {}).get("status") in ("failed", "timeout") else 0


if __name__ == "__main__":
    sys.exit(main())
