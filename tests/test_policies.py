import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from policies.extraction import answers_match, extract_chain_answer
from policies.voting import majority_vote
from tasks.chain import parse_problem
from tasks.cot import line_forms


def test_extraction_takes_the_number_after_the_last_marker():
    assert extract_chain_answer("c=49\n#49") == "49"
    assert extract_chain_answer("#12 then #07") == "7"
    assert extract_chain_answer("#00") == "0"
    assert extract_chain_answer("no marker 42") is None
    assert extract_chain_answer("ends with #") is None


def test_answers_compare_as_numbers():
    assert answers_match("7", "07") and answers_match("0", "0")
    assert not answers_match(None, "0") and not answers_match("70", "7")


def test_majority_vote_counts_and_breaks_ties_by_confidence_not_arrival():
    vote = majority_vote(["3", None, "5", "5", "3", "9"])
    assert vote.answer == "3" and vote.counts == {"3": 2, "5": 2, "9": 1}  # no confidences: the first to appear
    assert majority_vote(["5", "3", "3"]).answer == "3"
    assert majority_vote([None, None]).answer is None
    # With confidences a tie goes to the more confident answer, whatever order the threads arrived in.
    answers, confidences = ["3", None, "5", "5", "3", "9"], [-0.4, -0.1, -0.1, -0.2, -0.3, -0.01]
    assert majority_vote(answers, confidences).answer == "5"
    order = [5, 3, 0, 2, 4, 1]
    assert majority_vote([answers[i] for i in order], [confidences[i] for i in order]).answer == "5"
    assert majority_vote(["3", "5", "5"], [-0.1, -0.9, -0.9]).answer == "5"  # a count is never outvoted by confidence


def test_vote_curve_script_draws_subsets_of_the_kept_threads(tmp_path):
    """``scripts/vote_curve.py`` on two problems: one whose threads are right 2 times in 3, one never right."""
    records = [
        {"expected": "1", "correct": True, "threads": [{"answer": "1"}, {"answer": "1"}, {"answer": "2"}]},
        {"expected": "5", "correct": False, "threads": [{"answer": "4"}, {"answer": "6"}, {"answer": None}]},
    ]
    threads = tmp_path / "threads.jsonl"
    threads.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot = tmp_path / "curve.png"
    done = subprocess.run([sys.executable, "scripts/vote_curve.py", f"run={threads}", "--draws", "400", "--plot", str(plot)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)["runs"][0]
    assert run["n"] == 2 and run["threads"] == 3 and run["accuracy"] == 0.5
    curve = {int(n): v for n, v in run["curve"].items()}
    assert sorted(curve) == [1, 2, 3] and curve[3] == 0.5  # all three: the first problem's vote is right
    assert abs(curve[1] - 1 / 3) < 0.06 and abs(curve[2] - 1 / 3) < 0.06  # 2/3 right on one problem of two
    assert plot.stat().st_size > 0
    bad = subprocess.run([sys.executable, "scripts/vote_curve.py", str(threads)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "LABEL=FILE" in bad.stderr


def test_paired_gain_script_rescores_votes_and_pairs_problems_by_id(tmp_path):
    """``scripts/paired_gain.py``: A solves both problems (one by a confidence tie-break), B only the first."""
    a = [{"id": "p1", "expected": "1", "threads": [{"answer": "1", "mean_logprob": -0.1}]},
         {"id": "p2", "expected": "2", "threads": [{"answer": "3", "mean_logprob": -0.9}, {"answer": "2", "mean_logprob": -0.1}]}]
    b = [{"id": "p2", "expected": "2", "threads": [{"answer": "3", "mean_logprob": -0.1}]},
         {"id": "p1", "expected": "1", "threads": [{"answer": "1", "mean_logprob": -0.1}]}]
    files = {}
    for name, records in (("a", a), ("b", b), ("short", b[:1])):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in records))
    plot = tmp_path / "gain.png"
    done = subprocess.run([sys.executable, "scripts/paired_gain.py", f"draw={files['a']},{files['b']}", "--plot", str(plot)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    draw = report["draws"][0]
    assert (draw["a"], draw["b"], draw["gain"], draw["only_a_right"], draw["only_b_right"]) == (1.0, 0.5, 0.5, 1, 0)
    assert draw["gain_95"][0] <= 0.5 <= draw["gain_95"][1] and report["pooled"]["n"] == 2 and plot.stat().st_size > 0
    mismatched = subprocess.run([sys.executable, "scripts/paired_gain.py", f"draw={files['a']},{files['short']}"],
                                capture_output=True, text=True, timeout=120)
    assert mismatched.returncode == 2 and "different problems" in mismatched.stderr


def test_rewrite_probe_writes_equivalent_problems_and_scores_their_greedy_threads(tmp_path):
    """``scripts/rewrite_probe.py``: every rewrite is the same problem (answer, statements up to operand order,
    `-` untouched) in another text; the scorer groups rewrites by problem and votes over the first n."""
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps({"id": "p", "prompt": "a=7;b=42;c=a+b;d=c*a;e=d-b;f=e*c;g=b+f;?g", "answer": "0"}) + "\n")
    rewrites = tmp_path / "rw.jsonl"
    subprocess.run([sys.executable, "scripts/rewrite_probe.py", "write", "--problems", str(problems), "--rewrites", "8",
                    "--output", str(rewrites)], check=True, timeout=120)
    rows = [json.loads(line) for line in rewrites.read_text().splitlines()]
    original = parse_problem("a=7;b=42;c=a+b;d=c*a;e=d-b;f=e*c;g=b+f;?g")
    assert [r["id"] for r in rows] == [f"p~{i}" for i in range(8)] and rows[0]["prompt"] == original.text
    texts = set()
    for row in rows:
        problem = parse_problem(row["prompt"])
        texts.add(problem.text)
        assert row["answer"] == problem.answer == original.answer
        for a, b in zip(problem.assignments, original.assignments):
            assert (a.var, a.op, a.value) == (b.var, b.op, b.value)
            assert (a.y, a.z) == (b.y, b.z) or (a.op in "+*" and (a.y, a.z) == (b.z, b.y))
    assert len(texts) > 1  # four commutative statements: eight draws do not all keep the text
    threads = tmp_path / "greedy.jsonl"
    answers = [original.answer, "5", "5", original.answer, original.answer, "5", "7", "8"]
    threads.write_text("".join(json.dumps({"id": f"p~{i}", "expected": original.answer, "answer": a, "correct": a == original.answer,
                                           "thread_accuracy": float(a == original.answer),
                                           "threads": [{"answer": a, "mean_logprob": -0.1}]}) + "\n"
                               for i, a in enumerate(answers)))
    report = json.loads(subprocess.run([sys.executable, "scripts/rewrite_probe.py", "score", str(threads)], check=True,
                                       capture_output=True, text=True, timeout=120).stdout)
    assert report["problems_by_right_rewrites"]["3"] == 1 and report["original_failures"] == 0
    assert report["vote_over_first_n_rewrites"]["3"] == 0.0  # 5 holds two of three
    assert report["vote_over_first_n_rewrites"]["8"] == 1.0  # a 3-3 tie of equal confidence: the first to appear
    assert report["accuracy_by_rewrite"] == [1.0, 0, 0, 1.0, 1.0, 0, 0, 0] and report["thread_accuracy"] == 0.375


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_header_probe_reads_the_shipped_models_headers_as_sure_and_an_untrained_ones_as_guesses():
    """``scripts/header_probe.py``: the shipped model copies an easy problem's headers almost surely, on both
    paths; an untrained model of the same shape guesses them (error far above 0.5)."""
    import torch

    from training.base_model import ModelShape, build_model
    from dms_runtime.loading import load_model

    probe = load_script("header_probe")
    model, tokenizer = load_model()
    problem = parse_problem("a=7;b=42;c=a+b;d=c*a;e=d-b;?e")
    canonical = probe.header_copy_probabilities(model, tokenizer, problem, "canonical")
    other = probe.header_copy_probabilities(model, tokenizer, problem, "other_order")
    assert len(canonical) == 3 and len(other) == 3  # the shipped model reads e (-) from the right too
    assert min(canonical + other) > 0.9
    assert probe.summary(canonical)["mean_error"] < 0.1 and probe.summary(canonical)["lines"] == 3
    torch.manual_seed(0)
    untrained = build_model(ModelShape(), tokenizer).eval()
    assert probe.summary(probe.header_copy_probabilities(untrained, tokenizer, problem, "canonical"))["mean_error"] > 0.5


def test_header_probe_finds_a_header_error_that_the_lines_before_barely_move():
    """``--histories``: the same line read after random mixes of operand orders keeps nearly the same error
    (the assumption ``scripts/vote_forecast.py`` rests on); the by-line errors cover every work line."""
    from dms_runtime.loading import load_model

    probe = load_script("header_probe")
    model, tokenizer = load_model()
    problems = [parse_problem("a=7;b=42;c=a+b;d=c*a;e=d*b;f=e+c;g=f*d;?g")]
    spread = probe.history_spread(model, tokenizer, problems, histories=8)
    assert spread["lines"] >= 5 and spread["mean_std"] < 0.05
    assert sum(1 for _ in probe.by_position(model, tokenizer, problems, per=2)) == 3  # 5 work lines, 2 a group


def test_vote_forecast_odds_and_votes_follow_from_the_line_model():
    """``scripts/vote_forecast.py``: a thread is right only if every needed header is; a mistake's answer is
    shared only by threads making exactly that one mistake; a vote is won by a plurality."""
    import random

    forecast = load_script("vote_forecast")
    lines = [forecast.LineOdds(0.5, {"x": 0.5}, True), forecast.LineOdds(0.8, {"y": 0.1}, False)]
    right, wrong = forecast.answer_odds(lines)
    assert abs(right - 0.4) < 1e-9 and [round(w, 6) for w in wrong] == [0.4, 0.05]
    shared = [forecast.LineOdds(0.5, {("operator", 7): 0.3, ("first", "q"): 0.2}, False)]
    assert [round(w, 6) for w in forecast.answer_odds(shared, unshared="operator")[1]] == [0.2]
    assert [round(w, 6) for w in forecast.answer_odds(shared, unshared="operands")[1]] == [0.3]
    assert forecast.answer_odds(shared, unshared="all")[1] == []
    rng = random.Random(0)
    assert forecast.vote_wins(1.0, [], 16, 50, rng) == 1.0 and forecast.vote_wins(0.0, [1.0], 16, 50, rng) == 0.0
    assert forecast.vote_wins(0.3, [], 16, 200, rng) > 0.95  # the wrong threads all disagree
    assert forecast.vote_wins(0.3, [0.7], 16, 200, rng) < 0.1  # the wrong threads agree


def test_vote_forecast_of_the_shipped_model_on_easy_problems_and_of_an_untrained_one(tmp_path):
    import torch

    from training.base_model import ModelShape, build_model
    from dms_runtime.loading import load_model

    forecast = load_script("vote_forecast")
    model, tokenizer = load_model()
    problems = [parse_problem(text) for text in ("a=7;b=42;c=a+b;d=c*a;e=d-b;?e", "a=3;b=9;c=b*a;d=c+c;?d")]
    sure = forecast.forecast(model, tokenizer, problems, [1.0], samples=8, draws=50)
    assert sure["greedy"] == 1.0 and sure["by_temperature"]["1.0"]["vote@8"] > 0.95
    from evaluation.plots import plot_vote_forecast

    png = plot_vote_forecast(sure, tmp_path / "forecast.png", measured={1.0: 1.0})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    torch.manual_seed(0)
    untrained = build_model(ModelShape(), tokenizer).eval()
    guess = forecast.forecast(untrained, tokenizer, problems, [1.0], samples=8, draws=50)
    assert guess["greedy"] == 0.0 and guess["by_temperature"]["1.0"]["one_thread"] < 0.05


def test_error_anatomy_names_the_first_defect_of_a_thread_and_of_its_header():
    """``scripts/error_anatomy.py``'s classifiers: the first line off every valid path, and what its header got wrong."""
    anatomy = load_script("error_anatomy")
    problem = parse_problem("a=7;b=42;c=a+b;d=c*a;e=a-b;?e")
    forms = line_forms(problem)
    right = "\n".join(options[-1] for options in forms)  # the other operand order where there is one: still valid
    assert anatomy.first_error(right, forms) is None
    lines = right.split("\n")
    lines[4] = "d=c+a|c:49+a:07|9+7=16,4+0=04,4+1=05"  # d's header with the wrong operator
    error = anatomy.first_error("\n".join(lines), forms)
    assert (error["line"], error["part"]) == (4, "header")
    lines[4] = "d=a*c|a:07*c:49|7*9=63,0*9=00,7*4=28,6+0=06,6+8=15"  # the other order, a wrong last fact
    error = anatomy.first_error("\n".join(lines), forms)
    assert (error["line"], error["part"]) == (4, "facts") and error["want"].startswith("d=a*c")  # the form it took
    assert anatomy.header_defect("d=a*c", "d=c*a", problem) == "none"
    assert anatomy.header_defect("d=c+a", "d=c*a", problem) == "operator"
    assert anatomy.header_defect("d=b+a", "d=c*a", problem) == "operator+operands+statement"  # c's statement
    assert anatomy.header_defect("e=b-c", "e=a-b", problem) == "operands"
    assert anatomy.header_defect("e=a-", "e=a-b", problem) == "malformed"
    assert anatomy.header_defect("e=b~a", "e=a-b", problem) == "none"  # the same subtraction, read from the right
    assert anatomy.header_defect("e=b-a", "e=a-b", problem) == "operands"  # a - cannot swap its operands
