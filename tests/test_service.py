"""The solve service on a real local Ray pool: one task per request, pinned to one worker; cancel stops it and
frees its KV in either mode; a result reports its own KV peak; cached results are per model."""

import asyncio
import time

import pytest
import ray
from transformers import AutoTokenizer

from dms_runtime.loading import default_model_path
from orchestrator.jobs import RedisJobStore
from orchestrator.schemas import Job, SolveRequest
from orchestrator.service import SolveService
from test_controller import HARD, profile
from workers.pool import WorkerPool
from workers.worker import WorkerConfig

BUDGET = 16_000_000


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    path = profile(max_new_tokens=1000).save(tmp_path_factory.mktemp("profile") / "profile.json")
    pool = WorkerPool(WorkerConfig(kv_budget_bytes=BUDGET, torch_threads=1), num_workers=1)
    yield SolveService(pool, AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True), [path])
    pool.shutdown()
    ray.shutdown()


async def used_bytes(service) -> int:
    return sum(s.pool_used_bytes for s in await service.pool.stats() if s is not None)


@pytest.mark.parametrize("mode", ["fixed", "controller"])
def test_cancel_stops_every_thread_of_the_task_and_frees_its_kv(service, mode):
    request = SolveRequest(prompt=HARD, samples=6 if mode == "fixed" else "auto", mode=mode, max_tokens=1000,
                           temperature=1.0, max_threads=16)

    async def scenario():
        job = f"cancel-{mode}"
        events: list[str] = []
        solving = asyncio.create_task(service.solve(request, job_id=job, on_event=lambda name, _: events.append(name)))
        deadline = time.time() + 120
        while await used_bytes(service) == 0 and time.time() < deadline and not solving.done():
            await asyncio.sleep(0.05)
        held = await used_bytes(service)
        stopped = await service.cancel(job)
        freed = await used_bytes(service)
        result = await asyncio.wait_for(solving, 120)  # the task ends by itself: nothing more is dispatched
        return held, stopped, freed, result, events, await used_bytes(service)

    held, stopped, freed, result, events, after = asyncio.run(scenario())
    assert held > 0 and stopped > 0
    assert freed == 0 and after == 0
    assert result.samples < (6 if mode == "fixed" else 16)
    if mode == "controller":
        assert events[:2] == ["plan", "round"]  # told while the task ran, not replayed at its end


def test_a_result_reports_its_own_kv_peak_and_sampled_threads_are_reproducible(service):
    request = SolveRequest(prompt="a=3;b=4;c=a*b;d=c+a;?d", samples=4, mode="fixed", temperature=1.0, seed=11)

    async def twice():
        await service.pool.reset_peaks()
        first = await service.solve(request, job_id="peak-1")
        second = await service.solve(request, job_id="peak-2")
        stats = [s for s in await service.pool.stats() if s is not None]
        return first, second, stats

    first, second, stats = asyncio.run(twice())
    assert [t.text for t in first.threads] == [t.text for t in second.threads]
    assert 0 < first.kv_peak_bytes <= max(s.pool_peak_bytes for s in stats)
    # four threads sharing one prompt: the prompt's KV counted once
    prompt_tokens = len(service.tokenizer("a=3;b=4;c=a*b;d=c+a;?d\n")["input_ids"])
    per_token = service.budget_model.kv_bytes_per_token
    assert first.kv_peak_bytes < (4 * prompt_tokens + sum(t.tokens for t in first.threads)) * per_token


def test_cached_results_belong_to_the_model_that_made_them(redis_url):
    request = SolveRequest(prompt="a=1;b=2;c=a+b;?c", samples=1)
    old, retrained = RedisJobStore(redis_url, model_id="weights-a"), RedisJobStore(redis_url, model_id="weights-b")
    old.save(Job(id="cached-1", state="done", request=request, created_s=0, updated_s=0))
    assert old.cached(request).id == "cached-1"
    assert retrained.cached(request) is None
