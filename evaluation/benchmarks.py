"""``thinkpool bench throughput``: what one KV budget buys, side by side in one run.

At a fixed pool size every method decodes sampled threads of the same hard problems:

* ``hf-generate``: Hugging Face ``generate`` on the vanilla model with the largest batch whose dense
  cache (prompt + token limit, every row) fits the budget;
* ``engine`` at CR 1 and with each DMS adapter: as many threads as the engine's admission control
  holds at once in that pool.

Every run reports its concurrent threads, tokens/s and the KV peak (never above the budget).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tasks.chain import generate_suite
from tasks.prompt import format_prompt
from workers.thread import SamplingParams


def hard_prompts(count: int, seed: int = 4242) -> list[str]:
    return [format_prompt(p["prompt"]) for p in generate_suite(count, 16, 20, seed=seed)]


@torch.inference_mode()
def bench_hf_generate(model, tokenizer, prompts: list[str], budget: int, params: SamplingParams) -> dict:
    """The largest batch whose dense cache fits ``budget``, decoded by ``model.generate``."""
    from dms_runtime.loading import kv_geometry

    per_token = kv_geometry(model).kv_bytes_per_token
    longest = max(len(tokenizer(p)["input_ids"]) for p in prompts)
    batch = budget // (per_token * (longest + params.max_new_tokens))
    if batch < 1:
        return {"method": "hf-generate", "cr": 1, "threads": 0, "tokens_per_s": 0.0, "kv_peak_bytes": 0}
    rows = [prompts[i % len(prompts)] for i in range(batch)]
    encoded = tokenizer(rows, return_tensors="pt", padding=True)
    torch.manual_seed(params.seed)
    started = time.perf_counter()
    out = model.generate(**encoded, do_sample=True, temperature=params.temperature, top_p=params.top_p,
                         max_new_tokens=params.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    elapsed = time.perf_counter() - started
    generated = out[:, encoded["input_ids"].shape[1]:]
    finished = generated == tokenizer.eos_token_id
    # Tokens up to and including each row's EOS; the padding after it is not useful work.
    useful = torch.where(finished.any(-1), finished.int().argmax(-1) + 1, torch.full((batch,), generated.shape[1])).sum()
    return {
        "method": "hf-generate", "cr": 1, "threads": batch, "tokens_per_s": float(useful) / elapsed,
        "kv_peak_bytes": batch * out.shape[1] * per_token, "tokens": int(useful), "elapsed_s": round(elapsed, 3),
    }


def bench_engine(engine, prompts: list[str], cr: float, params: SamplingParams) -> dict:
    """As many threads as fit at once in the engine's pool at ratio ``cr``, spread over ``prompts``."""
    threads = engine.fit(engine.encode(prompts[0]), params, cr)
    per_prompt = [threads // len(prompts) + (i < threads % len(prompts)) for i in range(len(prompts))]
    engine.pool.high_water = 0
    tokens_before, peak_running = engine.tokens_generated, 0
    started = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, per_prompt)):
        if n:
            engine.submit(f"bench-{cr:g}-{i}", engine.encode(prompt), list(range(n)), SamplingParams(
                params.temperature, params.top_p, params.max_new_tokens, params.seed + i), cr)
    while engine.has_work():
        engine.step()
        peak_running = max(peak_running, len(engine.rows))
    elapsed = time.perf_counter() - started
    tokens = engine.tokens_generated - tokens_before
    return {
        "method": "engine", "cr": cr, "threads": peak_running, "tokens_per_s": tokens / elapsed,
        "kv_peak_bytes": engine.pool.high_water_bytes, "tokens": tokens, "elapsed_s": round(elapsed, 3),
        "preemptions": engine.preemptions,
    }


def bench_throughput(model_dir: str | Path, budget: int, max_new_tokens: int, prompts: int = 4, seed: int = 0,
                     temperature: float = 0.8, ratios: list[float] | None = None, progress=print) -> dict:
    from workers.worker import WorkerConfig, build_engine

    engine = build_engine(WorkerConfig(model=str(model_dir), kv_budget_bytes=budget))
    params = SamplingParams(temperature, 1.0, max_new_tokens, seed)
    texts = hard_prompts(prompts)
    ratios = [1.0] + list(engine.adapters.ratios) if ratios is None else ratios
    progress("hf-generate ...")
    with engine.adapters.detached():
        runs = [bench_hf_generate(engine.model, engine.tokenizer, texts, engine.pool.budget_bytes, params)]
    for cr in ratios:
        progress(f"engine at {cr:g}x ...")
        runs.append(bench_engine(engine, texts, cr, params))
    return {"kv_budget_bytes": engine.pool.budget_bytes, "max_new_tokens": max_new_tokens, "prompts": prompts, "runs": runs}


def bench_overhead(pool, prompt_ids: list[int], samples: int, max_new_tokens: int, repeats: int = 3,
                   stream_tokens: bool = False) -> dict:
    """Wall time of a ``samples``-thread solve through ``pool`` against the engine's own busy time for it.

    Both clocks cover the same request in the same run, so the difference is what the path around the
    engine costs (Ray actor calls, serialization, streaming, asyncio), not machine noise between runs.
    ``stream_tokens``: each repeat runs twice, the same threads (one seed) without and with their tokens streamed
    as they decode (with their log-probabilities and 5 alternatives, as an OpenAI stream with logprobs asks),
    one after the other, and both are reported with the ratio of their wall times."""
    import asyncio

    from workers.worker import ProblemRequest

    async def one(index: int, streamed: bool = False) -> tuple[float, float, int]:
        before = [s for s in await pool.stats() if s is not None]
        batches: list = []
        params = SamplingParams(0.8, 1.0, max_new_tokens, index, logprobs=streamed, top_logprobs=5 if streamed else 0)
        started = time.perf_counter()
        await pool.collect(ProblemRequest(f"overhead-{index}-{streamed}", tuple(prompt_ids), tuple(range(samples)),
                                          params, stream_tokens=streamed), on_tokens=batches.append)
        wall = time.perf_counter() - started
        after = [s for s in await pool.stats() if s is not None]
        return wall, sum(a.busy_s for a in after) - sum(b.busy_s for b in before), len(batches)

    def summary(runs: list[tuple[float, float, int]]) -> dict:
        wall, busy = sum(r[0] for r in runs), sum(r[1] for r in runs)
        return {"wall_s": round(wall, 3), "engine_busy_s": round(busy, 3),
                "overhead_fraction": (wall - busy) / busy if busy else None}

    async def all_runs():
        await one(-1)  # warm-up: first-call costs are not per-request overhead
        plain, streamed = [], []
        for i in range(repeats):
            plain.append(await one(i))
            if stream_tokens:
                streamed.append(await one(i, streamed=True))
        return plain, streamed

    plain, streamed = asyncio.run(all_runs())
    report = {"samples": samples, "repeats": repeats, **summary(plain)}
    if stream_tokens:
        report["streamed"] = summary(streamed) | {"token_batches": sum(r[2] for r in streamed)}
        report["streamed_wall_ratio"] = round(report["streamed"]["wall_s"] / report["wall_s"], 3)
    return report


async def bench_load(url: str, concurrency: int, requests: int, samples: int = 2, api_key: str | None = None,
                     seed: int = 0) -> dict:
    """Drive a running server with ``requests`` solves, ``concurrency`` at a time; latency percentiles,
    throughput, errors, lost requests (no answer at all), and the KV pool's peak against its size."""
    import asyncio

    import httpx

    from tasks.chain import generate_suite

    headers = {"X-API-Key": api_key} if api_key else {}
    problems = generate_suite(requests, 1, 8, seed=seed + 5150)
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    gate = asyncio.Semaphore(concurrency)

    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=3600) as client:
        async def one(problem: dict) -> None:
            async with gate:
                started = time.perf_counter()
                try:
                    response = await client.post("/v1/solve", json={"prompt": problem["prompt"], "samples": samples,
                                                                    "seed": seed})
                    key = str(response.status_code)
                    if response.status_code == 200 and "answer" not in response.json():
                        key = "no-answer"
                except httpx.HTTPError as error:
                    key = type(error).__name__
                latencies.append(time.perf_counter() - started)
                statuses[key] = statuses.get(key, 0) + 1

        began = time.perf_counter()
        await asyncio.gather(*(one(p) for p in problems))
        elapsed = time.perf_counter() - began
        metrics = (await client.get("/metrics")).text
    gauges = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("thinkpool_pool") and not line.startswith("#")}
    from policies.statistics import quantile

    def percentile(q: float) -> float:
        return round(quantile(latencies, q), 3)

    return {
        "url": url, "requests": requests, "concurrency": concurrency, "samples": samples,
        "ok": statuses.get("200", 0), "statuses": statuses,
        "errors": requests - statuses.get("200", 0), "server_errors": sum(v for k, v in statuses.items() if k.startswith("5")),
        "lost": requests - sum(statuses.values()),
        "latency_s": {"p50": percentile(0.5), "p95": percentile(0.95), "p99": percentile(0.99)},
        "throughput_rps": requests / elapsed, "elapsed_s": round(elapsed, 3),
        "pool_bytes": gauges.get("thinkpool_pool_bytes"), "pool_peak_bytes": gauges.get("thinkpool_pool_peak_bytes"),
    }


def bench_rest_overhead(url: str, prompt: str, samples: int, max_new_tokens: int, repeats: int = 3,
                        api_key: str | None = None) -> dict:
    """Like :func:`bench_overhead`, through a running server: the wall time of ``POST /v1/solve`` against
    the engines' busy time for it (``thinkpool_engine_busy_seconds`` from ``/metrics``)."""
    import httpx

    headers = {"X-API-Key": api_key} if api_key else {}

    def busy() -> float:
        text = httpx.get(f"{url}/metrics", headers=headers).text
        return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("thinkpool_engine_busy_seconds "))

    def one(index: int) -> tuple[float, float]:
        before = busy()
        started = time.perf_counter()
        response = httpx.post(f"{url}/v1/solve", headers=headers, timeout=3600, json={
            "prompt": prompt.strip(), "samples": samples, "max_tokens": max_new_tokens, "seed": 1000 + index})
        response.raise_for_status()
        return time.perf_counter() - started, busy() - before

    one(-1)
    runs = [one(i) for i in range(repeats)]
    wall, engine = sum(w for w, _ in runs), sum(b for _, b in runs)
    return {"samples": samples, "repeats": repeats, "wall_s": round(wall, 3), "engine_busy_s": round(engine, 3),
            "overhead_fraction": (wall - engine) / engine if engine else None, "path": "rest"}


def compare_to_fixed(fixed: list[dict], controller: dict) -> dict:
    """The controller against the best fixed configuration (most accurate; the fewer tokens on a tie) and, where
    the runs report engine-seconds, against the fixed configuration that solves the most per engine-second."""
    best = max(fixed, key=lambda run: (run["accuracy"], -run["tokens_generated"]))
    comparison = {
        "best_fixed": best["method"],
        "best_fixed_accuracy": best["accuracy"],
        "controller_accuracy": controller["accuracy"],
        "accuracy_gain": round(controller["accuracy"] - best["accuracy"], 4),
        "token_fraction": round(controller["tokens_generated"] / max(1, best["tokens_generated"]), 4),
    }
    if controller.get("solved_per_engine_s") and all(run.get("solved_per_engine_s") for run in fixed):
        thrifty = max(fixed, key=lambda run: run["solved_per_engine_s"])
        comparison.update({
            "engine_s_fraction": round(controller["engine_busy_s"] / best["engine_busy_s"], 4),
            "best_fixed_per_engine_s": thrifty["method"],
            "solved_per_engine_s_ratio": round(controller["solved_per_engine_s"] / thrifty["solved_per_engine_s"], 4),
        })
    return comparison
