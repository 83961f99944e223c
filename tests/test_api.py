"""The REST service over real HTTP (uvicorn on a loopback port, the engine in-process)."""

import asyncio

import time

import httpx
import pytest

from orchestrator.api import create_app
from orchestrator.service import service_factory
from orchestrator.jobs import MemoryJobStore
from dms_runtime.loading import SHIPPED_MODEL
from http_server import serving


@pytest.fixture(scope="module")
def server(monkeypatch_module):
    monkeypatch_module.setenv("THINKPOOL_API_KEYS", "secret-key,small-key:2:5000000")
    with serving(create_app(service_factory(SHIPPED_MODEL, 20_000_000, 0), store=MemoryJobStore()), ready_s=30) as url:
        yield url


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


AUTH = {"X-API-Key": "secret-key"}


def test_health_is_open_and_everything_else_needs_a_key(server):
    assert httpx.get(f"{server}/healthz").json() == {"status": "ok"}
    assert httpx.post(f"{server}/v1/solve", json={"prompt": "a=1;b=2;c=a+b;?c"}).status_code == 401
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    models = httpx.get(f"{server}/v1/models", headers=AUTH).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "chain-qwen3"


def test_per_key_limits(server):
    small = {"X-API-Key": "small-key"}
    response = httpx.post(f"{server}/v1/solve", json={"prompt": "a=1;b=2;c=a+b;?c", "samples": 3, "kv_budget": 4000000},
                          headers=small)
    assert response.status_code == 422 and "at most 2 for this API key" in response.json()["detail"][0]["msg"]
    response = httpx.post(f"{server}/v1/solve", json={"prompt": "a=1;b=2;c=a+b;?c", "samples": 2}, headers=small)
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "kv_budget"]
    ok = httpx.post(f"{server}/v1/solve", json={"prompt": "a=12;b=5;c=a-b;?c", "samples": 2, "kv_budget": 5000000,
                                                "max_tokens": 300}, headers=small, timeout=120)
    assert ok.status_code == 200 and ok.json()["answer"] == "7"
    spec = httpx.get(f"{server}/openapi.json").json()
    assert {"202", "422"} <= set(spec["paths"]["/v1/solve"]["post"]["responses"])


def test_sync_solve_and_cached_repeat(server):
    body = {"prompt": "a=3;b=4;c=a*b;d=c+a;?d", "samples": 3, "seed": 1}
    first = httpx.post(f"{server}/v1/solve", json=body, headers=AUTH, timeout=120)
    assert first.status_code == 200, first.text
    result = first.json()
    assert result["answer"] == "15" and result["samples"] == 3 and len(result["threads"]) == 3
    assert 0 < result["kv_peak_bytes"] <= 20_000_000 and result["tokens"] > 0
    assert all(t["kv_cr"] == 1.0 for t in result["threads"])  # vanilla threads hold every token
    again = httpx.post(f"{server}/v1/solve", json=body, headers=AUTH, timeout=120).json()
    assert again == result  # answered from the job store's cache


def test_invalid_requests_get_422_naming_the_field(server):
    cases = [
        ({"prompt": "a=1;b=2;c=a+x;?c"}, "prompt", "unknown variable 'x'"),
        ({"prompt": "a=1;b=2;c=a+b;?c", "samples": 0}, "samples", "between 1 and 256"),
        ({"prompt": "a=1;b=2;c=a+b;?c", "cr": 16}, "cr", "no DMS adapter for 16x"),
        ({"prompt": "a=1;b=2;c=a+b;?c", "kv_budget": 1000}, "kv_budget", "cannot hold one thread"),
        ({"prompt": "a=1;b=2;c=a+b;?c", "colour": "red"}, "colour", "Extra inputs"),
    ]
    for body, field, message in cases:
        response = httpx.post(f"{server}/v1/solve", json=body, headers=AUTH)
        assert response.status_code == 422, (body, response.text)
        detail = response.json()["detail"][0]
        assert field in detail["loc"] and message in detail["msg"], detail


def test_async_job_events_and_cancel(server):
    accepted = httpx.post(f"{server}/v1/solve", json={"prompt": "a=12;b=5;c=a-b;?c", "samples": 2, "async": True}, headers=AUTH)
    assert accepted.status_code == 202
    job_id = accepted.json()["id"]
    events = []
    with httpx.stream("GET", f"{server}/v1/jobs/{job_id}/events", headers=AUTH, timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith("event: "):
                events.append(line.removeprefix("event: "))
    assert events[-1] == "done" and "votes" in events and events.count("thread") == 2
    job = httpx.get(f"{server}/v1/jobs/{job_id}", headers=AUTH).json()
    assert job["state"] == "done" and job["result"]["answer"] == "7"
    long_job = httpx.post(f"{server}/v1/solve", json={"prompt": "a=76;b=53;c=28;d=18;e=d*b;f=e+a;g=f*c;h=g-d;i=h*h;j=i+e;?j",
                                                      "samples": 6, "async": True, "max_tokens": 1000}, headers=AUTH).json()
    time.sleep(1.0)
    cancelled = httpx.delete(f"{server}/v1/jobs/{long_job['id']}", headers=AUTH, timeout=60).json()
    assert cancelled["state"] == "cancelled"
    assert httpx.get(f"{server}/v1/jobs/nope", headers=AUTH).status_code == 404


def test_openai_style_completions_and_metrics(server):
    response = httpx.post(f"{server}/v1/completions", json={"model": "chain-qwen3", "prompt": "a=7;b=2;c=a+a;d=c*c;?d", "n": 2},
                          headers=AUTH, timeout=120).json()
    assert response["object"] == "text_completion" and len(response["choices"]) == 2
    text = response["choices"][0]["text"]  # the generated text: the chain of thought, then the answer
    assert text.rstrip().endswith("#96") and "d=" in text  # chain values are taken mod 100
    assert response["usage"]["prompt_tokens"] == 1 + len("a=7;b=2;c=a+a;d=c*c;?d\n")  # BOS, then a token a character
    bad = httpx.post(f"{server}/v1/completions", json={"prompt": "a=1;?b", "n": 2}, headers=AUTH)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "prompt"  # OpenAI's error shape
    metrics = httpx.get(f"{server}/metrics", headers=AUTH).text
    assert "thinkpool_pool_bytes 2" in metrics and "thinkpool_request_seconds_count" in metrics


def test_sdk_clients_and_agent_tool(server):
    from orchestrator import Client, LocalClient, solve_tool
    from orchestrator.client import ClientError

    client = Client(server, api_key="secret-key")
    result = client.solve("a=12;b=5;c=a-b;?c", samples=2)
    assert result.answer == "7" and result.samples == 2
    assert asyncio.run(client.asolve("a=12;b=5;c=a-b;?c", samples=2)).answer == "7"
    job = client.job(client.submit("a=3;b=4;c=a*b;d=c+a;?d", samples=1))
    assert job.request.samples == 1
    with pytest.raises(ClientError, match="422"):
        Client(server, api_key="secret-key").solve("a=1;b=2;c=a+b;?c", cr=16)
    with pytest.raises(ClientError, match="401"):
        Client(server).solve("a=1;b=2;c=a+b;?c")
    local = LocalClient(kv_budget=8_000_000)
    assert local.solve("a=12;b=5;c=a-b;?c", samples=1).answer == "7"
    tool = solve_tool(client)
    assert "answer 7" in tool.invoke({"problem": "a=12;b=5;c=a-b;?c", "samples": 2})


def test_bench_load_against_the_server(server):
    from evaluation.benchmarks import bench_load

    report = asyncio.run(bench_load(server, concurrency=8, requests=24, samples=1, api_key="secret-key"))
    assert report["ok"] == 24 and report["lost"] == 0 and report["server_errors"] == 0
    assert 0 < report["pool_peak_bytes"] <= report["pool_bytes"]
    assert report["latency_s"]["p50"] <= report["latency_s"]["p99"]


def test_the_controller_mode_uses_the_shipped_calibration_profile(server):
    response = httpx.post(f"{server}/v1/solve", json={"prompt": "a=12;b=5;c=a-b;?c", "mode": "controller"},
                          headers=AUTH, timeout=300)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["answer"] == "7" and result["stop_reason"] in ("settled", "planned", "confident") and result["samples"] >= 1
