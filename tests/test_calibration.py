"""Calibration for any task family: profiles binned on a greedy thread's confidence, built from hand-made threads;
then on a tiny math model end to end: ``thinkpool calibrate --problems FILE`` writes the model's
``calibration-math.json``, the service plans math tasks from it (a provisional greedy thread, then a replan from its
bin), and ``thinkpool eval`` scores a math problem file greedily and through the controller."""

import asyncio
import json
import subprocess
import sys

import pytest
import torch

from byo_models import write_model_dir
from evaluation.calibration import Measured, build_profile, quantile_bins
from orchestrator.schemas import SolveRequest
from orchestrator.service import SolveService
from policies.planner import CalibrationProfile
from tasks.families import get_family
from workers.records import ThreadResult


def thread(answer: str | None, min_logprob: float, tokens: int = 30) -> ThreadResult:
    return ThreadResult("p", 0, "", tokens, answer, -0.2, 1.0, 1.0, "eos", min_logprob=min_logprob)


def test_quantile_bins_hold_equal_shares_and_cover_every_value():
    values = [-3.0, -0.1, -2.0, -0.01, -1.0, -0.5, -0.2, -0.05]
    bins = quantile_bins(values, 4)
    assert len(bins) == 4 and bins[0][0] == -3.0 and bins[-1][1] == -0.01
    assert all(a[1] == b[0] for a, b in zip(bins, bins[1:]))  # contiguous
    counts = [sum(low <= v <= high for v in values) for low, high in bins]
    assert counts == [2, 2, 2, 2]  # no value sits on an edge: edges are halfway between neighbours
    assert quantile_bins([-1.0], 4) == [(-1.0, -1.0)]  # never more bins than values


def test_a_confidence_profile_scores_each_bin_by_the_family_and_reads_the_signal_at_its_ratio():
    math = get_family("math")
    measured = []
    for index in range(8):
        sure = index % 2 == 0  # sure greedy threads are right (an equal answer in another form), unsure ones wrong
        greedy = {1.0: thread("0.5" if sure else "7", -0.05 if sure else -2.5 - index),
                  8.0: thread("0.5" if sure else "7", -0.1 if sure else -3.0)}
        sampled = {(cr, 0.8): [thread("1/2", -1.0), thread("1/2", -1.0), thread("9", -1.0)] for cr in (1.0, 8.0)}
        measured.append(Measured({"id": str(index), "prompt": "?", "answer": "\\frac{1}{2}"}, math, greedy, sampled))
    profile = build_profile(measured, "greedy_confidence", 2, [1.0, 8.0], [0.8], 100, "tiny", "math", 16, seed=0)
    assert (profile.task, profile.signal, profile.signal_cr, profile.problems) == ("math", "greedy_confidence", 1.0, 4)
    unsure, sure = profile.bins()
    assert unsure[0] == -9.5 and -3.5 < unsure[1] == sure[0] < -0.05 and sure[1] == -0.05  # halfway between the groups
    assert profile.greedy_accuracy(-0.05, 1.0) == 1.0 and profile.greedy_accuracy(-3.0, 1.0) == 0.0
    # "1/2" threads are right against "\frac{1}{2}" (the family's comparison): two of three sampled threads
    assert profile.accuracy(-3.0, 1.0, 1) == pytest.approx(2 / 3, abs=0.15)
    assert {e.threads for e in profile.entries if not e.greedy} == {1, 2}  # vote counts up to the threads measured


PROBLEMS = [{"id": f"q{i}", "prompt": problem, "answer": answer, "task": "math"}
            for i, (problem, answer) in enumerate([("What is 1/2 + 1/4?", "0.75"), ("What is 2 + 2?", "4")] * 2)]


def thinkpool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A tiny math model with the profile ``thinkpool calibrate --problems FILE`` wrote beside it."""
    root = tmp_path_factory.mktemp("calibrated")
    model = write_model_dir(root / "model", "qwen3", dtype=torch.float32)
    problems = root / "math.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    done = thinkpool("calibrate", "--model", str(model), "--problems", str(problems), "--cr", "1", "--threads", "2",
                     "--quantile-bins", "2", "--temperature", "0.7", "--max-new-tokens", "60", "--workers", "0")
    assert done.returncode == 0, done.stderr
    return model, problems


def test_calibrate_writes_the_models_profile_for_its_task_family(calibrated):
    model, _ = calibrated
    profile = CalibrationProfile.for_model(model)["math"]
    assert (profile.signal, profile.task, profile.max_new_tokens) == ("greedy_confidence", "math", 60)
    assert len(profile.bins()) == 2 and {e.cr for e in profile.entries} == {1.0}
    # the model learnt both problems by heart: its greedy threads are right in every bin
    assert all(e.accuracy == 1.0 for e in profile.entries if e.greedy)


def test_the_service_plans_a_math_task_from_its_greedy_threads_confidence(calibrated):
    from dms_runtime.loading import load_tokenizer
    from workers.local import LocalPool
    from workers.worker import WorkerConfig

    model, _ = calibrated
    pool = LocalPool(WorkerConfig(model=str(model), kv_budget_bytes=4_000_000))
    service = SolveService(pool, load_tokenizer(model))
    assert set(service.controllers) == {"math"}  # found beside the model; no chain profile applies to it
    result = asyncio.run(service.solve(SolveRequest(prompt="What is 2 + 2?", samples="auto")))
    events = [e["event"] for e in result.rounds]
    assert events[:2] == ["plan", "round"] and result.rounds[0]["provisional"] and "replan" in events
    assert result.answer == "4" and result.stop_reason is not None
    with pytest.raises(ValueError, match="calibration profile for the regex task"):
        service.check(SolveRequest(prompt="What is 2 + 2?", task="regex", answer_pattern="(\\d+)", mode="controller"))


def test_eval_scores_a_math_problem_file_greedily_and_through_the_controller(calibrated):
    model, problems = calibrated
    greedy = thinkpool("eval", "--model", str(model), "--problems", str(problems), "--max-new-tokens", "60",
                       "--workers", "0", "--json")
    assert greedy.returncode == 0, greedy.stderr
    report = json.loads(greedy.stdout)
    assert report["n"] == 4 and report["accuracy"] == 1.0  # \frac{3}{4} and 0.75 are one answer
    controller = thinkpool("eval", "--model", str(model), "--problems", str(problems), "--controller", "auto",
                           "--kv-budget", "4MB", "--workers", "0", "--json")
    assert controller.returncode == 0, controller.stderr
    assert json.loads(controller.stdout)["n"] == 4
    unanswered = problems.with_name("no_answers.jsonl")
    unanswered.write_text(json.dumps({"id": "x", "prompt": "What is 2 + 2?", "task": "math"}) + "\n")
    refused = thinkpool("eval", "--model", str(model), "--problems", str(unanswered), "--workers", "0")
    assert refused.returncode == 2 and "--problems" in refused.stderr and "answer" in refused.stderr
