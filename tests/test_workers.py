"""ModelWorker actors on a real local Ray cluster: concurrency, a pool never overrun under a burst,
cancel frees memory, an actor killed mid-run loses and duplicates no thread, and one killed for good is
replaced (reported down until the new one answers)."""

import asyncio
from dataclasses import replace

import pytest
import ray

from transformers import AutoTokenizer

from dms_runtime.loading import default_model_path
from orchestrator.token_events import TokenEvents
from workers.pool import WorkerPool
from workers.records import ThreadResult, ThreadTokens, TokenProgress
from workers.thread import SamplingParams
from workers.worker import ProblemRequest, WorkerConfig

TOKENIZER = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)

EASY = ["a=3;b=4;c=a*b;d=c+a;?d\n", "a=12;b=5;c=a-b;?c\n", "a=7;b=a+a;c=b*b;?c\n", "a=40;b=2;c=a*b;d=c-a;e=d+b;?e\n"]
HARD = "a=76;b=53;c=28;d=18;e=16;f=35;g=d*b;h=e+e;i=g+a;j=d-a;k=a*j;l=k*c;m=c-e;n=m*k;o=e*b;p=j*k;q=o*j;r=c-d;?r\n"
SAMPLED = SamplingParams(temperature=0.8, max_new_tokens=400, seed=3)
BUDGET = 4_000_000  # about three threads' reservations at 400 new tokens: a burst must queue


@pytest.fixture(scope="module")
def pool():
    pool = WorkerPool(WorkerConfig(kv_budget_bytes=BUDGET, torch_threads=1), num_workers=2)
    yield pool
    pool.shutdown()
    ray.shutdown()


def request(name: str, prompt: str, samples: int, params: SamplingParams = SAMPLED) -> ProblemRequest:
    return ProblemRequest(name, tuple(TOKENIZER(prompt)["input_ids"]), tuple(range(samples)), params)


def consume_in_background(pool, req: ProblemRequest, worker) -> tuple[asyncio.Task, list]:
    """Stream ``req``'s results from ``worker`` into a list, in a task (so the test can act meanwhile)."""
    got: list = []

    async def consume():
        async for result in pool.run(req, worker=worker):
            got.append(result)

    return asyncio.create_task(consume()), got


def test_a_burst_of_problems_runs_concurrently_within_the_pool(pool):
    async def burst():
        requests = [request(f"burst-{i}", EASY[i % 4], 4) for i in range(8)]
        return await asyncio.gather(*(pool.collect(r) for r in requests)), await pool.stats()

    results, stats = asyncio.run(burst())
    for i, threads in enumerate(results):
        assert sorted(t.sample for t in threads) == [0, 1, 2, 3]
        assert all(t.problem_id == f"burst-{i}" for t in threads)
    assert sum(t.answer == "15" for t in results[0]) >= 3  # the shipped model solves a=3;b=4;c=a*b;d=c+a
    for worker in stats:
        assert worker.pool_peak_bytes <= worker.pool_bytes
        assert worker.pool_used_bytes == 0
    assert all(worker.tokens_generated > 0 for worker in stats)  # both workers got work


def test_a_streaming_request_reports_its_threads_tokens_while_they_decode(pool):
    """Through Ray: batches of each running thread's new token ids (with log-probabilities and the most likely
    alternatives when asked) arrive before its result, and add up to the start of its token ids."""
    params = SamplingParams(temperature=0.8, max_new_tokens=400, seed=4, logprobs=True, top_logprobs=2)
    req = replace(request("streaming", HARD, 3, params), stream_tokens=True)

    async def consume():
        return [item async for item in pool.run(req)]

    items = asyncio.run(consume())
    results = {item.sample: item for item in items if isinstance(item, ThreadResult)}
    assert sorted(results) == [0, 1, 2]
    told: dict[int, list[int]] = {sample: [] for sample in results}
    for position, item in enumerate(items):
        if isinstance(item, TokenProgress):
            assert item.problem_id == "streaming"
            for tokens in item.threads:
                assert items.index(results[tokens.sample]) > position  # before the thread's result
                assert tokens.tokens == len(told[tokens.sample]) + len(tokens.token_ids)
                assert len(tokens.token_logprobs) == len(tokens.token_ids)
                assert {len(top) for top in tokens.top_logprobs} == {2}
                told[tokens.sample] += tokens.token_ids
    assert sum(map(len, told.values())) > 0  # tokens flowed while the threads ran
    for sample, result in results.items():
        assert list(result.token_ids[: len(told[sample])]) == told[sample]
        assert len(result.token_logprobs) == len(result.token_ids) == len(result.top_logprobs)
        assert TOKENIZER.decode(list(result.token_ids), skip_special_tokens=True) == result.text


def test_token_events_tell_a_rerun_threads_tokens_once():
    """A thread re-run after its worker died reports from its start again: what was told is not told twice, and
    the text deltas add up to the thread's text."""
    ids = TOKENIZER("a=3;b=4;c=a*b;d=c+a;?d\na:03\nb:04", add_special_tokens=False)["input_ids"]
    events = []
    told = TokenEvents("task", TOKENIZER, lambda name, data: events.append(data))
    told(TokenProgress("r", (ThreadTokens(0, tuple(ids[:5]), 5),)))
    told(TokenProgress("r", (ThreadTokens(0, tuple(ids[:3]), 3),)))  # the re-run, from its start: nothing new
    told(TokenProgress("r", (ThreadTokens(0, tuple(ids[3:9]), 9),)))
    told(ThreadResult("r", 0, TOKENIZER.decode(ids), len(ids), None, 0.0, 1.0, 1.0, "length", token_ids=tuple(ids)))
    assert [i for e in events for i in e["ids"]] == ids
    assert "".join(e["text"] for e in events) == TOKENIZER.decode(ids)


def test_cancel_stops_threads_and_frees_their_memory(pool):
    async def cancel_midway():
        req = request("to-cancel", HARD, 6, SamplingParams(temperature=0.8, max_new_tokens=1000))
        worker = pool.workers[0]
        task, got = consume_in_background(pool, req, worker)
        for _ in range(300):
            await asyncio.sleep(0.2)
            stats = await worker.stats.remote()
            if stats.running or task.done():
                break
        assert stats.pool_used_bytes > 0
        stopped = await pool.cancel("to-cancel")
        await asyncio.wait_for(task, 30)
        return stopped, got, await worker.stats.remote()

    stopped, got, after = asyncio.run(cancel_midway())
    assert stopped + len(got) == 6 and stopped > 0
    assert after.pool_used_bytes == 0 and after.running == 0 and after.waiting == 0


def test_an_actor_killed_mid_run_loses_and_duplicates_nothing(pool):
    async def kill_midway():
        req = request("survivor", EASY[3], 8)
        worker = pool.workers[1]
        task, got = consume_in_background(pool, req, worker)
        for _ in range(600):
            if "survivor" in pool._pins or task.done():
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        ray.kill(worker, no_restart=False)  # Ray restarts it; the pool re-runs what was not reported
        await asyncio.wait_for(task, 240)
        return got

    got = asyncio.run(kill_midway())
    assert sorted(t.sample for t in got) == list(range(8))
    # the re-run threads are the same threads: one seed, one text per sample index
    again = asyncio.run(pool.collect(request("survivor-again", EASY[3], 8)))
    assert {t.sample: t.text for t in got} == {t.sample: t.text for t in again}


def test_the_event_loop_keeps_running_while_a_submit_waits_for_the_engine():
    """A submit waits for the engine's lock (held here as a long step would) off the event loop: other
    coroutines (an API server's handlers, a Ray actor's other calls) run meanwhile, and the submit then
    completes."""
    import threading

    from workers.worker import ModelWorker

    worker = ModelWorker(WorkerConfig(kv_budget_bytes=BUDGET, torch_threads=1))
    step_running = threading.Event()

    def long_step():
        with worker._lock:
            step_running.set()
            released.wait()

    async def scenario():
        threading.Thread(target=long_step, daemon=True).start()
        step_running.wait()
        stream = worker.run(request("waits", EASY[0], 1, SamplingParams(max_new_tokens=400)))
        first = asyncio.create_task(anext(stream))
        ticks_while_held = 0
        for _ in range(20):  # with a blocked loop, none of these would run before the lock is released
            await asyncio.sleep(0.01)
            ticks_while_held += not released.is_set()
        assert not first.done()
        released.set()
        result = await first
        await stream.aclose()
        return ticks_while_held, result, await worker.stats()

    released = threading.Event()
    safety = threading.Timer(30, released.set)  # a regression returns to the loop after 30 s and fails, not hangs
    safety.start()
    try:
        ticks, result, stats = asyncio.run(scenario())
    finally:
        safety.cancel()  # else the pending timer holds the interpreter open for its 30 s after the suite
    assert ticks == 20
    assert result.answer == "15"
    assert stats.pool_used_bytes == 0 and stats.running == 0 and stats.waiting == 0


def test_a_worker_killed_for_good_is_replaced_and_reported_down_until_it_is_back(pool):
    async def scenario():
        dead = pool.workers[0]
        ray.kill(dead, no_restart=True)  # Ray will not bring this one back: the pool must
        seen = []
        for _ in range(600):
            health = await pool.health()
            seen.append(health[0])
            if health[0].state == "up" and pool.workers[0] is not dead:
                break
            await asyncio.sleep(0.2)
        return dead, seen, await pool.collect(request("after-replacement", EASY[1], 2)), pool.workers[0]

    replaced_before = pool.replaced
    dead, seen, results, now = asyncio.run(scenario())
    assert any(h.state == "down" and "replaced" in h.detail for h in seen)
    assert seen[-1].state == "up" and now is not dead and pool.replaced == replaced_before + 1
    assert sorted(t.sample for t in results) == [0, 1]
