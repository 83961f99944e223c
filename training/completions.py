"""The frozen model's own completions of a problem file: the training text of a retrofit on the user's prompts.

Each prompt is encoded by its task family (``tasks/families.py``: the chat template, thinking) and sampled by the
engine, as a worker would (the model's ``generation_config.json`` sampling and EOS ids, the family's stop rule).
The completions are cached as JSON Lines in the run's output directory, one row per thread as it finishes, so an
interrupted or repeated run samples only what is missing. A cached row is reused while its prompt's token ids and
its sampling settings are what this run would use.
"""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from dms_runtime.model_dir import generation_defaults
from tasks.families import default_family
from tasks.jsonl import ProblemFileError, problem_seed, read_jsonl, read_problems, row_family
from workers.records import ThreadResult
from workers.thread import SamplingParams
from workers.worker import WorkerConfig, build_engine

CACHE_NAME = "retrofit-completions.jsonl"


@dataclass(frozen=True)
class Completion:
    """One sampled thread of one problem, as cached."""

    id: str
    sample: int
    prompt_ids: list[int]
    # The generated tokens, and an EOS when the thread ended at one: the model's first EOS id (the engine does not say
    # which of them ended it); no position reads it, it is there so that the stop decision is distilled.
    completion_ids: list[int]
    finish_reason: str
    sampling: dict  # the SamplingParams it was drawn with (its seed: the problem's)
    text: str = ""  # for people reading the cache

    @property
    def key(self) -> tuple[str, int]:
        return self.id, self.sample

    @property
    def decoded_ids(self) -> list[int]:
        """Prompt and completion as a thread fed them through the model: without the EOS that ended it."""
        return self.prompt_ids + (self.completion_ids[:-1] if self.finish_reason == "eos" else self.completion_ids)


def calibration_sequences(completions: list[Completion], n: int) -> list[list[int]]:
    """``n`` completions spread evenly over the problem file (not its head, which may be its easiest), as decoded."""
    return [c.decoded_ids for c in completions[:: max(1, len(completions) // n)][:n]]


def model_sampling(model_dir: str | Path, max_new_tokens: int) -> SamplingParams:
    """The model's own sampling: ``generation_config.json``'s temperature, top_p, top_k and min_p; what it does not
    declare is the plain distribution (temperature 1, no truncation), which distillation is about."""
    declared = generation_defaults(model_dir)
    temperature = float(declared.get("temperature", 1.0)) or 1.0  # 0 there means greedy decoding: sample anyway
    return SamplingParams(temperature=temperature, top_p=float(declared.get("top_p", 1.0)),
                          max_new_tokens=max_new_tokens, top_k=int(declared.get("top_k", 0)),
                          min_p=float(declared.get("min_p", 0.0)), logprobs=True)


def read_problem_file(path: str | Path, task: str) -> list[dict]:
    """The problem file's rows (rows naming no ``task`` are of ``task``); refuses a file whose ids repeat (each id is
    one prompt, and its threads' seeds come from it)."""
    problems = read_problems(path, task=task)
    seen: set[str] = set()
    for problem in problems:
        if problem["id"] in seen:
            raise ProblemFileError(f"{path}: field 'id': {problem['id']!r} appears more than once")
        seen.add(problem["id"])
    return problems


def sample_completions(model_dir: str | Path, problems_path: str | Path, out_dir: str | Path, task: str | None = None,
                       *, samples: int = 1, max_new_tokens: int = 2048, seed: int = 0, quiet: bool = False,
                       temperature: float | None = None) -> list[Completion]:
    """``samples`` completions of every problem of a problem file (see :func:`complete_problems`)."""
    task = task or default_family(model_dir)
    return complete_problems(model_dir, read_problem_file(problems_path, task), out_dir, task, samples=samples,
                             max_new_tokens=max_new_tokens, seed=seed, quiet=quiet, temperature=temperature)


def complete_problems(model_dir: str | Path, problems: list[dict], out_dir: str | Path, task: str | None = None,
                      *, samples: int = 1, max_new_tokens: int = 2048, seed: int = 0, quiet: bool = False,
                      temperature: float | None = None) -> list[Completion]:
    """``samples`` completions of every problem row (``id``, ``prompt``), from the cache in ``out_dir`` where it has
    them, else sampled now (and added to the cache). ``task``: the family of rows that name none (default: the
    model's); ``temperature``: instead of the model's own (0: greedy)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    task = task or default_family(model_dir)
    base = model_sampling(model_dir, max_new_tokens)
    if temperature is not None:
        base = SamplingParams(**(asdict(base) | {"temperature": temperature}))
    wanted: dict[tuple[str, int], tuple[dict, list[int], SamplingParams]] = {}
    for problem in problems:
        family = row_family(problem, task)
        prompt_ids = family.encode(problem["prompt"], tokenizer)
        params = SamplingParams(**(asdict(base) | {"seed": problem_seed(seed, problem["id"])}))
        for index in range(samples):
            wanted[(problem["id"], index)] = (problem, prompt_ids, params)
    cache_path = Path(out_dir) / CACHE_NAME
    cached = {row.key: row for row in read_cache(cache_path)}
    found = {key: cached[key] for key, (_, prompt_ids, params) in wanted.items()
             if key in cached and cached[key].prompt_ids == prompt_ids and cached[key].sampling == asdict(params)}
    missing = [key for key in wanted if key not in found]
    if missing:
        found |= _sample(model_dir, wanted, missing, cache_path, task, quiet)
    return [found[key] for key in wanted]


def read_cache(path: Path) -> list[Completion]:
    return [Completion(**row) for row in read_jsonl(path)] if path.is_file() else []


def _sample(model_dir: str | Path, wanted: dict, missing: list[tuple[str, int]], cache_path: Path, task: str,
            quiet: bool) -> dict[tuple[str, int], Completion]:
    """Sample the ``missing`` threads on the engine, appending each to the cache as it finishes."""
    engine = build_engine(WorkerConfig(model=str(model_dir)))
    eos = (list(engine.eos_ids) or [engine.tokenizer.eos_token_id])[0]
    by_problem: dict[str, list[int]] = {}
    for problem_id, index in missing:
        by_problem.setdefault(problem_id, []).append(index)
    for problem_id, indices in by_problem.items():
        problem, prompt_ids, params = wanted[(problem_id, indices[0])]
        engine.submit(problem_id, prompt_ids, indices, params, 1.0, family=row_family(problem, task))
    sampled: dict[tuple[str, int], Completion] = {}
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    with cache_path.open("a", encoding="utf-8") as cache, \
            tqdm(total=len(missing), desc="sampling completions", unit="thread", disable=quiet) as bar:
        def finished(result: ThreadResult) -> None:
            _, prompt_ids, params = wanted[(result.problem_id, result.sample)]
            ids = list(result.token_ids) + ([eos] if result.finish_reason == "eos" and eos is not None else [])
            row = Completion(result.problem_id, result.sample, list(prompt_ids), ids, result.finish_reason,
                             asdict(params), result.text)
            cache.write(json.dumps(asdict(row)) + "\n")
            cache.flush()
            sampled[row.key] = row
            bar.update(1)

        engine.run(on_result=finished)
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the engine's pool and weights go before training loads its own copy
    return sampled
