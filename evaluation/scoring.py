"""``thinkpool eval``: run a problem file through the model and score it.

One sample is greedy; more are temperature-sampled threads whose answers are majority-voted. Vanilla and
DMS runs go through the workers (:func:`evaluate_on_pool`: the engine and its fixed KV pool); the
training-free kvpress baselines use the reference decode loop (:func:`evaluate`), since a press shrinks a
dense Hugging Face cache that the engine's pool does not use.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass

from dms_runtime.loading import kv_geometry
from policies.voting import vote_by
from evaluation.reference_decode import KVPolicy, SamplingParams, generate_threads
from tasks.families import TaskFamily, get_family
from tasks.jsonl import problem_seed, row_family
from tasks.prompt import format_prompt


@dataclass(frozen=True)
class EvalOptions:
    samples: int = 1
    seed: int = 0
    temperature: float = 0.8
    top_p: float = 1.0
    max_new_tokens: int = 1536
    batch_size: int = 64
    vote: str = "majority"  # how sampled threads' answers become one (policies.voting.VOTES)


def evaluate(
    problems: list[dict],
    model,
    tokenizer,
    options: EvalOptions,
    model_name: str,
    progress: bool = True,
    kv: KVPolicy | None = None,
    method: str = "vanilla",
) -> dict:
    """Score ``problems`` with one KV method; returns the report (summary fields and one record per problem)."""
    sampling = SamplingParams(
        temperature=0.0 if options.samples == 1 else options.temperature,
        top_p=options.top_p,
        max_new_tokens=options.max_new_tokens,
        seed=options.seed,
    )
    prompts = [format_prompt(p["prompt"]) for p in problems]
    generation = generate_threads(model, tokenizer, prompts, options.samples, sampling, options.batch_size, progress, kv)
    threads_by_problem: dict[int, list] = defaultdict(list)
    for thread in generation.threads:
        threads_by_problem[thread.problem_index].append(thread)
    records = [problem_record(problem, threads_by_problem[index], vote=options.vote)
               for index, problem in enumerate(problems)]
    return {
        "method": method,
        **summarize(records, generation.tokens_generated, generation.elapsed_s),
        "realized_cr": generation.realized_cr,
        "kv_peak_bytes": generation.kv_peak_bytes,
        "samples_per_problem": options.samples,
        "config": {
            "model": model_name,
            "kv_bytes_per_token": kv_geometry(model).kv_bytes_per_token,
            "samples": options.samples,
            "decoding": "greedy" if options.samples == 1 else f"sampled+{options.vote}",
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_new_tokens": options.max_new_tokens,
            "seed": options.seed,
            "batch_size": options.batch_size,
        },
        "problems": records,
    }


def problem_record(problem: dict, threads: list, family: TaskFamily | None = None, vote: str = "majority") -> dict:
    """One problem's outcome from its threads (anything with ``answer``, ``tokens``, ``mean_logprob``,
    ``min_logprob`` and ``realized_cr``) under the ``vote`` rule, answers compared and grouped by the problem's task
    ``family`` (default: chain); each thread's answer and confidence are kept, so that other aggregations can be
    scored on the same threads later."""
    family = family or get_family("chain")
    vote = vote_by(vote, [t.answer for t in threads], [t.mean_logprob for t in threads], key=family.key)
    return {
        "id": problem["id"],
        "k": problem.get("k"),
        "expected": problem["answer"],
        "answer": vote.answer,
        "correct": family.same(vote.answer, problem["answer"]),
        "votes": vote.counts,
        "samples": len(threads),
        "thread_accuracy": sum(family.same(t.answer, problem["answer"]) for t in threads) / max(1, len(threads)),
        "tokens": sum(t.tokens for t in threads),
        "realized_cr": sum(t.realized_cr for t in threads) / max(1, len(threads)),
        "threads": [{"answer": t.answer, "tokens": t.tokens, "mean_logprob": round(t.mean_logprob, 5),
                     "min_logprob": round(t.min_logprob, 5)} for t in threads],
    }


def summarize(records: list[dict], tokens_generated: int, elapsed_s: float) -> dict:
    by_k: dict[int, list[bool]] = defaultdict(list)
    for record in records:
        if record.get("k") is not None:
            by_k[int(record["k"])].append(record["correct"])
    return {
        "n": len(records),
        "accuracy": sum(r["correct"] for r in records) / len(records),
        "mean_thread_accuracy": sum(r["thread_accuracy"] for r in records) / len(records),
        "accuracy_by_k": {str(k): sum(v) / len(v) for k, v in sorted(by_k.items())},
        "n_by_k": {str(k): len(v) for k, v in sorted(by_k.items())},
        "tokens_generated": tokens_generated,
        "elapsed_s": round(elapsed_s, 3),
        "tokens_per_s": tokens_generated / elapsed_s if elapsed_s > 0 else 0.0,
    }


async def evaluate_on_pool(
    problems: list[dict],
    pool,
    tokenizer,
    options: EvalOptions,
    cr: float,
    method: str,
    fit: bool = False,
    sequential: bool = False,
    progress: bool = True,
    default_task: str = "chain",
) -> dict:
    """Score ``problems`` on a worker pool (Ray ``WorkerPool`` or in-process ``LocalPool``) at ratio ``cr``; a row
    is of its own task family (``task``), else of ``default_task`` (the model's).

    ``sequential`` solves one problem at a time, each with the whole pool (``--kv-budget``); otherwise all
    problems are queued at once and the engines batch them continuously. ``fit`` runs, per problem, as
    many threads as the pool holds at once at this ratio (``--samples fit``). A problem's threads are seeded
    from its id (:func:`~tasks.jsonl.problem_seed`)."""
    from tqdm import tqdm

    from workers.thread import SamplingParams
    from workers.worker import ProblemRequest

    def params(samples: int, problem: dict) -> SamplingParams:
        return SamplingParams(0.0 if samples == 1 else options.temperature, options.top_p, options.max_new_tokens,
                              seed=problem_seed(options.seed, problem["id"]))

    families = [row_family(p, default_task) for p in problems]
    prompts = [tuple(f.encode(p["prompt"], tokenizer)) for f, p in zip(families, problems)]
    counts = [options.samples] * len(problems)
    if fit:
        counts = [await pool.fit(list(ids), params(2, p), cr) for ids, p in zip(prompts, problems)]
    requests = [ProblemRequest(f"eval-{i}", ids, tuple(range(n)), params(n, p), cr, task_family=f.name,
                               answer_pattern=getattr(f, "answer_pattern", None) or None,
                               stop_strings=tuple(f.stop_strings))
                for i, (ids, n, p, f) in enumerate(zip(prompts, counts, problems, families))]
    await pool.reset_peaks()
    started = time.perf_counter()
    with tqdm(total=sum(counts), desc=method, unit="thread", disable=not progress) as bar:
        def tick(_):
            bar.update(1)

        if sequential:
            results = [await pool.collect(r, tick) for r in requests]
        else:
            results = await asyncio.gather(*(pool.collect(r, tick) for r in requests))
    elapsed = time.perf_counter() - started
    stats = [s for s in await pool.stats() if s is not None]
    threads = [t for group in results for t in group]
    records = [problem_record(problem, group, family, options.vote)
               for problem, group, family in zip(problems, results, families)]
    info = pool.info()
    return {
        "method": method,
        **summarize(records, sum(t.tokens for t in threads), elapsed),
        "realized_cr": sum(t.realized_cr for t in threads) / max(1, len(threads)),
        "kv_cr": sum(t.kv_cr for t in threads) / max(1, len(threads)),
        "kv_peak_bytes": max(s.pool_peak_bytes for s in stats),
        "kv_budget_bytes": info["kv_budget_bytes"],
        "samples_per_problem": sum(counts) / len(counts),
        "preemptions": sum(t.preemptions for t in threads),
        "config": {
            "model": info["model"],
            "backend": "engine",
            "workers": info["workers"],
            "cr": cr,
            "kv_bytes_per_token": info["geometry"]["kv_bytes_per_token"],
            # The fractions admission reserved per thread (measured, or 1/cr with --reserve nominal; None: vanilla).
            "kv_growth": info["budget_model"]["growth"].get(cr),
            "samples": "fit" if fit else options.samples,
            "one_problem_at_a_time": sequential,
            "decoding": "greedy" if set(counts) == {1} else f"sampled+{options.vote}",
            "temperature": options.temperature,
            "top_p": options.top_p,
            "max_new_tokens": options.max_new_tokens,
            "seed": options.seed,
        },
        "problems": records,
    }
