"""Limits that hold, over real HTTP on the shipped chain model: the body limit for every body (chunked too), a
documented 400 for a body that is not UTF-8, one 422 shape, every status in the OpenAPI spec, per-key rate limits,
a bounded queue, deadlines, jobs and cached results that belong to one key, a client that leaves stopping its
threads, finished jobs that expire, and the embedded Ray on loopback only."""

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from dms_runtime.loading import SHIPPED_MODEL
from http_server import serving
from orchestrator.api import create_app
from orchestrator.jobs import MemoryJobStore, RedisJobStore
from orchestrator.schemas import Job, SolveRequest
from orchestrator.service import service_factory
from orchestrator.settings import LimitSettings

REPO = Path(__file__).resolve().parent.parent
ALICE, BOB, SLOW = {"X-API-Key": "alice-key"}, {"X-API-Key": "bob-key"}, {"X-API-Key": "slow-key"}
EASY = "a=12;b=5;c=a-b;?c"
LONG = {"prompt": "a=76;b=53;c=28;d=18;e=d*b;f=e+a;g=f*c;h=g-d;i=h*h;j=i+e;?j", "samples": 8, "max_tokens": 1500,
        "temperature": 1.0, "async": True}  # seconds of decoding on a CPU
MAX_ACTIVE = 2


@pytest.fixture(scope="module")
def server():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("THINKPOOL_API_KEYS", "alice-key,bob-key,slow-key:::3")  # slow-key: 3 requests a minute
        app = create_app(service_factory(SHIPPED_MODEL, 20_000_000, 0), store=MemoryJobStore(),
                         limits=LimitSettings(max_active_jobs=MAX_ACTIVE))
    with serving(app, ready_s=60) as url:
        yield url


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=ALICE).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(f"thinkpool_{name} ")))


def wait_for(condition, seconds: float = 120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("the condition never held")


def final(url: str, job_id: str, headers=ALICE) -> dict:
    return wait_for(lambda: (job := httpx.get(f"{url}/v1/jobs/{job_id}", headers=headers).json())["state"]
                    not in ("queued", "running") and job)


# -- bodies -----------------------------------------------------------------------------------------------------
def test_every_body_over_the_limit_is_refused_chunked_or_not(server):
    body = b'{"prompt": "' + b"a" * 5_000_000 + b'"}'

    def chunked():
        for start in range(0, len(body), 32_768):
            yield body[start:start + 32_768]

    headers = ALICE | {"Content-Type": "application/json"}
    try:
        refused = httpx.post(f"{server}/v1/solve", content=chunked(), headers=headers, timeout=60)
        assert refused.status_code == 413 and "over 65536 bytes" in refused.json()["detail"]
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        pass  # the server answered 413 and closed while the client still wrote: it read no further than the limit
    declared = httpx.post(f"{server}/v1/solve", content=body[:70_000], headers=headers, timeout=60)
    assert declared.status_code == 413
    openai_shape = httpx.post(f"{server}/v1/completions", content=body[:70_000], headers=headers, timeout=60)
    assert openai_shape.status_code == 413 and "error" in openai_shape.json()
    assert httpx.post(f"{server}/v1/solve", json={"prompt": EASY, "samples": 1}, headers=ALICE, timeout=120).json()[
        "answer"] == "7"  # and the server carries on


def test_a_body_that_is_not_utf8_is_a_documented_400(server):
    response = httpx.post(f"{server}/v1/solve", content='{"prompt": "é"}'.encode("latin-1"),
                          headers=ALICE | {"Content-Type": "application/json"})
    assert response.status_code == 400 and "not UTF-8" in response.json()["detail"]


def test_every_422_has_one_shape_naming_the_field_and_its_limit(server):
    cases = [({"prompt": EASY, "samples": 0}, "samples", "between 1 and 256"),  # pydantic
             ({"prompt": EASY, "samples": True}, "samples", "not a boolean"),  # a JSON type the schema does not allow
             ({"prompt": EASY, "max_tokens": 9000}, "max_tokens", "8192"),
             ({"prompt": EASY, "cr": 16}, "cr", "no DMS adapter for 16x"),  # the service, after pydantic
             ({"prompt": EASY, "stop": ["a"] * 5}, "stop", "at most 4")]
    for body, field, limit in cases:
        response = httpx.post(f"{server}/v1/solve", json=body, headers=ALICE)
        assert response.status_code == 422, response.text
        issues = response.json()["detail"]
        assert all(set(issue) == {"loc", "msg", "type"} for issue in issues)
        assert issues[0]["loc"] == ["body", field] and limit in issues[0]["msg"], issues


def test_every_status_a_route_answers_is_in_the_openapi_spec_with_its_schema(server):
    spec = httpx.get(f"{server}/openapi.json").json()
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            statuses = set(operation["responses"])
            assert {"200", "400", "413"} <= statuses, (method, path)
            if path not in ("/healthz", "/readyz"):
                assert {"401", "429"} <= statuses, (method, path)  # a key, and its rate limit
            if method == "post":
                assert "422" in statuses
            for status, response in operation["responses"].items():
                content = response.get("content")
                assert content and all("schema" in media and media["schema"] for media in content.values()), \
                    (method, path, status)
    assert {"202", "500", "504"} <= set(spec["paths"]["/v1/solve"]["post"]["responses"])
    assert "404" in spec["paths"]["/v1/jobs/{job_id}"]["get"]["responses"]
    completion = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert completion["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Completion"}
    assert completion["404"]["content"]["application/json"]["schema"]["$ref"].endswith("/OpenAIErrorBody")


# -- keys, the queue, deadlines ---------------------------------------------------------------------------------
def test_a_key_past_its_rate_limit_gets_429_with_retry_after(server):
    answers = [httpx.get(f"{server}/v1/jobs/none", headers=SLOW) for _ in range(4)]
    assert [a.status_code for a in answers] == [404, 404, 404, 429]
    refused = answers[-1]
    assert int(refused.headers["Retry-After"]) >= 1 and "3 requests per minute" in refused.json()["detail"]
    openai_shape = httpx.get(f"{server}/v1/models", headers=SLOW)
    assert openai_shape.status_code == 429 and openai_shape.json()["error"]["type"] == "rate_limit_error"
    assert httpx.get(f"{server}/v1/jobs/none", headers=ALICE).status_code == 404  # other keys are not slowed


def test_a_full_queue_answers_429_with_retry_after_instead_of_waiting(server):
    running = [httpx.post(f"{server}/v1/solve", json=LONG | {"seed": i}, headers=ALICE).json()["id"]
               for i in range(MAX_ACTIVE)]
    refused = httpx.post(f"{server}/v1/solve", json={"prompt": EASY, "samples": 1, "seed": 99}, headers=ALICE)
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert "queue full" in refused.json()["detail"]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="alice-key", max_retries=0)
    with pytest.raises(openai.RateLimitError) as full:
        client.completions.create(model="chain-qwen3", prompt=EASY)
    assert full.value.body["code"] == "queue_full"
    for job_id in running:
        assert httpx.delete(f"{server}/v1/jobs/{job_id}", headers=ALICE, timeout=60).json()["state"] == "cancelled"
    accepted = httpx.post(f"{server}/v1/solve", json={"prompt": EASY, "samples": 1, "seed": 99}, headers=ALICE,
                          timeout=120)
    assert accepted.status_code == 200 and accepted.json()["answer"] == "7"


def test_a_deadline_stops_the_work_and_says_so(server):
    job_id = httpx.post(f"{server}/v1/solve", json=LONG | {"deadline_s": 0.5, "seed": 5}, headers=ALICE).json()["id"]
    job = final(server, job_id)
    assert job["state"] == "timed_out" and "deadline_s" in job["error"] and job["result"] is None
    wait_for(lambda: metric(server, "pool_used_bytes") == 0)  # its threads stopped and freed their KV
    sync = httpx.post(f"{server}/v1/solve", json=LONG | {"async": False, "deadline_s": 0.3, "seed": 6}, headers=ALICE,
                      timeout=60)
    assert sync.status_code == 504 and "not finished within 0.3 s" in sync.json()["detail"]


def test_jobs_and_cached_results_belong_to_the_key_that_made_them(server):
    body = {"prompt": EASY, "samples": 2, "seed": 42, "async": True}
    mine = httpx.post(f"{server}/v1/solve", json=body, headers=ALICE).json()["id"]
    assert final(server, mine)["state"] == "done"
    again = httpx.post(f"{server}/v1/solve", json=body, headers=ALICE)
    assert again.status_code == 202 and again.json() == {"id": mine, "state": "done"}  # from alice's cache
    theirs = httpx.post(f"{server}/v1/solve", json=body, headers=BOB).json()["id"]
    assert theirs != mine  # bob's request runs: alice's result is not bob's
    for method, path in [("GET", f"/v1/jobs/{mine}"), ("DELETE", f"/v1/jobs/{mine}"),
                         ("GET", f"/v1/jobs/{mine}/events")]:
        assert httpx.request(method, f"{server}{path}", headers=BOB).status_code == 404
    assert final(server, theirs, BOB)["state"] == "done"


def test_a_streaming_client_that_leaves_stops_its_threads(server):
    body = {"model": "chain-qwen3", "messages": [{"role": "user", "content": LONG["prompt"]}], "n": 4,
            "max_tokens": 1500, "temperature": 1.0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, headers=ALICE, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # tokens are flowing: leave now
    wait_for(lambda: metric(server, "active_solves") == 0 and metric(server, "pool_used_bytes") == 0)


def test_a_job_stream_carries_its_threads_tokens_as_they_decode(server):
    job_id = httpx.post(f"{server}/v1/solve", json={"prompt": "a=3;b=4;c=a*b;d=c+a;?d", "samples": 3, "seed": 8,
                                                    "async": True}, headers=ALICE).json()["id"]
    texts, ids, kinds = {}, [], []
    with httpx.stream("GET", f"{server}/v1/jobs/{job_id}/events", headers=ALICE, timeout=120) as stream:
        event = None
        for line in stream.iter_lines():
            if line.startswith("id: "):
                ids.append(int(line[4:]))
            elif line.startswith("event: "):
                event = line[7:]
                kinds.append(event)
            elif line.startswith("data: ") and event == "tokens":
                data = json.loads(line[6:])
                texts[data["sample"]] = texts.get(data["sample"], "") + data["text"]
    job = final(server, job_id)
    assert kinds.count("thread") == 3 and kinds[-1] == "done" and ids == sorted(ids)
    assert texts == {t["sample"]: t["text"] for t in job["result"]["threads"]}  # the deltas add up to each text
    resumed = httpx.get(f"{server}/v1/jobs/{job_id}/events", headers=ALICE | {"Last-Event-ID": str(ids[-2])}).text
    assert resumed.count("event: ") == 1 and "event: done" in resumed  # after a finish only the rest is told


# -- expiry and Ray ---------------------------------------------------------------------------------------------
def test_finished_jobs_expire_and_unfinished_ones_stay(redis_url):
    request = SolveRequest(prompt=EASY, samples=1)
    memory = MemoryJobStore(ttl_s=0.3)
    memory.save(Job(id="done-1", state="done", request=request, created_s=0, updated_s=0, owner="k"))
    memory.save(Job(id="running-1", state="running", request=request, created_s=0, updated_s=0))
    assert memory.cached(request, "k").id == "done-1" and memory.cached(request, "other") is None
    wait_for(lambda: memory.get("done-1") is None, seconds=10)
    assert memory.cached(request, "k") is None and memory.get("running-1") is not None
    redis_store = RedisJobStore(redis_url, prefix="thinkpool:expiry-test", ttl_s=60)
    redis_store.save(Job(id="done-2", state="done", request=request, created_s=0, updated_s=0))
    redis_store.save(Job(id="running-2", state="running", request=request, created_s=0, updated_s=0))
    client = redis_store.client
    assert 0 < client.pttl("thinkpool:expiry-test:job:done-2") <= 60_000
    assert client.pttl("thinkpool:expiry-test:job:running-2") == -1  # kept until it finishes


def test_the_embedded_ray_binds_to_loopback_only():
    probe = """
import json, time, psutil, ray
from workers.pool import ensure_ray
ensure_ray(num_cpus=1)
ray.get(ray.remote(lambda: 1).remote())
time.sleep(1)
me = psutil.Process()
found = set()
for process in [me] + me.children(recursive=True):
    try:
        found |= {c.laddr.ip for c in process.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    except psutil.Error:
        pass
print(json.dumps(sorted(found)))
ray.shutdown()
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert done.returncode == 0, done.stderr[-2000:]
    addresses = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert addresses and addresses <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, addresses
