"""A real multi-node Ray cluster on this machine (``ray start``: a head and nodes that join it, each with its own
temp dir and resources): the API's ``/readyz`` tells a dead node and the pool recovers on a new one without losing
a job; workers on two nodes take tasks by free KV; a batch loses and repeats no problem when a node dies under it.

Workers are placed by custom resources (``THINKPOOL_WORKER_RESOURCES``): ``api_worker`` for the API's pool (only the
nodes the recovery test starts and kills have it), ``batch_worker`` one on the head and one on the second node."""

import asyncio
import json
import logging
import time

import httpx
import pytest
import ray
from transformers import AutoTokenizer
from http_server import serving
from ray_cluster import kill_node, start_head, start_node, stop_cluster

from dms_runtime.loading import default_model_path
from orchestrator.api import create_app
from orchestrator.service import service_factory
from workers.pool import WorkerPool
from workers.thread import SamplingParams
from workers.worker import ProblemRequest, WorkerConfig

BATCH = {"batch_worker": 1}
API = {"api_worker": 1}
EASY = ["a=12;b=5;c=a-b;?c", "a=3;b=4;c=a*b;d=c+a;?d", "a=9;b=6;c=a+b;d=c*a;?d", "a=40;b=2;c=a*b;d=c-a;e=d+b;?e"]
TOKENIZER = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
HARD = "a=76;b=53;c=28;d=18;e=16;f=35;g=d*b;h=e+e;i=g+a;j=d-a;k=a*j;l=k*c;m=c-e;n=m*k;o=e*b;p=j*k;q=o*j;r=c-d;?r"


def until(condition, timeout_s: float, what: str, every_s: float = 0.2):
    """Poll ``condition()`` until it returns something truthy (returned); fail naming ``what`` after ``timeout_s``."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def metric(url: str, name: str) -> float:
    """One gauge from the API's ``/metrics``."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def node_with(resource: str) -> str:
    """The id of the one live node that advertises ``resource``."""
    [node] = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    return node


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head with room for one batch worker; this test process is a driver on it."""
    temp = tmp_path_factory.mktemp("head")
    if ray.is_initialized():  # another module's local instance
        ray.shutdown()
    try:
        address = start_head(temp, resources=BATCH)
        ray.init(address=address, log_to_driver=False)
        yield address
    finally:
        ray.shutdown()
        stop_cluster(temp)  # this cluster's processes only, by process id


@pytest.fixture(scope="module")
def two_node_pool(cluster, tmp_path_factory):
    """Two workers, one on the head and one on a second node (the last test kills that node)."""
    temp = tmp_path_factory.mktemp("second")
    try:
        start_node(cluster, temp, resources=BATCH)
        pool = WorkerPool(WorkerConfig(kv_budget_bytes=8_000_000, torch_threads=1), num_workers=2, resources=BATCH)
        try:
            yield pool, temp
        finally:
            pool.shutdown()
    finally:
        stop_cluster(temp)


def request(name: str, prompt: str, samples: int, seed: int = 0, keep: bool = False) -> ProblemRequest:
    return ProblemRequest(name, tuple(TOKENIZER(prompt + "\n")["input_ids"]), tuple(range(samples)),
                          SamplingParams(temperature=0.8, max_new_tokens=300, seed=seed), keep_task=keep)


def test_readyz_tells_a_dead_node_and_the_api_recovers_without_losing_a_job(cluster, tmp_path_factory, monkeypatch):
    first, replacement = tmp_path_factory.mktemp("api-node"), tmp_path_factory.mktemp("api-node-2")
    monkeypatch.setenv("THINKPOOL_WORKER_RESOURCES", json.dumps(API))
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("THINKPOOL_API_KEYS", raising=False)
    try:
        start_node(cluster, first, resources=API)
        app = create_app(service_factory(default_model_path(), 20_000_000, 1))
        with serving(app, ready_s=300) as url:
            ready = httpx.get(f"{url}/readyz")
            assert ready.status_code == 200, ready.text
            assert ready.json()["workers"][0]["node"] == node_with("api_worker")
            first_node = ready.json()["workers"][0]["node"]

            def submit(prompt: str, seed: int) -> str:
                body = {"prompt": prompt, "samples": 3, "async": True, "seed": seed, "max_tokens": 300}
                answer = httpx.post(f"{url}/v1/solve", json=body)
                assert answer.status_code == 202, answer.text
                return answer.json()["id"]

            def states() -> dict[str, str]:
                return {i: httpx.get(f"{url}/v1/jobs/{i}", timeout=30).json()["state"] for i in ids}

            ids = [submit(prompt, seed) for seed, prompt in enumerate([HARD, *EASY])]
            until(lambda: metric(url, "thinkpool_threads_running") > 0, 120, "threads decoding on the node")
            kill_node(first)
            at_kill = states()
            assert any(state != "done" for state in at_kill.values()), at_kill  # jobs were in flight

            def down():
                answer = httpx.get(f"{url}/readyz", timeout=10)
                worker = answer.json().get("workers", [{}])[0]
                return answer if answer.status_code == 503 and worker.get("node_alive") is False else None

            unready = until(down, 60, "/readyz to report the dead node").json()
            assert unready["status"] == "unavailable" and unready["workers"][0]["state"] == "down"
            assert f"worker 0 on Ray node {first_node} (dead) is down" in unready["detail"]
            ids += [submit(EASY[0], 100), submit(EASY[1], 101)]  # accepted while no worker is up

            start_node(cluster, replacement, resources=API)
            ready = until(lambda: (r := httpx.get(f"{url}/readyz", timeout=10)).status_code == 200 and r, 120,
                          "/readyz to recover").json()
            assert ready["workers"][0]["node"] == node_with("api_worker") != first_node
            until(lambda: all(s in ("done", "failed", "cancelled") for s in states().values()), 240, "every job to end")
            jobs = [httpx.get(f"{url}/v1/jobs/{i}").json() for i in ids]
            assert all(job["state"] == "done" for job in jobs), [(j["id"], j["state"], j.get("error")) for j in jobs]
            for job in jobs:  # every thread once: the re-sent ones are not doubled, none is missing
                assert sorted(t["sample"] for t in job["result"]["threads"]) == [0, 1, 2]
            easy = [job for job in jobs if job["request"]["prompt"] in EASY]
            assert all(job["result"]["answer"] is not None for job in easy)
            assert all(job["result"]["answer"] == "7" for job in easy if job["request"]["prompt"] == EASY[0])
    finally:
        for temp in (first, replacement):
            stop_cluster(temp)


def test_workers_on_two_nodes_take_new_tasks_by_free_kv(two_node_pool):
    pool, _ = two_node_pool

    async def scenario():
        health = await pool.health()
        await pool.collect(request("held", EASY[1], 1, keep=True))  # its prompt stays held on its worker
        holder = pool._pins["held"]
        stats = await pool.stats()
        chosen = await pool.pick()
        burst = await asyncio.gather(*(pool.collect(request(f"burst-{i}", EASY[i % 4], 2, i)) for i in range(8)))
        after = await pool.stats()
        await pool.close_task("held")
        return health, holder, stats, chosen, burst, after

    health, holder, stats, chosen, burst, after = asyncio.run(scenario())
    nodes = {h.node for h in health}
    assert all(h.state == "up" and h.node_alive for h in health) and len(nodes) == 2  # one worker on each node
    assert {n["NodeID"] for n in ray.nodes() if n["Alive"] and "batch_worker" in n["Resources"]} == nodes
    other = 1 - holder
    assert stats[holder].reserved_bytes > stats[other].reserved_bytes  # the held prompt's KV
    assert chosen == other  # neither has threads outstanding: the one with more free KV takes the new task
    assert all(sorted(t.sample for t in threads) == [0, 1] for threads in burst)
    assert all(a.tokens_generated > b.tokens_generated for a, b in zip(after, stats))  # the burst ran on both nodes


def test_a_batch_answers_every_problem_once_when_the_second_node_dies(two_node_pool, easy_file, caplog):
    pool, second = two_node_pool
    problems = [json.loads(line) for line in easy_file.read_text().splitlines()]
    head = ray.get_runtime_context().get_node_id()  # this driver's node

    async def batch():
        health = await pool.health()
        [doomed] = [h.worker for h in health if h.node != head]
        runs = [asyncio.create_task(pool.collect(request(p["id"], p["prompt"], 2, seed=i)))
                for i, p in enumerate(problems)]
        await asyncio.wait(runs, return_when=asyncio.FIRST_COMPLETED)
        in_flight = [task for task, worker in pool._pins.items() if worker == doomed]
        kill_node(second)
        results = await asyncio.gather(*runs)
        # Ray's control store learns of the death from missed health checks, possibly after the batch has ended
        deadline = time.time() + 60
        while (health := await pool.health())[doomed].node_alive and time.time() < deadline:
            await asyncio.sleep(0.5)
        return doomed, in_flight, results, health

    with caplog.at_level(logging.WARNING, logger="workers.pool"):
        doomed, in_flight, results, health = asyncio.run(batch())
    assert in_flight  # the dead node's worker owed threads when it died ...
    resent = caplog.text
    assert all(f"threads {task} still owes" in resent for task in in_flight)  # ... and they ran again elsewhere
    for problem, threads in zip(problems, results):  # every problem answered, each thread once
        assert sorted(t.sample for t in threads) == [0, 1] and {t.problem_id for t in threads} == {problem["id"]}
    solved = sum(any(t.answer == p["answer"] for t in threads) for p, threads in zip(problems, results))
    assert solved >= len(problems) // 2
    assert health[doomed].state == "down" and health[doomed].node_alive is False
    assert health[1 - doomed].state == "up"
