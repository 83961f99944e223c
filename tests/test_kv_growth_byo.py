"""``thinkpool kv-growth`` on your own model: a tiny NVIDIA-layout directory (window 16, served as 8x) measured on a
problem file, its growth stored beside it with the weights' fingerprint, reserved by a worker, ignored once the weights
change, reported by ``info``; and the errors bad arguments get."""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from byo_models import nvidia_config, write_model_dir
from cli_runner import cli
from dms_runtime.kv_growth import GROWTH_FILE, KVGrowth, read_growth_file, write_growth_file
from tasks.jsonl import read_problems
from workers.kv_budget import KVBudgetModel
from workers.thread import SamplingParams
from workers.worker import WorkerConfig, build_engine

# The tiny model answers what it learnt in about 25 tokens and then stops at an EOS; sampled hot, many of its threads
# run to their limit. A thread counts once 32 of its tokens left the 16-token window (--min-past-window).
MEASURE = ("--threads", "8", "--temperature", "4", "--max-new-tokens", "80", "--min-past-window", "32", "--seed", "3")
PROMPTS = [{"prompt": "Tell me a long story about cats."},  # no id and no task: the model's family (math)
           {"id": "numbers", "prompt": "List numbers."},
           {"prompt": "Why?", "task": "regex", "answer_pattern": "x"}]
BUDGET = 100_000  # bytes: a few threads of 200 tokens


@pytest.fixture(scope="module")
def nvidia_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("nvidia") / "model", nvidia=nvidia_config())


@pytest.fixture()
def problems(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


@pytest.fixture(scope="module")
def measured(nvidia_dir, tmp_path_factory):
    """A copy of the directory after ``thinkpool kv-growth`` on the problem file, and the fit it printed."""
    model = tmp_path_factory.mktemp("measured") / "model"
    shutil.copytree(nvidia_dir, model)
    path = model.parent / "problems.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    from orchestrator.cli import main

    assert main(["kv-growth", "--model", str(model), "--problems", str(path), "--n", "3", *MEASURE]) == 0
    return model


def reserved_threads(model, reserve: str = "measured") -> tuple[int, dict]:
    """How many 200-token threads of a 60-token prompt the worker's engine admits at 8x in ``BUDGET``, and the growth
    it reports for 8x."""
    engine = build_engine(WorkerConfig(model=str(model), kv_budget_bytes=BUDGET, device="cpu", reserve=reserve))
    try:
        fit = engine.fit(list(range(1, 61)), SamplingParams(temperature=1.0, max_new_tokens=200), 8)
        return fit, engine.budget_model.as_dict()["growth"][8.0]
    finally:
        engine.close()


def nominal_threads() -> int:
    kv_bytes_per_token = 2 * 2 * 16 * 2 * 4  # layers x KV heads x head_dim x (K, V) x fp32 on the CPU
    return KVBudgetModel.nominal(kv_bytes_per_token, [8.0], 16).threads_that_fit(BUDGET, 8, 60, 200)


def test_kv_growth_on_an_nvidia_directory_is_stored_beside_it_and_reserved_by(measured):
    fingerprint, entries = read_growth_file(measured)
    assert set(entries) == {8.0} and len(fingerprint) == 16
    fit = entries[8.0]
    assert fit["problems"] == 3 and fit["k"] is None and fit["task"] == "math" and fit["min_past_window"] == 32
    assert 0 < fit["threads"] <= 24 and fit["fingerprint"] == fingerprint
    # The random gates evict about half of what leaves the window: far more kept than the nominal 1/8.
    assert 1 / 8 < fit["generated"] < 1 and 1 / 8 < fit["prompt"] <= 1
    fits, growth = reserved_threads(measured)
    assert growth == KVGrowth.from_dict(fit).as_dict()
    assert 1 <= fits < nominal_threads()  # admission reserves what the gates keep, not 1/cr
    fits, growth = reserved_threads(measured, "nominal")  # the A/B switch still reserves 1/cr
    assert fits == nominal_threads() and growth == KVGrowth.nominal(8).as_dict()


@pytest.mark.parametrize("change", ["gates", "model"])
def test_a_growth_file_measured_on_other_weights_is_ignored_with_a_warning(measured, tmp_path, caplog, change):
    model = tmp_path / "model"
    shutil.copytree(measured, model)
    weights = model / "model.safetensors"
    tensors = load_file(weights)
    name = ("model.layers.0.self_attn.dms_proj_alpha.weight" if change == "gates"
            else "model.layers.0.mlp.down_proj.weight")
    tensors[name] = tensors[name] * 2
    save_file(tensors, weights, metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="dms_runtime.kv_growth"):
        fits, growth = reserved_threads(model)
    assert fits == nominal_threads() and growth == KVGrowth.nominal(8).as_dict()
    assert f"{GROWTH_FILE} was measured on weights" in caplog.text and "nominal 1/cr" in caplog.text


def test_info_reports_each_ratios_reservation(capsys, measured, nvidia_dir):
    code, out, _ = cli(capsys, "info", "--model", str(measured), "--json")
    fingerprint, entries = read_growth_file(measured)
    assert code == 0
    growth = json.loads(out)["kv_growth"]
    assert growth == {"8": {"reserve": "measured", **KVGrowth.from_dict(entries[8.0]).as_dict(), "measured_on": fingerprint}}
    code, out, _ = cli(capsys, "info", "--model", str(nvidia_dir), "--json")
    assert code == 0 and json.loads(out)["kv_growth"] == {"8": {"reserve": "nominal", **KVGrowth.nominal(8).as_dict()}}


def test_the_growth_file_keeps_other_ratios_of_the_same_weights_and_names_a_bad_field(tmp_path):
    entry = {"prompt": 0.5, "generated": 0.25, "generated_curve": [[32, 0.5]]}
    write_growth_file(tmp_path, "aaaa", {8.0: entry})
    write_growth_file(tmp_path, "aaaa", {4.0: entry | {"generated": 0.3}})
    assert read_growth_file(tmp_path) == ("aaaa", {4.0: entry | {"generated": 0.3}, 8.0: entry})
    write_growth_file(tmp_path, "bbbb", {4.0: entry})  # other weights: what was measured on the old ones goes
    assert read_growth_file(tmp_path) == ("bbbb", {4.0: entry})
    data = json.loads((tmp_path / GROWTH_FILE).read_text())
    (tmp_path / GROWTH_FILE).write_text(json.dumps(data | {"ratios": {"4": {"prompt": 0.5}}}))
    with pytest.raises(ValueError, match=f"{GROWTH_FILE}: field 'ratios.4'"):
        read_growth_file(tmp_path)


def test_a_measurement_reads_prompts_only(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "a=1;b=2;c=a+b;?c"}) + "\n" + json.dumps({"prompt": "a=1;b=2;c=a+b;?c", "answer": "4"}) + "\n")
    assert read_problems(path, limit=1, prompts_only=True) == [{"prompt": "a=1;b=2;c=a+b;?c", "id": "line-1", "k": 1}]
    with pytest.raises(ValueError, match="rows.jsonl:2: field 'answer' is '4'"):  # an answer given is still checked
        read_problems(path, prompts_only=True)
    with pytest.raises(ValueError, match="rows.jsonl:1: field 'id' must be a string"):  # eval's rows need theirs
        read_problems(path)


@pytest.mark.parametrize(("args", "message"), [
    (("--problems", "missing.jsonl"), "argument --problems: problem file not found"),
    ((), "argument --problems: the math task needs a problem file to measure on"),
    (("--task", "chain", "--k", "3-5", "--problems", "{problems}"), "argument --k: the difficulties of generated chain"),
    (("--problems", "{problems}", "--cr", "4"), "argument --cr: no DMS gates for 4x"),
    (("--problems", "{problems}", "--n", "0"), "argument --n: "),
    (("--problems", "{problems}", "--min-past-window", "0"), "argument --min-past-window: "),
    (("--problems", "{empty}"), "empty.jsonl:1: field 'prompt': must not be empty"),
])
def test_bad_arguments_exit_2_naming_the_argument(capsys, nvidia_dir, problems, tmp_path, args, message):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"prompt": ""}) + "\n")
    args = [a.format(problems=problems, empty=empty) for a in args]
    code, _, err = cli(capsys, "kv-growth", "--model", str(nvidia_dir), *args)
    assert code == 2 and message in err, err
    assert not (nvidia_dir / GROWTH_FILE).exists()


def test_threads_too_short_to_measure_say_what_to_change_and_store_nothing(capsys, nvidia_dir, problems):
    code, _, err = cli(capsys, "kv-growth", "--model", str(nvidia_dir), "--problems", str(problems), "--n", "1",
                       "--threads", "2", "--max-new-tokens", "16")
    assert code == 2 and "argument --max-new-tokens: no thread at 8x on these problems generated 256 tokens" in err
    assert "raise --max-new-tokens" in err and "lower --min-past-window" in err
    assert not (nvidia_dir / GROWTH_FILE).exists()


def test_gates_without_weights_of_their_own_leave_the_fingerprint_as_the_models():
    from dms_runtime.adapters import model_fingerprint
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=8, intermediate_size=32))
    assert model_fingerprint(model, torch.nn.ModuleList()) == model_fingerprint(model)
    assert model_fingerprint(model, torch.nn.Linear(2, 2)) != model_fingerprint(model)
