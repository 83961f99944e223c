"""``thinkpool eval``: run a problem file through the model and score it.

One sample is greedy; more are temperature-sampled threads whose answers are majority-voted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from dms_runtime.loading import kv_geometry
from policies.extraction import answers_match
from policies.voting import majority_vote
from tasks.prompt import format_prompt
from workers.batch_generate import KVPolicy, SamplingParams, generate_threads


@dataclass(frozen=True)
class EvalOptions:
    samples: int = 1
    seed: int = 0
    temperature: float = 0.8
    top_p: float = 1.0
    max_new_tokens: int = 1536
    batch_size: int = 64


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
    records = []
    for index, problem in enumerate(problems):
        threads = threads_by_problem[index]
        vote = majority_vote([t.answer for t in threads])
        records.append(
            {
                "id": problem["id"],
                "k": problem.get("k"),
                "expected": problem["answer"],
                "answer": vote.answer,
                "correct": answers_match(vote.answer, problem["answer"]),
                "votes": vote.counts,
                "thread_accuracy": sum(answers_match(t.answer, problem["answer"]) for t in threads) / len(threads),
                "tokens": sum(t.tokens for t in threads),
                "realized_cr": sum(t.realized_cr for t in threads) / len(threads),
            }
        )
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
            "decoding": "greedy" if options.samples == 1 else "sampled+majority",
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_new_tokens": options.max_new_tokens,
            "seed": options.seed,
            "batch_size": options.batch_size,
        },
        "problems": records,
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
