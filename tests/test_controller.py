"""Policies and the LangGraph controller: the planner on a synthetic profile, the graph's routing (finish,
escalate, budget exhausted) on scripted workers, a real solve, and a real kill-and-resume through Redis."""

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from tasks.chain_tokenizer import build_tokenizer
from orchestrator.controller import Budget, Controller
from policies.planner import CalibrationProfile, ProfileEntry, plan
from policies.stopping import leader_probability, settled
from policies.voting import best_of_n, confidence_vote, vote_by, weighted_vote
from policies.extraction import extract_math_answer, get_extractor
from workers.records import ThreadResult

KV_PER_TOKEN = 3072  # the shipped model: 6 layers x 2 KV heads x 32 dims x fp32 K and V


def ids(prompt: str) -> list[int]:
    """The model input's token ids (the controller takes the prompt tokenized, as the service gives it)."""
    from tasks.prompt import format_prompt

    return build_tokenizer()(format_prompt(prompt))["input_ids"]


def profile(max_new_tokens: int = 300) -> CalibrationProfile:
    """Synthetic: easy problems are solved by anything; hard ones need many threads, best at 8x."""
    entries = []
    for (low, high), table in {
        (1, 10): {1: [0.95, 0.97, 0.98], 4: [0.94, 0.96, 0.97], 8: [0.9, 0.93, 0.95]},
        (11, 20): {1: [0.5, 0.6, 0.65], 4: [0.48, 0.62, 0.72], 8: [0.45, 0.63, 0.8]},
    }.items():
        for cr, accuracies in table.items():
            for threads, accuracy in zip((1, 4, 16), accuracies):
                entries.append(ProfileEntry(k_min=low, k_max=high, cr=cr, threads=threads, accuracy=accuracy,
                                            tokens_per_thread=100 * high))
    return CalibrationProfile(model="synthetic", max_new_tokens=max_new_tokens, temperature=0.8, window=16, entries=entries)


def test_policies_on_hand_made_votes():
    assert weighted_vote(["3", "5", "5"], [3.0, 1.0, 1.0]).answer == "3"
    # two confident threads outvote three unsure ones once the least confident half is dropped
    vote = confidence_vote(["7", "7", "2", "2", "2"], [-0.01, -0.02, -0.9, -0.8, -1.2], keep=0.5)
    assert vote.answer == "7" and vote.counts == {"7": 2, "2": 1}
    # by name, as eval --vote and the controller's weighting choose: the same threads, two winners
    answers, sureness = ["7", "7", "2", "2", "2"], [-0.01, -0.02, -0.9, -0.8, -1.2]
    assert vote_by("majority", answers, sureness).answer == "2" and vote_by("confidence", answers, sureness).answer == "7"
    with pytest.raises(ValueError, match="vote must be one of majority, confidence"):
        vote_by("loudest", answers, sureness)
    assert best_of_n(["a", "bb", "ccc"], ["1", "2", None], verifier=lambda text, answer: len(text)).answer == "2"
    assert leader_probability({"4": 4}) > 0.95 > leader_probability({"4": 3})
    assert settled({"1": 6, "2": 1}) and not settled({"1": 5, "2": 2}) and not settled({})
    assert extract_math_answer(r"so \boxed{42}.") == "42" and extract_math_answer("x = 3, then 17") == "17"
    assert get_extractor("chain")("...#07") == "7"
    with pytest.raises(ValueError, match="unknown task family"):
        get_extractor("poetry")


def linear(per_thread: dict[float, int]):
    """A planner's ``group_bytes`` for threads that share nothing: n threads cost n times one."""
    return lambda cr, n: n * per_thread[cr]


def test_planner_picks_the_most_accurate_fit_and_the_cheapest_among_equals():
    p = profile()
    per_thread = {1: 400 * KV_PER_TOKEN, 4: 120 * KV_PER_TOKEN, 8: 60 * KV_PER_TOKEN}
    big = plan(p, 18, 10**9, linear(per_thread), [1, 4, 8])
    assert (big.cr, big.threads) == (8, 16)
    small = plan(p, 18, 16 * 120 * KV_PER_TOKEN, linear(per_thread), [1, 4, 8])  # 16 threads fit at 4x and 8x only
    assert (small.cr, small.threads) == (8, 16)
    tight = plan(p, 18, 4 * 60 * KV_PER_TOKEN, linear(per_thread), [1, 4, 8])  # only 4 threads at 8x fit
    assert (tight.cr, tight.threads) == (8, 4)
    easy = plan(p, 3, 10**9, linear(per_thread), [1, 4, 8])
    assert (easy.cr, easy.threads) == (1, 4)  # within a point of the best (x16), with a quarter of the tokens
    with pytest.raises(ValueError, match="kv_budget"):
        plan(p, 18, 1000, linear(per_thread), [1, 4, 8])


def test_planner_plans_one_greedy_thread_when_no_vote_is_expected_to_beat_it():
    p = profile()
    p.entries += [ProfileEntry(k_min=1, k_max=10, cr=1, threads=1, greedy=True, accuracy=0.975, tokens_per_thread=1000),
                  ProfileEntry(k_min=11, k_max=20, cr=1, threads=1, greedy=True, accuracy=0.7, tokens_per_thread=2000)]
    per_thread = {1: 400 * KV_PER_TOKEN, 4: 120 * KV_PER_TOKEN, 8: 60 * KV_PER_TOKEN}
    easy = plan(p, 3, 10**9, linear(per_thread), [1, 4, 8])
    assert (easy.cr, easy.threads, easy.greedy) == (1, 1, True)  # within a point of the best vote, a quarter of its tokens
    hard = plan(p, 18, 10**9, linear(per_thread), [1, 4, 8])
    assert (hard.cr, hard.threads, hard.greedy) == (8, 16, False)  # 16 threads at 8x vote 0.8 > greedy 0.7
    assert p.greedy_accuracy(18, 1) == 0.7 and p.greedy_accuracy(18, 4) is None
    assert p.accuracy(18, 1, 1) == 0.5  # sampled entries ignore the greedy one
    assert p.accuracy_with_greedy(18, 1, 5) == 0.7 and p.accuracy_with_greedy(18, 8, 17) == 0.8


def test_planner_does_not_trade_a_greedy_thread_for_a_vote_the_profile_cannot_resolve():
    p = profile()
    p.entries += [ProfileEntry(k_min=11, k_max=20, cr=cr, threads=1, greedy=True, accuracy=0.7, tokens_per_thread=2000)
                  for cr in (1, 8)]
    per_thread = {1: 400 * KV_PER_TOKEN, 4: 120 * KV_PER_TOKEN, 8: 60 * KV_PER_TOKEN}
    measured_on = {n: plan(p.model_copy(update={"problems": n}), 18, 10**9, linear(per_thread), [1, 4, 8]) for n in (16, 400)}
    # 0.8 against 0.7 is 1.6 problems in 16: one greedy thread, uncompressed (the lowest of the equal ratios)
    assert (measured_on[16].cr, measured_on[16].threads, measured_on[16].greedy) == (1, 1, True)
    assert (measured_on[400].cr, measured_on[400].threads) == (8, 16)  # on 400 problems the vote's 10 points are real
    assert p.model_copy(update={"problems": 16}).standard_error(1.0) > 0.05  # 16 of 16 is not certainty


def temperature_profile() -> CalibrationProfile:
    """Hard problems at 1x and 8x, sampled at 0.8 and 1.2: cooler threads vote better in fours, hotter ones in
    sixteens (each is less accurate, but their errors differ more), as measured on the chain task."""
    table = {0.8: {1: 0.5, 4: 0.62, 16: 0.68}, 1.2: {1: 0.42, 4: 0.55, 16: 0.76}}
    entries = [ProfileEntry(k_min=1, k_max=20, cr=cr, threads=n, accuracy=a, tokens_per_thread=400, temperature=t)
               for cr in (1, 8) for t, row in table.items() for n, a in row.items()]
    return CalibrationProfile(model="synthetic", max_new_tokens=300, temperature=0.8, problems=400, window=16, entries=entries)


def test_the_planner_picks_the_temperature_with_the_thread_count():
    p = temperature_profile()
    per_thread = {1: 400 * KV_PER_TOKEN, 8: 60 * KV_PER_TOKEN}
    roomy = plan(p, 18, 10**9, linear(per_thread), [1, 8])
    assert (roomy.cr, roomy.threads, roomy.temperature) == (1, 16, 1.2)  # 16 hot threads; the lower ratio of equals
    tight = plan(p, 18, 4 * 400 * KV_PER_TOKEN, linear(per_thread), [1, 8])
    assert (tight.cr, tight.threads, tight.temperature) == (8, 16, 1.2)  # 16 fit only at 8x
    four = plan(p, 18, 4 * 60 * KV_PER_TOKEN, linear(per_thread), [1, 8])
    assert (four.cr, four.threads, four.temperature) == (8, 4, 0.8)  # four threads vote better cool
    fixed = plan(p, 18, 10**9, linear(per_thread), [1, 8], temperature=0.7)  # a caller's temperature: its nearest votes
    assert (fixed.threads, fixed.temperature, fixed.expected_accuracy) == (16, 0.7, 0.68)
    assert p.temperatures() == [0.8, 1.2] and p.nearest_temperature(1.0) == 0.8 and p.nearest_temperature(1.1) == 1.2
    assert p.accuracy(18, 8, 16, 1.2) == 0.76 and p.accuracy(18, 8, 16) == 0.68  # default: the profile's temperature
    # a profile whose entries name no temperature (measured before they did) is at the profile's
    legacy = profile().model_copy(update={"temperature": 0.6})
    assert plan(legacy, 18, 10**9, linear({1: 1, 4: 1, 8: 1}), [1, 4, 8]).temperature == 0.6


class ScriptedPool:
    """Workers that answer from a script (sample index -> answer): for the graph's routing only. Every thread
    reports ``min_logprob`` as its least likely token (default: an unsure greedy thread)."""

    def __init__(self, answer_of, min_logprob: float = -2.0):
        self.answer_of, self.min_logprob, self.requests = answer_of, min_logprob, []

    async def pin(self, task_id):
        return 0

    async def collect(self, request, on_result=None, on_tokens=None):
        self.requests.append(request)
        return [ThreadResult(request.request_id, i, f"#{self.answer_of(i)}", 50, self.answer_of(i), -0.1, request.cr, request.cr,
                             "eos", min_logprob=self.min_logprob) for i in request.samples]


def run(pool, prompt, budget, **kwargs):
    controller = Controller(pool, profile(), KV_PER_TOKEN, [1, 4, 8], **kwargs)
    return asyncio.run(controller.solve("task", prompt, ids(prompt), budget))


HARD = "a=76;b=53;c=28;d=18;e=16;f=35;g=d*b;h=e+e;i=g+a;j=d-a;k=a*j;l=k*c;m=c-e;n=m*k;o=e*b;p=j*k;q=o*j;r=c-d;?r"


def test_an_unsure_greedy_thread_is_followed_by_sampled_ones_that_settle_the_answer():
    pool = ScriptedPool(lambda i: "5")
    # sampled threads run at the profile's temperature and nucleus
    calibrated_at = profile().model_copy(update={"temperature": 0.6, "top_p": 0.9})
    state = asyncio.run(Controller(pool, calibrated_at, KV_PER_TOKEN, [1, 4, 8]).solve(
        "task", HARD, ids(HARD), Budget(kv_budget_bytes=10**9)))
    assert state["stop_reason"] == "settled" and state["answer"] == "5" and len(state["threads"]) == 5
    assert state["cr"] == 8 and [e["event"] for e in state["rounds"]] == ["plan", "round", "escalate", "round"]
    first, second = pool.requests
    assert first.samples == (0,) and first.params.temperature == 0.0  # the greedy thread
    assert second.samples == (1, 2, 3, 4) and (second.params.temperature, second.params.top_p) == (0.6, 0.9)


def test_sampled_threads_run_at_the_planned_temperature_unless_the_controller_fixes_one():
    budget = Budget(kv_budget_bytes=10**9, max_threads=17)
    for fixed, expected in ((None, 1.2), (0.5, 0.5)):
        pool = ScriptedPool(lambda i: str(i % 3))  # never settles: every planned round runs
        controller = Controller(pool, temperature_profile(), KV_PER_TOKEN, [1, 8], temperature=fixed)
        state = asyncio.run(controller.solve("task", HARD, ids(HARD), budget))
        assert state["temperature"] == expected and state["rounds"][0]["temperature"] == expected
        assert pool.requests[0].params.temperature == 0.0  # the greedy thread
        assert {r.params.temperature for r in pool.requests[1:]} == {expected} and len(state["threads"]) == 17


def test_a_confident_greedy_thread_is_the_answer():
    pool = ScriptedPool(lambda i: "5", min_logprob=-0.1)
    state = run(pool, HARD, Budget(kv_budget_bytes=10**9))
    assert state["stop_reason"] == "confident" and state["answer"] == "5" and len(state["threads"]) == 1


def test_a_plan_of_one_greedy_thread_stops_after_it_even_when_unsure():
    p = profile()
    p.entries += [ProfileEntry(k_min=11, k_max=20, cr=1, threads=1, greedy=True, accuracy=0.9, tokens_per_thread=2000)]
    pool = ScriptedPool(lambda i: "5")
    state = asyncio.run(Controller(pool, p, KV_PER_TOKEN, [1, 4, 8]).solve("task", HARD, ids(HARD), Budget(kv_budget_bytes=10**9)))
    assert state["rounds"][0]["greedy"] and state["stop_reason"] == "planned" and len(state["threads"]) == 1


def test_disagreement_escalates_to_more_threads_then_stops_at_the_thread_budget():
    pool = ScriptedPool(lambda i: str(i % 3))  # never settles
    state = run(pool, HARD, Budget(kv_budget_bytes=10**9, max_threads=16))  # the plan: 8x x16, after the greedy one
    events = [e["event"] for e in state["rounds"]]
    assert events == ["plan"] + ["round", "escalate"] * 3 + ["round"] and state["stop_reason"] == "budget"
    assert len(state["threads"]) == 16 and sorted(t["sample"] for t in state["threads"]) == list(range(16))


def test_past_the_plan_escalation_stops_when_the_profile_expects_no_gain():
    pool = ScriptedPool(lambda i: str(i % 3))
    state = run(pool, HARD, Budget(kv_budget_bytes=10**9, max_threads=64))
    # the plan is 8x x16 (best in the profile), run as 1 greedy + 16 sampled; the profile knows nothing past 16
    assert state["stop_reason"] == "no_expected_gain" and len(state["threads"]) == 17


def ratio_profile(accuracy_at_8x_16: float) -> CalibrationProfile:
    """Hard problems: 4 vanilla threads vote 0.6 and 16 reach 0.65 (which does not fit the test budget);
    8x threads are worse one by one, and 16 of them vote ``accuracy_at_8x_16``."""
    table = {1: {1: 0.5, 4: 0.6, 16: 0.65}, 8: {1: 0.3, 4: 0.45, 16: accuracy_at_8x_16}}
    entries = [ProfileEntry(k_min=1, k_max=20, cr=cr, threads=n, accuracy=a, tokens_per_thread=400)
               for cr, row in table.items() for n, a in row.items()]
    return CalibrationProfile(model="synthetic", max_new_tokens=300, temperature=0.8, window=16, entries=entries)


def test_a_spent_plan_escalates_to_a_higher_ratio_only_when_the_profile_expects_it_to_vote_better():
    budget = Budget(kv_budget_bytes=4 * 420 * KV_PER_TOKEN, max_threads=40)  # 4 vanilla threads of ~400 tokens
    # 8x x16 would be within a point of 1x x4, so the plan is the cheaper 1x x4; when its threads disagree,
    # 16+ threads at 8x (which fit where 1x does not) are expected to vote better than more vanilla ones
    # (by half a point: min_gain=0 lets so small a gain count).
    pool = ScriptedPool(lambda i: str(i % 2))
    controller = Controller(pool, ratio_profile(0.605), KV_PER_TOKEN, [1, 8], min_gain=0.0)
    state = asyncio.run(controller.solve("task", HARD, ids(HARD), budget))
    assert state["rounds"][0]["cr"] == 1
    escalations = [e for e in state["rounds"] if e.get("cr") == 8 and e["event"] == "escalate"]
    assert escalations and state["cr"] == 8 and len(state["threads"]) > 4
    assert all(len(r.samples) <= 4 for r in pool.requests)  # one chunk per request
    # When the profile says 8x threads vote worse, disagreement brings more vanilla threads instead (when any
    # gain is worth a round: min_gain=0), or nothing more (the default: more vanilla threads add nothing here).
    pool = ScriptedPool(lambda i: str(i % 2))
    controller = Controller(pool, ratio_profile(0.3), KV_PER_TOKEN, [1, 8], min_gain=0.0)
    state = asyncio.run(controller.solve("task", HARD, ids(HARD), budget))
    assert state["cr"] == 1 and {r.cr for r in pool.requests} == {1} and len(state["threads"]) > 5
    pool = ScriptedPool(lambda i: str(i % 2))
    state = asyncio.run(Controller(pool, ratio_profile(0.3), KV_PER_TOKEN, [1, 8]).solve("task", HARD, ids(HARD), budget))
    assert state["stop_reason"] == "no_expected_gain" and len(state["threads"]) == 5


def test_a_real_solve_on_the_shipped_model():
    from workers.local import LocalPool
    from workers.worker import WorkerConfig

    pool = LocalPool(WorkerConfig(kv_budget_bytes=8_000_000))
    controller = Controller(pool, profile(max_new_tokens=300), KV_PER_TOKEN, [1])
    state = asyncio.run(controller.solve("easy", "a=3;b=4;c=a*b;d=c+a;?d", ids("a=3;b=4;c=a*b;d=c+a;?d"), Budget(kv_budget_bytes=8_000_000)))
    assert state["answer"] == "15" and state["k"] == 2
    # The controller stops on its own: the vote settled, the plan was done, or (a sampled thread disagreeing) the
    # profile expected no gain from more threads; not for the budget.
    assert state["votes"]["15"] > len(state["threads"]) / 2
    assert state["stop_reason"] in ("settled", "planned", "confident", "no_expected_gain")
    assert state["rounds"][1] == {"event": "round", "cr": 1, "threads": 1, "greedy": True}


def _saved_samples(saver, task_id: str) -> set[int]:
    """The thread samples a task's checkpoint holds: its state's threads plus its chunks' pending writes."""
    saved = saver.get_tuple({"configurable": {"thread_id": task_id}})
    if saved is None:
        return set()
    threads = list(saved.checkpoint["channel_values"].get("threads", []))
    threads += [t for _, channel, value in saved.pending_writes or [] if channel == "threads" for t in value]
    return {t["sample"] for t in threads}


def test_a_killed_controller_resumes_from_redis_without_rerunning_finished_threads(redis_url, tmp_path):
    """A chunk is finished for good once the checkpointer has saved its threads: killed after that, the controller
    never runs it again. (A chunk killed between its last thread and that save is run again: at least once.)"""
    from orchestrator.redis_saver import RedisSaver

    saver = RedisSaver.from_url(redis_url)
    log = tmp_path / "chunks.log"
    env = {**os.environ, "REDIS_URL": redis_url, "CHUNK_LOG": str(log)}
    command = [sys.executable, str(Path(__file__).with_name("controller_job.py")), "resume-task"]
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not _saved_samples(saver, "resume-task"):
        time.sleep(0.05)
        assert first.poll() is None, first.stderr.read()
    first.send_signal(signal.SIGKILL)
    first.wait()
    saved = _saved_samples(saver, "resume-task")
    run_before = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    saved_chunks = [c for c in run_before if set(c) <= saved]
    assert saved_chunks and len(run_before) < 3  # killed mid-task, with at least one chunk saved
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    state = json.loads(second.stdout)
    chunks = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    assert set(chunks) == {(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)}  # 4 + 8 threads in chunks of 4
    assert all(chunks.count(c) == 1 for c in saved_chunks)  # saved before the kill: never run again
    assert all(chunks.count(c) <= 2 for c in chunks)
    assert sorted(t["sample"] for t in state["threads"]) == list(range(12))


class SaverAtKill(InMemorySaver):
    """Copies what it holds when asked to save the checkpoint that follows the first chunk's threads: what a
    controller killed at that moment leaves behind (the chunk's writes saved, the checkpoint after them not)."""

    def __init__(self):
        super().__init__()
        self.chunk_saved, self.at_kill = False, None

    def put_writes(self, config, writes, task_id, task_path=""):
        super().put_writes(config, writes, task_id, task_path)
        self.chunk_saved |= any(channel == "threads" and value for channel, value in writes)

    def put(self, config, checkpoint, metadata, new_versions):
        if self.chunk_saved and self.at_kill is None:
            self.at_kill = InMemorySaver()
            self.at_kill.storage, self.at_kill.writes, self.at_kill.blobs = map(copy.deepcopy, (self.storage, self.writes, self.blobs))
        return super().put(config, checkpoint, metadata, new_versions)


def test_a_controller_killed_after_a_rounds_last_chunk_but_before_the_next_checkpoint_resumes_the_round():
    """Every chunk of the round has its writes saved, so no task of the latest checkpoint is left to run; the task is
    still unfinished, and a restarted controller goes on from those writes instead of returning them as the answer."""
    hard_only = profile().model_copy(update={"entries": [e.model_copy(update={"threads": 12 if e.threads == 16 else e.threads})
                                                         for e in profile().entries if e.cr == 1]})

    def solve(pool, saver):
        controller = Controller(pool, hard_only, KV_PER_TOKEN, [1], threshold=1.01, greedy_first=False, checkpointer=saver)
        return asyncio.run(controller.solve("task", HARD, ids(HARD), Budget(kv_budget_bytes=10**9, max_threads=12)))

    saver = SaverAtKill()
    solve(ScriptedPool(lambda i: str(i % 3)), saver)  # never settles: the task runs all 12 threads
    left = saver.at_kill
    writes = left.get_tuple({"configurable": {"thread_id": "task"}}).pending_writes
    assert {t["sample"] for _, channel, threads in writes if channel == "threads" for t in threads} == {0, 1, 2, 3}
    resumed = ScriptedPool(lambda i: str(i % 3))
    state = solve(resumed, left)
    assert [r.samples for r in resumed.requests] == [(4, 5, 6, 7), (8, 9, 10, 11)]  # the saved chunk is not rerun
    assert state["stop_reason"] == "budget" and sorted(t["sample"] for t in state["threads"]) == list(range(12))
    again = ScriptedPool(lambda i: str(i % 3))
    ended = solve(again, left)  # a finished task is returned as it ended, nothing rerun
    assert not again.requests and (ended["stop_reason"], ended["answer"]) == (state["stop_reason"], state["answer"])
    assert sorted(t["sample"] for t in ended["threads"]) == list(range(12))


def test_allocator_grants_waiting_rounds_by_priority_and_an_oversized_one_alone():
    from orchestrator.allocator import ThreadAllocator

    async def scenario():
        allocator = ThreadAllocator(100)
        await allocator.acquire("first", 100, priority=0.1)
        low = asyncio.create_task(allocator.acquire("low", 60, priority=1.0))
        await asyncio.sleep(0)
        high = asyncio.create_task(allocator.acquire("high", 60, priority=5.0))
        gone = asyncio.create_task(allocator.acquire("cancelled", 10, priority=9.0))
        await asyncio.sleep(0)
        assert allocator.waiting == 3 and not low.done()
        gone.cancel()
        await asyncio.sleep(0)
        allocator.release(100)
        await asyncio.sleep(0)
        assert high.done() and not low.done()  # 60 + 60 > 100: the higher priority goes first, the other waits
        allocator.release(60)
        await asyncio.sleep(0)
        assert low.done() and allocator.grants == ["first", "high", "low"] and allocator.in_use == 60
        allocator.release(60)
        await allocator.acquire("huge", 1000, priority=1.0)  # more than the capacity: granted once alone
        assert allocator.in_use == 1000

    asyncio.run(scenario())


class SlowPool(ScriptedPool):
    async def collect(self, request, on_result=None, on_tokens=None):
        await asyncio.sleep(0.01)
        return await super().collect(request, on_result)


def test_a_new_tasks_first_round_goes_ahead_of_another_tasks_escalations():
    from orchestrator.allocator import ThreadAllocator

    class RecordingAllocator(ThreadAllocator):
        def __init__(self, capacity_bytes):
            super().__init__(capacity_bytes)
            self.arrivals: list[str] = []

        async def acquire(self, task_id, nbytes, priority):
            self.arrivals.append(task_id)
            await super().acquire(task_id, nbytes, priority)

    pool = SlowPool(lambda i: str(i % 3))  # never settles: every task runs its whole plan (16 threads)
    allocator = RecordingAllocator(1)  # every chunk is larger: one chunk at a time
    # Two controllers share the allocator; the first opens with a 12-thread round (3 chunks).
    big_first = Controller(pool, profile(), KV_PER_TOKEN, [1, 4, 8], allocators=[allocator], first_round=12,
                           greedy_first=False)
    controller = Controller(pool, profile(), KV_PER_TOKEN, [1, 4, 8], allocators=[allocator], greedy_first=False)
    budget = Budget(kv_budget_bytes=10**9, max_threads=24)

    async def both():
        hard = asyncio.create_task(big_first.solve("hard", HARD, ids(HARD), budget))
        while allocator.arrivals.count("hard") < 3:  # its first round is queued: one chunk runs, two wait
            await asyncio.sleep(0.001)
        late = asyncio.create_task(controller.solve("late", HARD, ids(HARD), budget))
        return await hard, await late

    hard, late = asyncio.run(both())
    assert hard["stop_reason"] == late["stop_reason"] == "no_expected_gain"
    # Hard chunks that had arrived before the late task's first one, but were granted after it.
    late_arrival = allocator.arrivals.index("late")
    queued_before = allocator.arrivals[:late_arrival].count("hard")
    granted_before = allocator.grants[: allocator.grants.index("late")].count("hard")
    assert granted_before < queued_before  # FIFO would have granted every one of them first
    assert allocator.in_use == 0 and allocator.waiting == 0


def confidence_profile() -> CalibrationProfile:
    """A greedy_confidence profile (any task): a sure greedy thread (lowest token log-probability above -0.3) is
    right 97% of the time and nothing beats it; an unsure one is right 50%, and 16 sampled threads at 8x vote 80%."""
    entries = []
    for (low, high), greedy, votes in (((-9.0, -0.3), 0.5, {1: (0.45, 0.4), 4: (0.6, 0.65), 16: (0.7, 0.8)}),
                                       ((-0.3, 0.0), 0.97, {1: (0.9, 0.85), 4: (0.95, 0.93), 16: (0.96, 0.95)})):
        for cr in (1, 8):
            entries.append(ProfileEntry(low=low, high=high, cr=cr, threads=1, greedy=True, accuracy=greedy,
                                        tokens_per_thread=300))
            for n, (at1, at8) in votes.items():
                entries.append(ProfileEntry(low=low, high=high, cr=cr, threads=n, accuracy=at1 if cr == 1 else at8,
                                            tokens_per_thread=300))
    return CalibrationProfile(model="synthetic", task="math", signal="greedy_confidence", signal_cr=1,
                              max_new_tokens=300, temperature=0.8, problems=200, window=16, entries=entries)


def test_a_profile_bins_on_its_signal_and_reads_profiles_written_with_k_bins(tmp_path):
    p = confidence_profile()
    assert p.bins() == [(-9.0, -0.3), (-0.3, 0.0)]
    assert p.bin_of(-0.1) == (-0.3, 0.0) and p.bin_of(-50) == (-9.0, -0.3)  # past either end: the nearest bin
    assert p.bin_of(-0.3) == (-9.0, -0.3)  # a shared edge: the first bin holding it (calibration bins the same way)
    assert p.pooled_greedy_accuracy(1) == pytest.approx(0.735)
    with pytest.raises(ValueError, match="difficulty"):
        p.entries_for(None)  # no hardest-bin default: a task without its signal is not planned from a bin
    legacy = {"model": "m", "max_new_tokens": 10, "temperature": 1.0, "entries": [
        {"k_min": 1, "k_max": 5, "cr": 1, "threads": 1, "accuracy": 0.5, "tokens_per_thread": 10}]}
    (tmp_path / "calibration-chain.json").write_text(json.dumps(legacy))
    loaded = CalibrationProfile.for_model(tmp_path)["chain"]
    assert (loaded.task, loaded.signal, loaded.bins()) == ("chain", "k", [(1.0, 5.0)])


MATH = "What is 7 times 6, minus 2?"


def confidence_run(min_logprob: float, answer_of=lambda i: "40"):
    pool = ScriptedPool(answer_of, min_logprob=min_logprob)
    events = []
    controller = Controller(pool, confidence_profile(), KV_PER_TOKEN, [1, 8])
    state = asyncio.run(controller.solve("task", MATH, [5] * 40, Budget(kv_budget_bytes=10**9), task_family="math",
                                         on_event=lambda name, data: events.append((name, data))))
    return pool, state, events


def test_a_sure_greedy_thread_is_the_whole_plan_of_a_task_without_a_known_difficulty():
    pool, state, events = confidence_run(min_logprob=-0.05)
    assert state["stop_reason"] == "planned" and len(state["threads"]) == 1 and state["answer"] == "40"
    assert events[0] == ("plan", {"event": "plan", "cr": 1, "threads": 1, "greedy": True, "provisional": True,
                                  "temperature": 0.8, "expected_accuracy": 0.735})
    replan = dict(events)["replan"]
    assert replan["greedy"] and replan["signal"] == -0.05 and replan["expected_accuracy"] == 0.97
    assert pool.requests[0].params.temperature == 0 and pool.requests[0].task_family == "math"


def test_an_unsure_greedy_thread_replans_to_the_vote_its_bin_expects_to_pay():
    pool, state, events = confidence_run(min_logprob=-2.0, answer_of=lambda i: str(i % 3))  # never settles
    replan = dict(events)["replan"]
    assert (replan["cr"], replan["threads"], replan["greedy"]) == (8, 16, False)  # the bin's best: 16 threads at 8x
    assert state["k"] == -2.0 and state["cr"] == 8
    sampled = [r for r in pool.requests if r.params.temperature > 0]
    assert sampled and all(r.cr == 8 and r.task_family == "math" for r in sampled)
    assert pool.requests[0].cr == 1  # the probe thread ran at the profile's signal ratio
    assert len(state["threads"]) <= 17 and state["stop_reason"] in ("no_expected_gain", "budget", "planned")
