"""The analysis tools in research/, run as a user runs them (``research/<name>.py`` from the repository root),
on small hand-made thread files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tool(name: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"research/{name}.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_vote_curve_draws_subsets_of_the_kept_threads(tmp_path):
    """Two problems: one whose threads are right 2 times in 3, one never right."""
    threads = write_jsonl(tmp_path / "threads.jsonl", [
        {"expected": "1", "correct": True, "threads": [{"answer": "1"}, {"answer": "1"}, {"answer": "2"}]},
        {"expected": "5", "correct": False, "threads": [{"answer": "4"}, {"answer": "6"}, {"answer": None}]},
    ])
    plot = tmp_path / "curve.png"
    done = tool("vote_curve", f"run={threads}", "--draws", "400", "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)["runs"][0]
    assert run["n"] == 2 and run["threads"] == 3 and run["accuracy"] == 0.5
    curve = {int(n): v for n, v in run["curve"].items()}
    assert sorted(curve) == [1, 2, 3] and curve[3] == 0.5  # all three: the first problem's vote is right
    assert abs(curve[1] - 1 / 3) < 0.06 and abs(curve[2] - 1 / 3) < 0.06  # 2/3 right on one problem of two
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tool("vote_curve", str(threads))
    assert bad.returncode == 2 and "LABEL=FILE" in bad.stderr


def test_paired_gain_rescores_votes_and_pairs_problems_by_id(tmp_path):
    """A solves both problems (one by a confidence tie-break), B only the first; the files list them in other orders."""
    a = [{"id": "p1", "expected": "1", "threads": [{"answer": "1", "mean_logprob": -0.1}]},
         {"id": "p2", "expected": "2", "threads": [{"answer": "3", "mean_logprob": -0.9}, {"answer": "2", "mean_logprob": -0.1}]}]
    b = [{"id": "p2", "expected": "2", "threads": [{"answer": "3", "mean_logprob": -0.1}]},
         {"id": "p1", "expected": "1", "threads": [{"answer": "1", "mean_logprob": -0.1}]}]
    files = {name: write_jsonl(tmp_path / f"{name}.jsonl", records) for name, records in (("a", a), ("b", b), ("short", b[:1]))}
    plot = tmp_path / "gain.png"
    done = tool("paired_gain", f"draw={files['a']},{files['b']}", "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    draw = report["draws"][0]
    assert (draw["a"], draw["b"], draw["gain"], draw["only_a_right"], draw["only_b_right"]) == (1.0, 0.5, 0.5, 1, 0)
    assert draw["gain_95"][0] <= 0.5 <= draw["gain_95"][1] and report["pooled"]["n"] == 2
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    mismatched = tool("paired_gain", f"draw={files['a']},{files['short']}")
    assert mismatched.returncode == 2 and "different problems" in mismatched.stderr


def test_score_aggregations_scores_every_rule_on_the_same_threads(tmp_path):
    """Problem A ties 2-2: the confident pair is right, the first to arrive and the two with the best worst token
    are wrong. Problem B: two threads right, one very sure wrong one that wins once only the best half votes."""
    def thread(answer, mean, least):
        return {"answer": answer, "mean_logprob": mean, "min_logprob": least}

    records = [
        {"id": "A", "expected": "1", "threads": [thread("2", -0.9, -1.0), thread("1", -0.1, -3.0),
                                                 thread("1", -0.2, -2.5), thread("2", -0.8, -0.9)]},
        {"id": "B", "expected": "5", "threads": [thread("5", -0.5, -0.6), thread("5", -0.6, -0.7),
                                                 thread("7", -0.05, -0.1)]},
        {"id": "C", "expected": "3", "threads": []},  # kept no threads: left out
    ]
    done = tool("score_aggregations", str(write_jsonl(tmp_path / "threads.jsonl", records)))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["n"] == 2 and report["ties_for_first"] == 1
    assert report["accuracy"] == {
        "majority": 1.0,
        "majority, ties by first arrival": 0.5,
        "weighted by exp(mean logprob)": 1.0,
        "confidence (DeepConf, best half)": 0.5,
        "confidence by min logprob (best half)": 0.0,
    }
    empty = tool("score_aggregations", str(write_jsonl(tmp_path / "none.jsonl", records[2:])))
    assert empty.returncode == 1 and "no record keeps its threads" in empty.stderr


def test_bench_training_times_every_path_on_one_small_batch():
    done = tool("bench_training", "--k", "2", "--tokens", "100", "--repeats", "1", timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["batch"]["rows"] == 1 and report["batch"]["tokens"] >= 100  # one whole example of k = 2
    assert report["repeats"] == 1
    assert set(report["precision_s"]) == {"fp32", "bf16_autocast"}
    assert set(report["attention_s"]) == {"fused", "bias_mask", "explicit"}
    assert set(report["dms_model_train_s"]) == {"fused", "bias_mask"}
    timings = [*report["precision_s"].values(), *report["attention_s"].values(), *report["dms_model_train_s"].values()]
    assert all(t >= 0 for t in timings)
    # Attention runs in the dtype training's autocast gives it on this CPU.
    assert report["attention_dtype"] == ("bfloat16" if report["cpu_native_bf16"] else "float32")


def test_accuracy_by_length_pairs_each_band_with_vanilla_and_bounds_the_mean_ratio(tmp_path):
    """A short problem both solve and a long one only vanilla solves: the loss lands in the long band, and a long
    thread's window cap lifts the ceiling to the named ratio while the short one's holds it under."""
    problems = write_jsonl(tmp_path / "problems.jsonl", [
        {"id": "short", "prompt": "a=1;b=a+a;?b", "answer": "2", "k": 1},
        {"id": "long", "prompt": "a=1;b=a+a;?b", "answer": "2", "k": 1}])
    vanilla = write_jsonl(tmp_path / "vanilla.jsonl", [
        {"id": "short", "method": "vanilla", "correct": True, "threads": [{"tokens": 40, "realized_cr": 1.0}]},
        {"id": "long", "method": "vanilla", "correct": True, "threads": [{"tokens": 600, "realized_cr": 1.0}]}])
    dms = write_jsonl(tmp_path / "dms.jsonl", [
        {"id": "short", "method": "dms-8x", "correct": True, "threads": [{"tokens": 40, "realized_cr": 1.5}]},
        {"id": "long", "method": "dms-8x", "correct": False, "threads": [{"tokens": 600, "realized_cr": 12.0}]}])
    done = tool("accuracy_by_length", "--problems", str(problems), "--model", "checkpoints/chain-qwen3",
                "--vanilla", str(vanilla), "--dms", str(dms), "--window", "32")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)["dms-8x"]
    assert report["bands"]["0-127"] | {"window_cap": 0} == {"problems": 1, "vanilla": 1.0, "dms-8x": 1.0,
                                                            "realized_cr": 1.5, "window_cap": 0}
    assert report["bands"]["512-1023"]["dms-8x"] == 0.0 and report["bands"]["512-1023"]["realized_cr"] == 12.0
    short_cap = report["bands"]["0-127"]["window_cap"]
    assert 40 / 32 < short_cap < 8 and report["bands"]["512-1023"]["window_cap"] > 8
    assert report["ceiling"] == pytest.approx((short_cap + 8) / 2, abs=1e-3)


@pytest.mark.parametrize("threshold, kept", [(1e9, 1.0), (-1e9, 0.0)])
def test_kept_by_role_counts_what_the_cache_holds_past_the_window(threshold, kept):
    """A threshold no gate logit crosses evicts nothing: every role is held whole in every pair; one every logit
    crosses evicts everything that left the window."""
    done = tool("kept_by_role", "--model", "checkpoints/chain-qwen3", "--cr", "8", "--k", "3-4", "--n", "2",
                "--threshold", str(threshold))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["threshold"] == threshold and report["window"] > 0
    for role in ("prompt", "register", "scratch"):
        assert report[f"{role}_kept"] == kept
        assert all(f == kept for layer in report[f"{role}_kept_by_layer"] for f in layer)
    assert report["pairs_keeping_long_lived_whole"] == (report["pairs"] if kept else 0)


@pytest.mark.parametrize("threshold, kept", [(1e9, 1.0), (-1e9, 0.0)])
def test_kept_by_role_scores_the_long_lived_set_a_retrofit_planned(tmp_path, threshold, kept):
    """Every kind planned long-lived: the planned set is every token past the window, so it is kept as the roles are;
    the plan's bands ask three pairs to keep it at 8x."""
    import torch

    from training.effect_roles import EffectRoles
    from training.gate_labels import RoleLabels

    kinds = EffectRoles(3, torch.zeros(192), torch.ones(192), torch.randn(4, 193), torch.ones(4),
                        torch.ones(4, dtype=torch.bool))  # layer 3 of the 192-wide shipped model, four kinds
    bonus = torch.zeros(6, 2)
    bonus[1:4, 0] = 2.0
    state = tmp_path / "retrofit_state-adapter-w32.pt"
    torch.save({"roles": RoleLabels(bonus, [0.5, 1.0, 1.5], kinds).state()}, state)
    done = tool("kept_by_role", "--model", "checkpoints/chain-qwen3", "--cr", "8", "--k", "3-4", "--n", "2",
                "--threshold", str(threshold), "--planned", str(state))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["planned_long_lived_kept"] == kept and report["pairs_planned_whole"] == 3
    assert report["pairs_keeping_planned_whole"] == (report["pairs"] if kept else 0)
    assert all(f == kept for layer in report["planned_kept_by_layer"] for f in layer)


def test_role_scores_ranks_tokens_by_each_score_against_the_chain_roles():
    done = tool("role_scores", "--k", "6-8", "--n", "2")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["chains"] == 2 and report["tokens"] > 0 and 0 < report["long_lived_share"] < 1
    assert set(report["auc"]) == {"far_attention", "far_reads", "loss_gradient", "far_copy"}
    assert all(0 <= value <= 1 for value in report["auc"].values())
    # The frozen model reads a chain's long-lived tokens from afar more than its scratch, by every score.
    assert all(value > 0.5 for value in report["auc"].values())
    readout = report["readout_auc"]  # one held-out AUC per layer, from each kind of label
    assert set(readout) == {"from_far_reads", "from_roles"}
    assert len(readout["from_far_reads"]) == len(readout["from_roles"]) >= 2
    assert all(0 <= value <= 1 for values in readout.values() for value in values)


@pytest.mark.parametrize("plan_on, cost", [("reference", "nll"), ("sampled", "kl")])
def test_role_scores_scores_the_effect_roles_planned_on_half_the_chains(plan_on, cost):
    done = tool("role_scores", "--k", "6-8", "--n", "4", "--kinds", "8", "--plan-on", plan_on, "--cost", cost,
                timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["kinds"] == 8 and report["layer"] == 3 and 1 <= report["long_lived_kinds"] < 8
    assert report["plan_on"] == plan_on and report["cost_by"] == cost
    assert all(0 <= report[key] <= 1 for key in ("auc", "kept_share", "precision", "recall"))
    costs = [row["cost"] for row in report["by_kind"]]  # the kinds met in the held-out chains, costliest first
    assert costs == sorted(costs, reverse=True) and all(sum(row["regions"].values()) > 0 for row in report["by_kind"])


def test_role_scores_plans_the_effect_roles_on_a_retrofits_calibration_batches(tmp_path):
    from tasks.chain import generate_suite
    from tasks.jsonl import write_jsonl

    problems = tmp_path / "prompts.jsonl"
    write_jsonl(problems, generate_suite(6, 6, 8, seed=3))
    done = tool("role_scores", "--k", "6-8", "--n", "4", "--kinds", "8", "--plan-problems", str(problems),
                "--plan-batches", "2", timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["plan_on"] == f"{problems} (2 batches)" and 1 <= report["long_lived_kinds"] < 8
    assert len((tmp_path / "prompts-completions" / "retrofit-completions.jsonl").read_text().splitlines()) == 6


def test_role_scores_scores_the_effect_roles_a_retrofit_planned(tmp_path):
    import torch

    from training.effect_roles import EffectRoles
    from training.gate_labels import RoleLabels

    kinds = EffectRoles(3, torch.zeros(192), torch.ones(192), torch.randn(4, 193), torch.tensor([2.0, 1.0, 0.5, 0.0]),
                        torch.tensor([True, False, False, False]))  # layer 3 of the 192-wide shipped model, four kinds
    state = tmp_path / "retrofit_state-adapter-w32.pt"
    torch.save({"roles": RoleLabels(torch.zeros(6, 2), [1.0], kinds).state()}, state)
    done = tool("role_scores", "--k", "6-8", "--n", "4", "--kinds-from", str(state), timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["planned_in"] == str(state) and report["kinds"] == 4 and report["long_lived_kinds"] == 1
    assert 0 <= report["kept_share"] <= 1 and {row["kind"] for row in report["by_kind"]} <= {0, 1, 2, 3}


def test_forward_kinds_keeps_kinds_until_the_share_and_scores_them_against_the_roles():
    done = tool("forward_kinds", "--kinds", "6", "--share", "0.05", "--n", "8", timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    shares = [row["share"] for row in report["rounds"]]
    assert shares == sorted(shares) and all(row["gain_per_token"] > 0 for row in report["rounds"])
    assert 0 <= report["recall"] <= 1 and 0 <= report["kept_share"] <= 1


def test_role_scores_auc_counts_ties_half(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "research"))
    from role_scores import auc
    import torch
    assert auc(torch.tensor([2.0, 3.0]), torch.tensor([0.0, 1.0])) == 1.0
    assert auc(torch.tensor([0.0]), torch.tensor([1.0])) == 0.0
    assert auc(torch.tensor([1.0, 1.0]), torch.tensor([1.0])) == 0.5


def test_role_scores_eviction_effect_scores_every_old_token():
    done = tool("role_scores", "--k", "3-3", "--n", "2", "--eviction-effect", timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert 0 <= report["auc"]["eviction_effect"] <= 1 and report["tokens"] > 0
