"""``SolveService``: one solve request -> threads on the workers -> a voted result.

``samples="auto"`` goes through the controller (when a calibration profile exists); a number of samples
runs that many threads at one ratio. The REST API, the in-process SDK client and the batch entry point
all call this one service.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from orchestrator.controller import Budget, Controller
from orchestrator.allocator import ThreadAllocator
from orchestrator.schemas import SolveRequest, SolveResult, ThreadSummary
from orchestrator.settings import DEFAULT_PROFILE, get_settings
from policies.planner import CalibrationProfile
from policies.voting import majority_vote
from tasks.prompt import format_prompt
from workers.kv_budget import KVBudgetModel
from workers.thread import SamplingParams
from workers.worker import ProblemRequest


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
            # Concurrent solves share the workers' KV memory; rounds wait for it by expected gain per byte.
            capacity = self.info["kv_budget_bytes"] * max(1, self.info["workers"])
            self.controller = Controller(pool, self.profile, tokenizer, self.info["geometry"]["kv_bytes_per_token"], ratios,
                                         checkpointer=checkpointer, budget_model=self.budget_model,
                                         on_chunk=self._chunk_done, allocator=ThreadAllocator(capacity))
        self._listeners: dict[str, object] = {}  # job id -> on_event(name, data)

    def _chunk_done(self, task_id: str, samples: list[int]) -> None:
        listener = self._listeners.get(task_id)
        if listener is not None:
            listener("threads", {"samples": samples})

    def check(self, request: SolveRequest) -> None:
        """Raise ``ValueError`` naming the field for a request this deployment cannot run (before any work)."""
        if request.mode == "controller" and self.controller is None:
            raise ValueError("mode: the controller needs a calibration profile (thinkpool calibrate) on this deployment")
        if request.cr is not None and request.cr not in self.ratios:
            raise ValueError(f"cr: no DMS adapter for {request.cr:g}x; this worker serves {', '.join(f'{r:g}' for r in self.ratios)}")
        budget = request.kv_budget or self.info["kv_budget_bytes"]
        if request.kv_budget and request.kv_budget > self.info["kv_budget_bytes"]:
            raise ValueError(f"kv_budget: at most {self.info['kv_budget_bytes']} bytes (the worker's pool)")
        tokens = len(self.tokenizer(format_prompt(request.prompt))["input_ids"])
        limit = request.max_tokens or self.settings.sampling.max_new_tokens
        fixed = request.mode == "fixed" or request.samples != "auto" or self.controller is None
        ratios = [request.cr or 1.0] if fixed else self.ratios  # the controller may pick any ratio
        needed = min(self.budget_model.group_bytes(cr, tokens, limit) for cr in ratios)
        if budget < needed:
            raise ValueError(f"kv_budget: {budget} bytes cannot hold one thread of {tokens + limit} tokens "
                             f"(it needs {needed} bytes)")

    async def solve(self, request: SolveRequest, job_id: str | None = None, on_event=None) -> SolveResult:
        """Run one request; ``on_event(name, data)`` hears each finished thread (or chunk) and the plan's rounds."""
        self.check(request)
        job_id = job_id or uuid.uuid4().hex[:12]
        started = time.perf_counter()
        # "auto" without a calibration profile falls back to one greedy thread.
        use_controller = self.controller is not None and (
            request.mode == "controller" or (request.mode is None and request.samples == "auto"))
        if use_controller:
            budget = Budget(request.kv_budget or self.info["kv_budget_bytes"], max_threads=32)
            if on_event is not None:
                self._listeners[job_id] = on_event
            try:
                state = await self.controller.solve(job_id, request.prompt, budget, seed=request.seed)
            finally:
                self._listeners.pop(job_id, None)
            if on_event is not None:
                for event in state["rounds"]:
                    on_event("escalation" if event["event"] == "escalate" else event["event"], event)
            threads = [ThreadSummary(**t) for t in state["threads"]]
            cr, answer, votes, reason = state["cr"], state["answer"], state["votes"], state["stop_reason"]
        else:
            samples = 1 if request.samples == "auto" else request.samples
            cr = request.cr or 1.0
            temperature = request.temperature if request.temperature is not None else self.settings.sampling.temperature
            params = SamplingParams(0.0 if samples == 1 else temperature, self.settings.sampling.top_p,
                                    request.max_tokens or self.settings.sampling.max_new_tokens, request.seed)
            def thread_done(result) -> None:
                if on_event is not None:
                    on_event("thread", {"sample": result.sample_index, "answer": result.answer, "tokens": result.tokens})

            results = await self.pool.collect(ProblemRequest(job_id, format_prompt(request.prompt), tuple(range(samples)), params, cr),
                                              thread_done)
            threads = [ThreadSummary(sample=r.sample_index, answer=r.answer, tokens=r.tokens, mean_logprob=r.mean_logprob,
                                     realized_cr=r.realized_cr, kv_cr=r.kv_cr, cr=r.cr, finish_reason=r.finish_reason)
                       for r in results]
            vote = majority_vote([t.answer for t in threads], [t.mean_logprob for t in threads])
            answer, votes, reason = vote.answer, vote.counts, None
        stats = [s for s in await self.pool.stats() if s is not None]
        return SolveResult(
            answer=answer, votes=votes, threads=threads, samples=len(threads), cr=cr,
            realized_cr=sum(t.realized_cr for t in threads) / max(1, len(threads)),
            kv_peak_bytes=max((s.pool_peak_bytes for s in stats), default=0), tokens=sum(t.tokens for t in threads),
            time_s=round(time.perf_counter() - started, 3), stop_reason=reason,
        )


def service_factory(model_dir, kv_budget: int | None, workers: int):
    """Builds the SolveService when the API starts (workers load then, not when the module is imported)."""
    def build():
        from transformers import AutoTokenizer

        from orchestrator.commands.common import make_pool

        pool = make_pool(model_dir, kv_budget, workers)
        return SolveService(pool, AutoTokenizer.from_pretrained(model_dir, local_files_only=True))

    return build
