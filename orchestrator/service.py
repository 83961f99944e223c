"""``SolveService``: the one solve path. A request -> its tokenized prompt -> a task on one worker -> a result.

Every surface calls it: the REST API, the SDK's ``LocalClient``, ``thinkpool solve``, ``thinkpool eval
--controller`` and the batch entry point. The prompt is tokenized once, here, and its ids travel down. Each
request is one worker task (id: the job id): all its threads, in every chunk and round, share one prefill
of the prompt per ratio, held on one worker until the task ends, when the service closes it. ``samples="auto"``
goes through the controller (when a calibration profile exists); a number of samples runs that many threads
at one ratio. The task's own KV peak comes back in the result (the worker's lifetime peak is in ``stats``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from orchestrator.allocator import ThreadAllocator
from orchestrator.controller import Budget, Controller, EventListener
from orchestrator.schemas import SolveRequest, SolveResult
from orchestrator.settings import DEFAULT_PROFILE, get_settings
from policies.planner import CalibrationProfile
from policies.voting import majority_vote
from tasks.prompt import format_prompt
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


class SolveService:
    def __init__(self, pool, tokenizer, profile_path: str | Path | None = DEFAULT_PROFILE, checkpointer=None):
        self.pool, self.tokenizer = pool, tokenizer
        self.info = pool.info()
        self.settings = get_settings()
        self.ratios = [float(r) for r in self.info["ratios"]]
        self.budget_model = KVBudgetModel.from_dict(self.info["budget_model"])
        self.profile = CalibrationProfile.load(profile_path) if profile_path and Path(profile_path).is_file() else None
        self.controller = None
        if self.profile is not None:
            ratios = sorted(set(self.ratios) & {e.cr for e in self.profile.entries})
            # Concurrent solves share each worker's KV memory; rounds wait for it by expected gain per byte.
            allocators = [ThreadAllocator(self.info["kv_budget_bytes"]) for _ in range(max(1, self.info["workers"]))]
            self.controller = Controller(pool, self.profile, self.budget_model.kv_bytes_per_token, ratios,
                                         checkpointer=checkpointer, budget_model=self.budget_model, allocators=allocators)

    @property
    def model_id(self) -> str:
        """The served weights' fingerprint: what cached results are keyed by."""
        return self.info.get("fingerprint", self.info["model"])

    def prepare(self, request: SolveRequest) -> Prepared:
        """Check a request against this deployment and tokenize it; ``ValueError`` naming the field (before any work)."""
        if request.mode == "controller" and self.controller is None:
            raise ValueError("mode: the controller needs a calibration profile (thinkpool calibrate) on this deployment")
        if request.cr is not None and request.cr not in self.ratios:
            raise ValueError(f"cr: no DMS adapter for {request.cr:g}x; this worker serves {', '.join(f'{r:g}' for r in self.ratios)}")
        if request.kv_budget and request.kv_budget > self.info["kv_budget_bytes"]:
            raise ValueError(f"kv_budget: at most {self.info['kv_budget_bytes']} bytes (the worker's pool)")
        budget = request.kv_budget or self.info["kv_budget_bytes"]
        prompt_ids = tuple(self.tokenizer(format_prompt(request.prompt))["input_ids"])
        limit = request.max_tokens or self.settings.sampling.max_new_tokens
        # "auto" without a calibration profile falls back to one greedy thread.
        use_controller = self.controller is not None and (
            request.mode == "controller" or (request.mode is None and request.samples == "auto"))
        ratios = self.ratios if use_controller else [request.cr or 1.0]  # the controller may pick any ratio
        if use_controller:
            limit = self.profile.max_new_tokens
        needed = min(self.budget_model.group_bytes(cr, len(prompt_ids), limit) for cr in ratios)
        if budget < needed:
            raise ValueError(f"kv_budget: {budget} bytes cannot hold one thread of {len(prompt_ids) + limit} tokens "
                             f"(it needs {needed} bytes)")
        return Prepared(prompt_ids, use_controller, request.cr or 1.0, budget, limit)

    def check(self, request: SolveRequest) -> None:
        self.prepare(request)

    async def solve(self, request: SolveRequest, job_id: str | None = None, on_event: EventListener | None = None) -> SolveResult:
        """Run one request; ``on_event(name, data)`` hears each finished thread and, in controller mode, the plan,
        rounds and escalations as they happen."""
        prepared = self.prepare(request)
        task_id = job_id or uuid.uuid4().hex[:12]
        started = time.perf_counter()
        try:
            if prepared.use_controller:
                budget = Budget(prepared.kv_budget, max_threads=request.max_threads)
                state = await self.controller.solve(task_id, request.prompt, prepared.prompt_ids, budget, seed=request.seed,
                                                    on_event=on_event)
                threads = [ThreadResult(**t) for t in state["threads"]]
                cr, answer, votes = state["cr"], state["answer"], state["votes"]
                reason, rounds = state["stop_reason"], state["rounds"]
            else:
                threads = await self._run_fixed(request, prepared, task_id, on_event)
                vote = majority_vote([t.answer for t in threads], [t.mean_logprob for t in threads])
                cr, answer, votes, reason, rounds = prepared.cr, vote.answer, vote.counts, None, []
        finally:
            await self.pool.close_task(task_id)
        return SolveResult(
            answer=answer, votes=votes, threads=threads, samples=len(threads), cr=cr,
            realized_cr=sum(t.realized_cr for t in threads) / max(1, len(threads)),
            kv_peak_bytes=max((t.kv_peak_bytes for t in threads), default=0), tokens=sum(t.tokens for t in threads),
            time_s=round(time.perf_counter() - started, 3), stop_reason=reason, rounds=rounds,
        )

    async def _run_fixed(self, request: SolveRequest, prepared: Prepared, task_id: str,
                         on_event: EventListener | None) -> list[ThreadResult]:
        samples = 1 if request.samples == "auto" else request.samples
        temperature = request.temperature if request.temperature is not None else self.settings.sampling.temperature
        params = SamplingParams(0.0 if samples == 1 else temperature, self.settings.sampling.top_p, prepared.max_tokens,
                                request.seed)

        def thread_done(result: ThreadResult) -> None:
            if on_event is not None:
                on_event("thread", {"sample": result.sample, "answer": result.answer, "tokens": result.tokens,
                                    "cr": result.cr, "realized_cr": result.realized_cr})

        work = ProblemRequest(task_id, prepared.prompt_ids, tuple(range(samples)), params, prepared.cr, task_id=task_id)
        return sorted(await self.pool.collect(work, thread_done), key=lambda t: t.sample)

    async def cancel(self, job_id: str) -> int:
        """Stop every thread of a job's task on its worker and free its KV now; a controller task ends at its
        next decision, dispatching nothing more."""
        if self.controller is not None:
            self.controller.cancel(job_id)
        return await self.pool.cancel(job_id)


def service_factory(model_dir, kv_budget: int | None, workers: int, profile_path: str | Path | None = DEFAULT_PROFILE):
    """Builds the SolveService when the API starts (workers load then, not when the module is imported)."""
    def build() -> SolveService:
        from transformers import AutoTokenizer

        from workers.factory import make_pool

        pool = make_pool(model_dir, kv_budget, workers)
        return SolveService(pool, AutoTokenizer.from_pretrained(model_dir, local_files_only=True), profile_path)

    return build
