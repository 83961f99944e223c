"""Scoring a problem file through the solve service (``eval --controller``, ``bench controller``).

Each problem is one solve request, as the REST API would run it, so what is scored is what users get. Requests
run one at a time, each with the whole pool, or ``concurrency`` at once on one pool, as a server's many tasks
share it: the controller's rounds through its allocator, fixed threads through the engine's admission.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from evaluation.scoring import summarize
from orchestrator.schemas import SolveRequest
from tasks.jsonl import problem_seed


def controller_request(problem: dict, kv_budget: int, max_threads: int, seed: int) -> SolveRequest:
    """The controller picks ratio, threads and temperature; the task is seeded from the problem's id."""
    return SolveRequest(prompt=problem["prompt"], task=problem.get("task"), answer_pattern=problem.get("answer_pattern"),
                        samples="auto", mode="controller", kv_budget=kv_budget, max_threads=max_threads,
                        seed=problem_seed(seed, problem["id"]))


def fixed_request(problem: dict, cr: float, threads: int, temperature: float | None, max_tokens: int,
                  seed: int) -> SolveRequest:
    """Exactly ``threads`` threads at ``cr``: one greedy thread alone, or a vote of sampled threads."""
    return SolveRequest(prompt=problem["prompt"], task=problem.get("task"), answer_pattern=problem.get("answer_pattern"),
                        samples=threads, mode="fixed", cr=cr, temperature=temperature, max_tokens=max_tokens,
                        greedy=threads == 1, seed=problem_seed(seed, problem["id"]))


async def engine_seconds(pool) -> float:
    """The engines' busy time so far, every worker together."""
    return sum(s.busy_s for s in await pool.stats() if s is not None)


async def evaluate_through_service(problems: list[dict], service, request_for: Callable[[dict], SolveRequest],
                                   method: str = "controller", concurrency: int = 1, pool=None,
                                   progress=None) -> dict:
    """Score ``problems``, ``concurrency`` solve requests at a time (``request_for(problem)`` makes each). Returns
    the summary with the ratios and thread counts that ran, one record per problem and, given the ``pool``, the
    engine-seconds the run took and the problems solved per engine-second."""
    records: list[dict] = []
    gate = asyncio.Semaphore(concurrency)
    busy_before = await engine_seconds(pool) if pool is not None else 0.0
    started = time.perf_counter()

    async def one(index: int, problem: dict) -> dict:
        async with gate:
            request = request_for(problem)
            result = await service.solve(request, job_id=f"{method}-{index}-{problem['id']}")
        same = service.family(request).same
        threads = result.threads
        # The plan that ran: a greedy_confidence profile's first plan is its probe thread; its replan is the plan.
        plan = next((e for e in reversed(result.rounds) if e["event"] in ("plan", "replan")), {})
        record = {"id": problem["id"], "k": problem.get("k"), "expected": problem["answer"], "answer": result.answer,
                  "correct": same(result.answer, problem["answer"]), "votes": result.votes,
                  "signal": plan.get("signal"),
                  "thread_accuracy": sum(same(t.answer, problem["answer"]) for t in threads) / len(threads),
                  "threads": len(threads), "cr": result.cr, "temperature": plan.get("temperature"),
                  "stop_reason": result.stop_reason, "kv_peak_bytes": result.kv_peak_bytes,
                  "tokens": result.tokens, "rounds": result.rounds}
        if progress is not None:
            progress(f"{method} {problem['id']}: k={problem.get('k')} {result.cr:g}x x{len(threads)} -> {result.answer} "
                     f"({'right' if record['correct'] else 'wrong'}, {result.stop_reason})")
        return record

    records = list(await asyncio.gather(*(one(i, p) for i, p in enumerate(problems))))
    elapsed = time.perf_counter() - started
    temperatures = sorted({r["temperature"] for r in records if r["temperature"] is not None})
    report = {
        "method": method,
        **summarize(records, sum(r["tokens"] for r in records), elapsed),
        "concurrency": concurrency,
        "samples_per_problem": sum(r["threads"] for r in records) / len(records),
        "ratios_chosen": {f"{cr:g}": sum(r["cr"] == cr for r in records) for cr in sorted({r["cr"] for r in records})},
        "threads_chosen": {str(n): sum(r["threads"] == n for r in records) for n in sorted({r["threads"] for r in records})},
        "temperatures_chosen": {f"{t:g}": sum(r["temperature"] == t for r in records) for t in temperatures},
        "kv_peak_bytes": max(r["kv_peak_bytes"] for r in records),
        "problems": records,
    }
    if pool is not None:
        busy = await engine_seconds(pool) - busy_before
        report["engine_busy_s"] = round(busy, 3)
        report["solved_per_engine_s"] = round(sum(r["correct"] for r in records) / busy, 5) if busy > 0 else None
    return report


async def evaluate_with_controller(problems: list[dict], service, kv_budget: int, max_threads: int, seed: int = 0,
                                   progress=None) -> dict:
    """Score ``problems`` through the solve service's controller, one at a time, each with the whole ``kv_budget``."""
    return await evaluate_through_service(
        problems, service, lambda p: controller_request(p, kv_budget, max_threads, seed), progress=progress)
