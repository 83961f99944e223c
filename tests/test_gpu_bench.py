"""``thinkpool bench gpu`` on the CPU: its tiny smoke runs every section (the CUDA tests, Hugging Face ``generate``,
the engine at CR 1 and at 8x, the retrofit step, the plot) and reports finite figures, without importing anything
the GPU machine lacks."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ABSENT_ON_THE_GPU_MACHINE = {"pydantic", "ray", "kvpress", "langgraph", "fastapi", "redis"}
RUNNER = """
import atexit, json, runpy, sys
modules, sys.argv = sys.argv[1], ["evaluation.gpu_bench", *sys.argv[2:]]
atexit.register(lambda: open(modules, "w").write(json.dumps(sorted({m.split(".")[0] for m in sys.modules}))))
runpy.run_module("evaluation.gpu_bench", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bench")
    modules = out / "modules.json"
    done = subprocess.run([sys.executable, "-c", RUNNER, str(modules), "--tiny", "--device", "cpu", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout), out, set(json.loads(modules.read_text()))


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def test_the_smoke_reports_every_run_with_finite_figures(smoke):
    report, out, _ = smoke
    assert report["command"].startswith("python -m evaluation.gpu_bench") and report["date"]
    env = report["environment"]
    assert env["torch"] and env["transformers"] and env["device"] == "cpu" and env["bandwidth_bytes_per_s"] > 0
    assert report["cuda_tests"]["status"] == "skipped"  # no GPU here: test_cuda.py skips, but it did run
    assert all("error" not in s for s in report["sections"].values()), report["sections"]
    assert abs(report["gates"]["marked_fraction"] - (1 - 1 / report["config"]["cr"])) < 0.05
    runs = {run["method"]: run for run in report["runs"]}
    assert set(runs) == {"hf_generate", "engine", "engine_dms"}
    budget = report["config"]["kv_budget_bytes"]
    for run in runs.values():
        assert run["threads"] >= 1 and run["steps"] >= 1 and run["syncs"] is None  # syncs are counted on CUDA only
        for key in ("tokens_per_s", "median_step_ms", "bound_ms", "ratio_to_bound"):
            assert finite(run[key]) and run[key] > 0, (run["method"], key, run[key])
        assert 0 < run["kv_held_bytes"] <= budget
        assert run["context_tokens"] == report["config"]["context_tokens"]
    for run in (runs["engine"], runs["engine_dms"]):
        assert run["admitted"] == run["threads"] and run["preemptions"] == 0 and run["slots_in_use_after"] == 0
        assert run["probe_syncs_per_step"] == 0 and run["reads_per_step"] == 1, run["probe_ops"]  # one read a step
    # At 8x the pool holds several times the threads of CR 1 (the window is a large part of a tiny thread).
    assert runs["engine_dms"]["threads"] >= 3 * runs["engine"]["threads"]
    assert runs["engine_dms"]["memory_compression"] > 3 and runs["engine"]["memory_compression"] == 1
    assert all(finite(v) for v in report["speedups"].values())
    training = report["training"]
    assert training["tokens"] == report["config"]["train_tokens"] and training["grads_finite"]
    assert finite(training["kl"]) and 0 < training["trainable_parameters"] < training["frozen_parameters"]
    assert json.loads((out / "gpu_bench.json").read_text())["runs"] == report["runs"]
    assert (out / "gpu_bench.png").stat().st_size > 0 and report["plot"] == str(out / "gpu_bench.png")


def test_the_bench_imports_nothing_the_gpu_machine_lacks(smoke):
    _, _, modules = smoke
    assert not modules & ABSENT_ON_THE_GPU_MACHINE


def test_the_cli_hands_its_options_to_the_bench():
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "bench", "gpu", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: thinkpool bench gpu")
    assert "--kv-budget-gb" in done.stdout and "--tiny" in done.stdout
