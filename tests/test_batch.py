"""Batch reasoning submitted with the real ``ray job submit`` to a ``ray start --head`` cluster; --resume."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port
from ray_cluster import stop_cluster

REPO = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))
# A throwaway local cluster: no token authentication (its token would have to reach every client), workers
# at normal priority.
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    port, dashboard = free_port(), free_port()
    temp = tmp_path_factory.mktemp("ray")
    started = subprocess.run([RAY, "start", "--head", f"--port={port}", f"--dashboard-port={dashboard}", "--num-cpus=2",
                              "--include-dashboard=true", f"--temp-dir={temp}", "--disable-usage-stats"],
                             capture_output=True, text=True, env=ENV, timeout=180)
    assert started.returncode == 0, started.stderr
    yield f"http://127.0.0.1:{dashboard}"
    stop_cluster(temp)  # this cluster's processes only, by process id


def test_ray_job_submit_runs_the_batch_and_resume_skips_done_ids(cluster, easy_file, tmp_path):
    problems = tmp_path / "problems.jsonl"
    lines = easy_file.read_text().splitlines()[:4]
    problems.write_text("\n".join(lines) + "\n")
    shutil.copy(problems, REPO / "runs_batch_input.jsonl")
    try:
        submitted = subprocess.run(
            [RAY, "job", "submit", "--address", cluster, "--working-dir", str(REPO), "--",
             sys.executable, "-m", "orchestrator.batch", "--input", "runs_batch_input.jsonl", "--output", str(tmp_path / "results.jsonl"),
             "--samples", "2"],
            capture_output=True, text=True, timeout=600, cwd=REPO, env=ENV,
        )
    finally:
        (REPO / "runs_batch_input.jsonl").unlink()
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in results) == sorted(json.loads(line)["id"] for line in lines)
    assert sum(r["correct"] for r in results) >= 3 and all(r["samples"] == 2 for r in results)
    # --resume (here in-process, joining the same cluster) skips what is done: nothing is added
    again = subprocess.run([sys.executable, "-m", "orchestrator.batch", "--input", str(problems), "--output",
                            str(tmp_path / "results.jsonl"), "--resume"], capture_output=True, text=True, timeout=600, cwd=REPO,
                           env={**ENV, "RAY_ADDRESS": "auto"})
    assert again.returncode == 0, again.stderr[-2000:]
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 4
    # A resumed run gives each remaining problem the threads a full run gives it: seeds come from problem ids.
    partial = tmp_path / "partial.jsonl"
    partial.write_text("\n".join(json.dumps(r) for r in results[:2]) + "\n")
    resumed = subprocess.run([sys.executable, "-m", "orchestrator.batch", "--input", str(problems), "--output", str(partial),
                              "--samples", "2", "--resume"], capture_output=True, text=True, timeout=600, cwd=REPO,
                             env={**ENV, "RAY_ADDRESS": "auto"})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    def threads(record: dict) -> list:
        return [(t["answer"], t["tokens"]) for t in record["threads"]]

    by_id = {r["id"]: threads(r) for r in results}
    rest = [json.loads(line) for line in partial.read_text().splitlines()[2:]]
    assert len(rest) == 2 and all(threads(r) == by_id[r["id"]] for r in rest)


def test_bad_arguments_exit_2():
    done = subprocess.run([sys.executable, "-m", "orchestrator.batch", "--input", "missing.jsonl", "--output", "x.jsonl"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2 and "argument --input: file not found" in done.stderr


def test_thinkpool_batch_is_the_same_entry_point(easy_file, tmp_path):
    problems = tmp_path / "problems.jsonl"
    problems.write_text("\n".join(easy_file.read_text().splitlines()[:2]) + "\n")
    thinkpool = str(Path(sys.executable).with_name("thinkpool"))
    done = subprocess.run([thinkpool, "batch", "--input", str(problems), "--output", str(tmp_path / "out.jsonl"),
                           "--samples", "1"], capture_output=True, text=True, timeout=600, cwd=REPO, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(results) == 2 and all(r["samples"] == 1 and r["correct"] for r in results)
    refused = subprocess.run([thinkpool, "batch", "--input", str(problems), "--output", "x.jsonl", "--samples", "0"],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
    assert refused.returncode == 2 and "argument --samples: must be between 1 and 256" in refused.stderr
