"""Scoring a problem file through the solve service's controller (``eval --controller``, ``bench controller``).

Each problem is one solve request, as the REST API would run it, so what is scored is what users get.
"""

from __future__ import annotations

import time

from evaluation.scoring import summarize
from orchestrator.schemas import SolveRequest
from tasks.jsonl import problem_seed


async def evaluate_with_controller(problems: list[dict], service, kv_budget: int, max_threads: int, seed: int = 0,
                                   progress=None) -> dict:
    """Score ``problems`` through the solve service's controller, one at a time, each with the whole ``kv_budget``;
    a problem's task is seeded from its id. Returns the summary with the ratios and thread counts it chose, and
    one record per problem."""
    records, tokens = [], 0
    started = time.perf_counter()
    for index, problem in enumerate(problems):
        request = SolveRequest(prompt=problem["prompt"], task=problem.get("task"),
                               answer_pattern=problem.get("answer_pattern"), samples="auto", mode="controller",
                               kv_budget=kv_budget, max_threads=max_threads, seed=problem_seed(seed, problem["id"]))
        same = service.family(request).same
        result = await service.solve(request, job_id=f"eval-{index}-{problem['id']}")
        threads = result.threads
        tokens += result.tokens
        # The plan that ran: a greedy_confidence profile's first plan is its probe thread; its replan is the plan.
        plan = next((e for e in reversed(result.rounds) if e["event"] in ("plan", "replan")), {})
        records.append({"id": problem["id"], "k": problem.get("k"), "expected": problem["answer"], "answer": result.answer,
                        "correct": same(result.answer, problem["answer"]), "votes": result.votes,
                        "signal": plan.get("signal"),
                        "thread_accuracy": sum(same(t.answer, problem["answer"]) for t in threads) / len(threads),
                        "threads": len(threads), "cr": result.cr, "temperature": plan.get("temperature"),
                        "stop_reason": result.stop_reason, "kv_peak_bytes": result.kv_peak_bytes,
                        "tokens": result.tokens, "rounds": result.rounds})
        if progress is not None:
            progress(f"{problem['id']}: k={problem.get('k')} {result.cr:g}x x{len(threads)} -> {result.answer} "
                     f"({'right' if records[-1]['correct'] else 'wrong'}, {result.stop_reason})")
    temperatures = sorted({r["temperature"] for r in records if r["temperature"] is not None})
    return {
        "method": "controller",
        **summarize(records, tokens, time.perf_counter() - started),
        "samples_per_problem": sum(r["threads"] for r in records) / len(records),
        "ratios_chosen": {f"{cr:g}": sum(r["cr"] == cr for r in records) for cr in sorted({r["cr"] for r in records})},
        "threads_chosen": {str(n): sum(r["threads"] == n for r in records) for n in sorted({r["threads"] for r in records})},
        "temperatures_chosen": {f"{t:g}": sum(r["temperature"] == t for r in records) for t in temperatures},
        "kv_peak_bytes": max(r["kv_peak_bytes"] for r in records),
        "problems": records,
    }
