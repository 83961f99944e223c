"""Shared fixtures: the shipped model (loaded once) and a small seeded problem file."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not torch.cuda.is_available():
    # The decode kernel's tests run Triton's interpreter, which must be on before triton is first imported, and
    # importing a transformers model imports it: without this, they would run only when their file runs alone.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def shipped():
    from dms_runtime.loading import load_model

    return load_model()


@pytest.fixture(scope="session")
def easy_file(tmp_path_factory):
    from tasks.chain import generate_suite
    from tasks.jsonl import write_jsonl

    path = tmp_path_factory.mktemp("problems") / "easy.jsonl"
    write_jsonl(path, generate_suite(12, 1, 3, seed=12345))
    return path


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server (Debian's package, installed by scripts/test.sh) on a free loopback port."""
    import shutil
    import subprocess
    import time

    import redis

    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed: run scripts/test.sh (it installs Debian's redis-server)"
    from ports import free_port

    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield url
    server.terminate()
    server.wait(timeout=10)
