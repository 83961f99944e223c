"""``thinkpool serve`` on a host other machines can reach: refused (exit 2, naming THINKPOOL_API_KEYS and
--allow-anonymous) without API keys; served with keys, or with --allow-anonymous."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ports import free_port

from orchestrator.cli import build_parser
from orchestrator.commands.serve import check_exposure

REPO = Path(__file__).resolve().parent.parent


def serve(host: str, *flags: str) -> tuple[subprocess.Popen, int]:
    """``thinkpool serve`` with no API key configured."""
    port = free_port()
    env = {**os.environ, "THINKPOOL_API_KEYS": ""}
    env.pop("REDIS_URL", None)
    server = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--host", host, "--port", str(port),
                               "--workers", "0", "--kv-budget", "20MB", *flags], env=env, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return server, port


def test_serving_every_interface_without_api_keys_exits_2_naming_the_keys_and_the_opt_out():
    server, _ = serve("0.0.0.0")
    _, stderr = server.communicate(timeout=300)
    assert server.returncode == 2
    assert "argument --host" in stderr and "THINKPOOL_API_KEYS" in stderr and "--allow-anonymous" in stderr


@pytest.mark.parametrize("host", ["::", "192.0.2.7", "api.example.internal"])
@pytest.mark.parametrize("keys", ["", " , "])
def test_any_reachable_host_needs_keys(host, keys, monkeypatch, capsys):
    monkeypatch.setenv("THINKPOOL_API_KEYS", keys)
    parser = build_parser()
    with pytest.raises(SystemExit) as refused:
        check_exposure(parser.parse_args(["serve", "--host", host]), parser)
    assert refused.value.code == 2 and "THINKPOOL_API_KEYS" in capsys.readouterr().err
    monkeypatch.setenv("THINKPOOL_API_KEYS", "a-key:8")
    check_exposure(parser.parse_args(["serve", "--host", host]), parser)  # keys configured: served
    monkeypatch.setenv("THINKPOOL_API_KEYS", keys)
    check_exposure(parser.parse_args(["serve", "--host", host, "--allow-anonymous"]), parser)  # asked for


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_needs_no_keys(host, monkeypatch):
    monkeypatch.setenv("THINKPOOL_API_KEYS", "")
    parser = build_parser()
    check_exposure(parser.parse_args(["serve", "--host", host]), parser)


def test_allow_anonymous_serves_every_interface_without_keys():
    server, port = serve("0.0.0.0", "--allow-anonymous")
    try:
        for _ in range(1200):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, server.stderr.read()[-3000:]
            time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200  # no key asked
    finally:
        server.terminate()
        server.wait(timeout=30)
