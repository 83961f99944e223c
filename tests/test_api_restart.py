"""The API process killed (SIGKILL) with async jobs in flight and started again on the same Redis: every
accepted job reaches a final state."""

import os
import signal
import subprocess
import sys
import time

import httpx
from ports import free_port


def start(port: int, env: dict) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--port", str(port), "--workers", "0",
                               "--kv-budget", "20MB"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        assert server.poll() is None, server.stderr.read().decode()[-2000:]
        time.sleep(0.1)
    raise AssertionError("server did not become ready")


def test_jobs_accepted_before_a_crash_finish_after_the_restart(redis_url):
    env = {**os.environ, "REDIS_URL": redis_url, "THINKPOOL_API_KEYS": ""}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start(port, env)
    prompts = ["a=76;b=53;c=28;d=18;e=d*b;f=e+a;g=f*c;h=g-d;i=h*h;j=i+e;?j", "a=12;b=5;c=a-b;?c",
               "a=3;b=4;c=a*b;d=c+a;?d", "a=40;b=2;c=a*b;d=c-a;e=d+b;?e"]
    ids = [httpx.post(f"{url}/v1/solve", json={"prompt": p, "samples": 4, "async": True, "seed": i}).json()["id"]
           for i, p in enumerate(prompts)]
    time.sleep(0.5)
    server.send_signal(signal.SIGKILL)
    server.wait()
    server = start(port, env)
    try:
        deadline = time.time() + 300
        states = {}
        while time.time() < deadline:
            # What is asserted is that every job finishes, not how fast the server answers while it resumes them.
            states = {i: httpx.get(f"{url}/v1/jobs/{i}", timeout=120).json()["state"] for i in ids}
            if all(s in ("done", "failed", "cancelled") for s in states.values()):
                break
            time.sleep(0.5)
        assert all(s == "done" for s in states.values()), states
        assert httpx.get(f"{url}/v1/jobs/{ids[1]}", timeout=120).json()["result"]["answer"] == "7"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
