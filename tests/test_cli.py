"""The ``thinkpool`` command line, run as a user runs it (a subprocess)."""

import json
import subprocess
import sys

import pytest

from dms_runtime.loading import default_model_path
from policies.planner import CalibrationProfile


def thinkpool(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True, timeout=600, cwd=cwd)


def test_eval_json_reports_the_documented_fields(easy_file, tmp_path):
    plot = tmp_path / "by_k.png"
    done = thinkpool("eval", "--problems", str(easy_file), "--limit", "6", "--json", "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    for field in ("n", "accuracy", "accuracy_by_k", "tokens_generated", "tokens_per_s", "kv_peak_bytes", "config"):
        assert field in report
    assert report["n"] == 6 and set(report["accuracy_by_k"]) <= {"1", "2", "3"}
    assert report["accuracy"] >= 0.8 and report["tokens_generated"] > 6 * 30
    # Six greedy threads of at most ~200 tokens, fp32 K+V of 6 layers x 2 heads x 32 dims.
    assert 0 < report["kv_peak_bytes"] <= 6 * 260 * report["config"]["kv_bytes_per_token"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vote_reports_samples_and_votes(easy_file, tmp_path):
    out = tmp_path / "results.jsonl"
    done = thinkpool("eval", "--problems", str(easy_file), "--limit", "2", "--samples", "4", "--json", "--output", str(out),
                     "--workers", "0")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["samples_per_problem"] == 4 and report["config"]["decoding"] == "sampled+majority"
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 and all(sum(r["votes"].values()) <= 4 for r in records)


def test_eval_scores_sampled_threads_by_the_vote_asked_for(easy_file, tmp_path):
    out = tmp_path / "results.jsonl"
    done = thinkpool("eval", "--problems", str(easy_file), "--limit", "3", "--samples", "4", "--vote", "confidence",
                     "--json", "--output", str(out), "--workers", "0")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["config"]["decoding"] == "sampled+confidence"
    for record in (json.loads(line) for line in out.read_text().splitlines()):
        threads = record["threads"]
        surer = sorted(threads, key=lambda t: -t["mean_logprob"])[:2]  # the kept half: only its answers can win
        assert record["answer"] in {t["answer"] for t in surer}


def test_eval_controller_reports_its_plans_and_writes_each_task(easy_file, tmp_path):
    out = tmp_path / "tasks.jsonl"
    done = thinkpool("eval", "--problems", str(easy_file), "--limit", "2", "--controller", "auto", "--kv-budget", "8MB",
                     "--max-threads", "4", "--workers", "0", "--json", "--output", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr  # the shipped profile is found from any working directory
    report = json.loads(done.stdout)
    assert report["method"] == "controller" and report["n"] == 2 and sum(report["ratios_chosen"].values()) == 2
    assert report["config"]["max_threads"] == 4 and report["config"]["temperature"] is None  # planned per task
    assert report["config"]["profile"].endswith(".json") and 0 < report["kv_peak_bytes"] <= 8_000_000
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [json.loads(line)["id"] for line in easy_file.read_text().splitlines()[:2]]
    assert all(1 <= r["threads"] <= 4 and r["rounds"] for r in records)


def test_kv_budget_with_samples_fit_never_exceeds_the_pool(easy_file):
    budget = 6_000_000
    done = thinkpool("eval", "--problems", str(easy_file), "--limit", "2", "--samples", "fit", "--kv-budget", "6MB",
                     "--max-new-tokens", "300", "--workers", "0", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["kv_budget_bytes"] <= budget and 0 < report["kv_peak_bytes"] <= report["kv_budget_bytes"]
    # 300 new tokens + a short prompt at 3072 bytes per token: about 6 threads fit in 6 MB
    assert report["samples_per_problem"] >= 5 and report["config"]["one_problem_at_a_time"]
    done = thinkpool("eval", "--problems", str(easy_file), "--kv-budget", "1MB", "--workers", "0")
    assert done.returncode == 2 and "argument --kv-budget" in done.stderr and "cannot hold one thread" in done.stderr


def test_solve_and_info():
    done = thinkpool("solve", "a=7;b=42;c=a+b;d=c*a;e=d-b;?e", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["answer"] == "1" and report["votes"] == {"1": 1} and report["tokens"] > 50
    info = json.loads(thinkpool("info", "--json").stdout)
    assert info["architecture"] == "Qwen3ForCausalLM" and info["kv_bytes_per_token"] == 3072


def test_the_default_model_serves_every_ratio():
    """One shipped directory: its 2x, 4x and 8x gates run with no --model, each thread evicting toward its ratio."""
    info = json.loads(thinkpool("info", "--json").stdout)
    assert info["ratios"] == [1.0, 2.0, 4.0, 8.0] and info["task"] == "chain"
    done = thinkpool("solve", "a=7;b=42;c=a+b;d=c*a;e=d-b;f=e*c;g=f+d;?g", "--cr", "8", "--samples", "2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["samples"] == 2 and report["cr"] == 8 and report["realized_cr"] > 2


@pytest.mark.parametrize(
    "args, message",
    [
        (("solve", "a=1;b=2;c=a+x;?c"), "unknown variable 'x'"),
        (("solve", "a=1;b=2;c=a+b;?c", "--samples", "0"), "argument --samples: must be between 1 and 256"),
        (("eval", "--problems", "missing.jsonl"), "problem file not found"),
        (("eval", "--problems", "{bad}", "--kv-budget", "lots"), "argument --kv-budget: expected bytes"),
        (("eval", "--problems", "{bad}", "--samples", "many"), "argument --samples: expected int"),
        (("eval", "--problems", "{bad}", "--temperature", "-1"), "argument --temperature"),
        (("eval", "--problems", "{bad}", "--vote", "loudest"), "argument --vote: invalid choice: 'loudest'"),
        (("generate", "--n", "3", "--k", "0-30", "--output", "x.jsonl"), "argument --k"),
        (("info", "--model", "/nonexistent"), "argument --model: no model at /nonexistent"),
        (("retrofit", "--thresholds-only", "--output", "{tmp}"), "argument --thresholds-only: no trained adapter at"),
        (("kv-growth", "--model", "checkpoints/chain-qwen3", "--cr", "16"), "argument --cr: no DMS gates for 16x"),
        (("kv-growth", "--model", "checkpoints/chain-qwen3", "--quantile", "2"), "argument --quantile"),
        (("kv-growth", "--model", "checkpoints/chain-qwen3", "--cr", "8", "--k", "1-2", "--n", "1", "--threads", "1"),
         "argument --max-new-tokens: no thread at 8x on chain problems of k 1-2 generated 256 tokens past its"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(args, message, easy_file, tmp_path):
    args = tuple({"{bad}": str(easy_file), "{tmp}": str(tmp_path)}.get(a, a) for a in args)
    done = thinkpool(*args)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"id": "x", "prompt": "a=1;b=2;c=a/b;?c", "answer": "3"}', "field 'prompt': assignment 3"),
        ('{"id": "x", "prompt": "a=1;b=2;c=a+b;?c"}', "field 'answer' must be a string"),
        ('{"id": "x", "prompt": "a=1;b=2;c=a+b;?c", "answer": "4"}', "field 'answer' is '4' but the problem evaluates to '3'"),
        ("not json", "not valid JSON"),
    ],
)
def test_bad_problem_files_are_rejected_naming_line_and_field(line, message, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "ok", "prompt": "a=1;b=2;c=a+b;?c", "answer": "3"}\n' + line + "\n")
    done = thinkpool("eval", "--problems", str(path))
    assert done.returncode == 2
    assert f"{path}:2" in done.stderr and message in done.stderr


def test_bench_controller_compares_against_fixed_configurations(easy_file, tmp_path):
    plot = tmp_path / "versus.png"
    done = thinkpool("bench", "controller", "--problems", str(easy_file), "--limit", "3", "--kv-budget", "8MB",
                     "--fixed", "1x1", "1x2", "--max-threads", "4", "--max-new-tokens", "300", "--json", "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    fixed_one, fixed_two, greedy, controller = report["runs"]
    assert [fixed_one["method"], fixed_two["method"], greedy["method"], controller["method"]] == ["1x1", "1x2", "greedy", "controller"]
    assert greedy["config"]["decoding"] == "greedy" and "accuracy_gain" in report["versus_greedy"]
    assert fixed_one["samples_per_problem"] == 1 and fixed_two["samples_per_problem"] == 2
    assert fixed_two["tokens_generated"] > fixed_one["tokens_generated"]
    assert controller["n"] == 3 and sum(controller["threads_chosen"].values()) == 3
    shipped_temperatures = {f"{t:g}" for t in CalibrationProfile.for_model(default_model_path())["chain"].temperatures()}
    assert sum(controller["temperatures_chosen"].values()) == 3  # one plan per problem, at a calibrated temperature
    assert set(controller["temperatures_chosen"]) <= shipped_temperatures
    assert controller["config"]["temperature"] is None  # planned per task, not fixed
    comparison = report["comparison"]
    best = next(r for r in report["runs"] if r["method"] == comparison["best_fixed"])
    assert comparison["token_fraction"] == round(controller["tokens_generated"] / best["tokens_generated"], 4)
    assert plot.stat().st_size > 0


def test_bench_controller_runs_many_tasks_at_once_on_one_pool(easy_file):
    """With --concurrency the tasks share one pool; a fixed configuration's threads are seeded per problem and
    thread, so running them side by side changes what they cost the engine at once, not what they answer.
    A budget that is not a whole number of KV slots is the pool's, rounded down, for every request."""
    def bench(concurrency: str) -> dict:
        done = thinkpool("bench", "controller", "--problems", str(easy_file), "--limit", "4", "--kv-budget", "7.9MB",
                         "--fixed", "1x2", "--max-threads", "4", "--max-new-tokens", "300", "--concurrency",
                         concurrency, "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    alone, together = bench("1"), bench("4")
    assert together["concurrency"] == 4 and [r["method"] for r in together["runs"]] == ["1x2", "greedy", "controller"]
    for one, many in zip(alone["runs"][:2], together["runs"][:2]):
        assert (many["accuracy"], many["tokens_generated"]) == (one["accuracy"], one["tokens_generated"])
    for run in together["runs"]:
        assert run["engine_busy_s"] > 0 and run["kv_peak_bytes"] <= 7_900_000
        assert run["solved_per_engine_s"] == pytest.approx(run["accuracy"] * run["n"] / run["engine_busy_s"], rel=1e-3)
    comparison = together["comparison"]
    assert comparison["best_fixed_per_engine_s"] == "1x2"
    assert comparison["solved_per_engine_s_ratio"] == round(
        together["runs"][2]["solved_per_engine_s"] / together["runs"][0]["solved_per_engine_s"], 4)


def test_bench_controller_rejects_a_ratio_without_an_adapter(easy_file):
    done = thinkpool("bench", "controller", "--problems", str(easy_file), "--kv-budget", "8MB", "--fixed", "16x4")
    assert done.returncode == 2 and "--fixed" in done.stderr and "16x" in done.stderr


def test_compare_to_fixed_picks_the_most_accurate_then_the_cheapest():
    from evaluation.benchmarks import compare_to_fixed

    fixed = [{"method": "1x4", "accuracy": 0.7, "tokens_generated": 1000},
             {"method": "8x16", "accuracy": 0.8, "tokens_generated": 4000},
             {"method": "8x32", "accuracy": 0.8, "tokens_generated": 8000}]
    result = compare_to_fixed(fixed, {"method": "controller", "accuracy": 0.85, "tokens_generated": 2000})
    assert result["best_fixed"] == "8x16" and result["accuracy_gain"] == 0.05 and result["token_fraction"] == 0.5


def test_calibrate_writes_a_profile_with_votes_per_temperature_and_a_greedy_entry_per_bin(tmp_path):
    from policies.planner import CalibrationProfile

    out = tmp_path / "profile.json"
    done = thinkpool("calibrate", "--bins", "1-2", "3-4", "--cr", "1", "--per-bin", "2", "--threads", "2",
                     "--temperature", "0.8", "1.5", "--max-new-tokens", "200", "--top-p", "0.9", "--workers", "0",
                     "--output", str(out))
    assert done.returncode == 0, done.stderr
    profile = CalibrationProfile.load(out)
    assert profile.top_p == 0.9  # the controller samples as the profile was measured
    assert profile.temperatures() == [0.8, 1.5]  # the first given is the default
    for k in (1, 3):
        entries = profile.entries_for(k)
        assert sorted((e.threads, e.greedy, e.temperature) for e in entries) == [
            (1, False, 0.8), (1, False, 1.5), (1, True, None), (2, False, 0.8), (2, False, 1.5)]
        assert profile.greedy_accuracy(k, 1.0) is not None and all(e.tokens_per_thread > 5 for e in entries)
