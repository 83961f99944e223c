"""Schemathesis against the real app over HTTP on a tiny Qwen3 directory: its default checks (server errors,
statuses, content types, headers and bodies against the OpenAPI spec, schema-valid data accepted and invalid data
refused), bounded to a few examples per operation, find nothing. ``tests/schemathesis.toml`` says which
documented statuses the schema cannot express (a deployment's own 422s, a deadline's 504, the body limit's 413)."""

import subprocess
import sys
from pathlib import Path

import pytest

from byo_models import write_model_dir
from http_server import serving
from orchestrator.api import create_app
from orchestrator.jobs import MemoryJobStore
from orchestrator.service import service_factory
from orchestrator.settings import LimitSettings

CONFIG = Path(__file__).resolve().parent / "schemathesis.toml"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_model_dir(tmp_path_factory.mktemp("schemathesis") / "tiny-qwen", "qwen3")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("THINKPOOL_API_KEYS", "fuzz-key:2")  # two threads at most: every generated solve stays small
        app = create_app(service_factory(model_dir, 4_000_000, 0), store=MemoryJobStore(),
                         limits=LimitSettings(max_active_jobs=8))
    with serving(app) as url:
        yield url


def test_schemathesis_finds_nothing(server, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run", f"{server}/openapi.json",
         "--header", "X-API-Key: fuzz-key", "--max-examples", "15", "--seed", "1", "--workers", "2",
         "--request-timeout", "60", "--output-truncate", "true", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failures" not in run.stdout.split("SUMMARY")[-1]
