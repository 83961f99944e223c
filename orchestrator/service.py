"""``SolveService``: the one solve path. A request -> its tokenized prompt -> a task on one worker -> a result.

Every surface calls it: the REST API, the SDK's ``LocalClient``, ``thinkpool solve``, ``thinkpool eval
--controller`` and the batch entry point. The prompt is tokenized once, here, and its ids travel down. Each
request is one worker task (id: the job id): all its threads, in every chunk and round, share one prefill
of the prompt per ratio, held on one worker until the task ends, when the service closes it. ``samples="auto"``
goes through the controller (when a calibration profile for the request's task family exists beside the model,
``calibration-<task>.json``, or was given); a number of samples runs that many threads
at one ratio. The task's own KV peak comes back in the result (the worker's lifetime peak is in ``stats``).

A request names its task family (``task``, default: the model directory's, see ``tasks/families.py``): the family
checks the prompt, turns it into model input (the chat template where the model has one), travels with the
threads to the worker (how they stop, what their answers are) and groups equal answers in the vote. Sampling
defaults come from the model's ``generation_config.json`` where it has them, else from the settings.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from orchestrator.allocator import ThreadAllocator
from orchestrator.controller import Budget, Controller, EventListener
from orchestrator.schemas import SolveRequest, SolveResult
from orchestrator.settings import get_settings
from orchestrator.token_events import TokenEvents
from policies.planner import CalibrationProfile
from policies.voting import Verifier, majority_vote, verified_vote
from tasks.families import TaskFamily, get_family
from workers.kv_budget import KVBudgetModel
from workers.records import ThreadResult
from workers.thread import SamplingParams
from workers.worker import ProblemRequest


@dataclass(frozen=True)
class Prepared:
    """A checked request: its model input and what it will run."""

    prompt_ids: tuple[int, ...]
    use_controller: bool
    cr: float
    kv_budget: int
    max_tokens: int
    family: TaskFamily
    prompt: str  # as the family validated it


class SolveService:
    def __init__(self, pool, tokenizer, profiles: list[str | Path | CalibrationProfile] | None = None, checkpointer=None,
                 vote: str = "majority"):
        """``profiles``: the controller's calibration profiles, at most one per task family (default: those beside
        the served model, ``calibration-<task>.json``); ``vote``: how its controllers combine a task's threads
        (``policies.voting.VOTES``)."""
        self.pool, self.tokenizer = pool, tokenizer
        self.info = pool.info()
        self.settings = get_settings()
        self.ratios = [float(r) for r in self.info["ratios"]]
        self.budget_model = KVBudgetModel.from_dict(self.info["budget_model"])
        self.profiles = self._load_profiles(profiles)
        # Concurrent solves share each worker's KV memory; rounds wait for it by expected gain per byte, whatever
        # their task family: every family's controller takes from the same allocators.
        allocators = [ThreadAllocator(self.info["kv_budget_bytes"]) for _ in range(max(1, self.info["workers"]))]
        self.controllers = {
            task: Controller(pool, profile, self.budget_model.kv_bytes_per_token,
                             sorted(set(self.ratios) & {e.cr for e in profile.entries}), checkpointer=checkpointer,
                             budget_model=self.budget_model, allocators=allocators, weighting=vote)
            for task, profile in self.profiles.items()}

    def _load_profiles(self, given: list[str | Path | CalibrationProfile] | None) -> dict[str, CalibrationProfile]:
        if given is None:
            return CalibrationProfile.for_model(self.info["model"])
        profiles: dict[str, CalibrationProfile] = {}
        for item in given:
            profile = item if isinstance(item, CalibrationProfile) else CalibrationProfile.load(item)
            if profile.task in profiles:
                raise ValueError(f"profile: two calibration profiles for the {profile.task} task")
            profiles[profile.task] = profile
        return profiles

    @property
    def default_task(self) -> str:
        """The task family of requests that name none: the model directory's (``thinkpool.json``)."""
        return self.info.get("task") or "chain"

    @property
    def controller(self) -> Controller | None:
        """The controller of the default task family (None without a profile for it)."""
        return self.controllers.get(self.default_task)

    def family(self, request: SolveRequest, verifier: Verifier | None = None) -> TaskFamily:
        """The request's task family, with the caller's ``stop`` strings beside its own (ValueError naming ``task``
        or ``answer_pattern``)."""
        name = request.task or self.default_task
        family = get_family(name, answer_pattern=request.answer_pattern, verifier=verifier)
        if request.stop:
            family = get_family(name, answer_pattern=request.answer_pattern, verifier=verifier,
                                stop_strings=tuple(family.stop_strings) + tuple(request.stop))
        return family

    @property
    def model_id(self) -> str:
        """The served weights' fingerprint: what cached results are keyed by."""
        return self.info.get("fingerprint", self.info["model"])

    def prepare(self, request: SolveRequest, verifier: Verifier | None = None) -> Prepared:
        """Check a request against this deployment and tokenize it; ``ValueError`` naming the field (before any work)."""
        family = self.family(request, verifier)
        prompt = family.validate(request.prompt)
        # The controller plans from a profile measured on the request's task family; without one, "auto" is one
        # greedy thread and an explicit controller mode is refused.
        controller = self.controllers.get(family.name)
        if request.mode == "controller" and controller is None:
            measured = ", ".join(self.controllers) or "none"
            raise ValueError(f"mode: the controller needs a calibration profile for the {family.name} task (thinkpool "
                             f"calibrate --task {family.name}); this deployment has profiles for: {measured}")
        if controller is not None and controller.profile.signal == "k" and family.difficulty(prompt) is None:
            controller = None  # a k profile plans only tasks whose family reads k off the prompt
        use_controller = controller is not None and (
            request.mode == "controller" or (request.mode is None and request.samples == "auto"))
        if use_controller:  # the controller decodes its own way: fixed samples for these
            for name in ("stop", "logprobs", "top_logprobs", "greedy"):
                if getattr(request, name):
                    raise ValueError(f"{name}: not with the controller (samples 'auto'); ask for a number of samples")
        if request.cr is not None and request.cr not in self.ratios:
            raise ValueError(f"cr: no DMS adapter for {request.cr:g}x; this worker serves {', '.join(f'{r:g}' for r in self.ratios)}")
        if request.kv_budget and request.kv_budget > self.info["kv_budget_bytes"]:
            raise ValueError(f"kv_budget: at most {self.info['kv_budget_bytes']} bytes (the worker's pool)")
        budget = request.kv_budget or self.info["kv_budget_bytes"]
        if request.messages:
            prompt_ids = tuple(family.encode_chat([m.model_dump() for m in request.messages], self.tokenizer))
        else:
            prompt_ids = tuple(family.encode(prompt, self.tokenizer))
        limit = request.max_tokens or self.settings.sampling.max_new_tokens
        # "auto" without a calibration profile (for this task family) falls back to one greedy thread.
        ratios = self.ratios if use_controller else [request.cr or 1.0]  # the controller may pick any ratio
        context = self.info.get("context_length")
        if use_controller:
            limit = controller.profile.max_new_tokens
        elif request.max_tokens is None and context and len(prompt_ids) < context:
            limit = min(limit, context - len(prompt_ids))  # the default limit: what the context leaves room for
        self._check_context(len(prompt_ids), limit, "the calibration profile's" if use_controller else None)
        needed = min(self.budget_model.group_bytes(cr, len(prompt_ids), limit) for cr in ratios)
        if budget < needed:
            raise ValueError(f"kv_budget: {budget} bytes cannot hold one thread of {len(prompt_ids) + limit} tokens "
                             f"(it needs {needed} bytes)")
        return Prepared(prompt_ids, use_controller, request.cr or 1.0, budget, limit, family, prompt)

    def _check_context(self, prompt_tokens: int, limit: int, source: str | None = None) -> None:
        """Prompt and generated tokens must fit the model's context (``max_position_embeddings``); ``source`` says
        whose limit it is when the request set none."""
        context = self.info.get("context_length")
        if not context or prompt_tokens + limit <= context:
            return
        if prompt_tokens >= context:
            raise ValueError(f"prompt: {prompt_tokens} tokens, the model's context is {context} tokens "
                             "(max_position_embeddings)")
        source = f" ({source})" if source else ""
        raise ValueError(f"max_tokens: the prompt's {prompt_tokens} tokens and {limit} new tokens{source} exceed the "
                         f"model's context of {context} tokens (max_position_embeddings); at most "
                         f"{context - prompt_tokens} new tokens fit")

    def check(self, request: SolveRequest) -> None:
        self.prepare(request)

    async def solve(self, request: SolveRequest, job_id: str | None = None, on_event: EventListener | None = None,
                    verifier: Verifier | None = None, stream_tokens: bool = True) -> SolveResult:
        """Run one request; ``on_event(name, data)`` hears the running threads' tokens (``tokens`` events, see
        ``orchestrator/token_events.py``), each finished thread and, in controller mode, the plan, rounds and
        escalations as they happen (``stream_tokens=False``: all but the tokens). ``verifier(problem, answer) -> bool
        | float`` (the SDK's hook) picks the best of the threads' answers instead of the majority."""
        prepared = self.prepare(request, verifier)
        task_id = job_id or uuid.uuid4().hex[:12]
        tokens = TokenEvents(task_id, self.tokenizer, on_event) if on_event is not None and stream_tokens else None
        started = time.perf_counter()
        try:
            if prepared.use_controller:
                family = prepared.family
                budget = Budget(prepared.kv_budget, max_threads=request.max_threads)
                state = await self.controllers[family.name].solve(
                    task_id, prepared.prompt, prepared.prompt_ids, budget, seed=request.seed, on_event=on_event,
                    on_tokens=tokens, difficulty=family.difficulty(prepared.prompt), task_family=family.name,
                    answer_pattern=getattr(family, "answer_pattern", None), stop_strings=tuple(family.stop_strings))
                threads = [ThreadResult(**t) for t in state["threads"]]
                cr, answer, votes = state["cr"], state["answer"], state["votes"]
                reason, rounds = state["stop_reason"], state["rounds"]
            else:
                threads = await self._run_fixed(request, prepared, task_id, on_event, tokens)
                vote = self._vote(prepared, threads)
                cr, answer, votes, reason, rounds = prepared.cr, vote.answer, vote.counts, None, []
        finally:
            await self.pool.close_task(task_id)
        return SolveResult(
            answer=answer, task=prepared.family.name, votes=votes, threads=threads, samples=len(threads), cr=cr,
            realized_cr=sum(t.realized_cr for t in threads) / max(1, len(threads)),
            kv_peak_bytes=max((t.kv_peak_bytes for t in threads), default=0), tokens=sum(t.tokens for t in threads),
            prompt_tokens=len(prepared.prompt_ids),
            time_s=round(time.perf_counter() - started, 3), stop_reason=reason, rounds=rounds,
        )

    @staticmethod
    def _vote(prepared: Prepared, threads: list[ThreadResult]):
        """Equal answers (by the family's key: ``0.5`` and ``\\frac{1}{2}`` for math) are one; a verifier, when the
        caller gave one, picks the best answer instead of the most frequent."""
        family, answers = prepared.family, [t.answer for t in threads]
        if family.verifier is not None:
            return verified_vote(prepared.prompt, answers, family.verifier, key=family.key)
        return majority_vote(answers, [t.mean_logprob for t in threads], key=family.key)

    def sampling(self, request: SolveRequest, samples: int, max_tokens: int) -> SamplingParams:
        """One thread is greedy (unless ``greedy`` says otherwise); sampled threads take the request's temperature
        and top_p, else the model's ``generation_config.json`` (temperature, top_p, top_k, min_p), else the
        settings. ``logprobs``/``top_logprobs`` ask the threads for their tokens' log-probabilities."""
        model = self.info.get("generation") or {}
        settings = self.settings.sampling
        details = {"logprobs": request.logprobs or request.top_logprobs > 0, "top_logprobs": request.top_logprobs}
        temperature = request.temperature
        if temperature is None:
            temperature = model["temperature"] if model.get("temperature", 0) > 0 else settings.temperature
        greedy = request.greedy if request.greedy is not None else samples == 1
        if greedy or temperature == 0:
            return SamplingParams(0.0, settings.top_p, max_tokens, request.seed, **details)
        top_p = request.top_p if request.top_p is not None else float(model.get("top_p", settings.top_p))
        return SamplingParams(temperature, top_p, max_tokens, request.seed, int(model.get("top_k", 0)),
                              float(model.get("min_p", 0.0)), **details)

    async def _run_fixed(self, request: SolveRequest, prepared: Prepared, task_id: str,
                         on_event: EventListener | None, tokens: TokenEvents | None) -> list[ThreadResult]:
        samples = 1 if request.samples == "auto" else request.samples
        params = self.sampling(request, samples, prepared.max_tokens)

        def thread_done(result: ThreadResult) -> None:
            if tokens is not None:
                tokens(result)  # its last tokens, before the thread event
            if on_event is not None:
                on_event("thread", {"sample": result.sample, "answer": result.answer, "tokens": result.tokens,
                                    "cr": result.cr, "realized_cr": result.realized_cr,
                                    "finish_reason": result.finish_reason})

        family = prepared.family
        work = ProblemRequest(task_id, prepared.prompt_ids, tuple(range(samples)), params, prepared.cr, task_id=task_id,
                              task_family=family.name, answer_pattern=getattr(family, "answer_pattern", None),
                              stop_strings=tuple(family.stop_strings), stream_tokens=tokens is not None)
        return sorted(await self.pool.collect(work, thread_done, tokens), key=lambda t: t.sample)

    async def cancel(self, job_id: str) -> int:
        """Stop every thread of a job's task on its worker and free its KV now; a controller task ends at its
        next decision, dispatching nothing more."""
        for controller in self.controllers.values():
            controller.cancel(job_id)
        return await self.pool.cancel(job_id)


def service_factory(model_dir, kv_budget: int | None, workers: int, profiles: list[str | Path] | None = None):
    """Builds the SolveService when the API starts (workers load then, not when the module is imported)."""
    def build() -> SolveService:
        from dms_runtime.loading import check_model_dir, load_tokenizer
        from workers.factory import make_pool

        check_model_dir(model_dir)  # a clear error before any worker starts
        tokenizer = load_tokenizer(model_dir)
        pool = make_pool(model_dir, kv_budget, workers)
        return SolveService(pool, tokenizer, profiles)

    return build
