"""Fitting a DMS adapter's threshold to its target ratio, on the shipped retrofitted model and its adapters."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dms_runtime.adapters import adapter_path, load_gates, read_adapter_metadata, set_threshold
from dms_runtime.loading import REPO_ROOT, SHIPPED_MODEL, load_model
from training.retrofit import RetrofitConfig
from training.thresholds import fit_threshold, greedy_solves, measure, measure_teacher_forced, teacher_forced
from tasks.chain import generate_suite
from tasks.families import get_family
from workers.thread import SamplingParams
from workers.worker import WorkerConfig, build_engine



@pytest.fixture(scope="module")
def dms_model():
    return load_model(SHIPPED_MODEL)


@pytest.fixture()
def adapter_8x(tmp_path):
    path = tmp_path / "dms-8x.safetensors"
    shutil.copy(adapter_path(SHIPPED_MODEL, 8), path)
    set_threshold(path, 0.0)
    return path


def test_set_threshold_rewrites_the_metadata_and_keeps_the_gates(adapter_8x, dms_model):
    before = load_file(str(adapter_8x))
    set_threshold(adapter_8x, 3.5, extra={"threshold_fit": {"problems": 2}})
    metadata = read_adapter_metadata(adapter_8x)
    assert metadata["dms_config"]["threshold"] == 3.5 and metadata["threshold_fit"] == {"problems": 2}
    assert metadata["target_cr"] == 8
    after = load_file(str(adapter_8x))
    assert all(torch.equal(before[name], after[name]) for name in before)
    _, config = load_gates(dms_model[0], adapter_8x)  # the fingerprint check still passes
    assert config.threshold == 3.5


def test_a_higher_threshold_evicts_less(adapter_8x, dms_model):
    problems = generate_suite(2, 6, 8, seed=11)
    evicting, _ = measure(*dms_model, adapter_8x, 0.0, problems)
    keeping, _ = measure(*dms_model, adapter_8x, 1000.0, problems)
    assert keeping == pytest.approx(1.0) and evicting > 2.0


def test_the_fit_moves_towards_the_target(adapter_8x, dms_model):
    problems = generate_suite(2, 6, 8, seed=12)
    start, _ = measure(*dms_model, adapter_8x, 0.0, problems)
    fit = fit_threshold(adapter_8x, greedy_solves(*dms_model, problems), len(problems), seed=12, max_trials=3,
                        progress=False)
    assert fit.trials <= 3 and fit.target_cr == 8
    assert abs(fit.realized_cr / 8 - 1) <= abs(start / 8 - 1)
    if abs(start / 8 - 1) > 0.03:  # it had to move: up when the gates overshoot, down when they fall short
        assert (fit.threshold > 0) == (start > 8)


@pytest.fixture(scope="module")
def engine_threads_8x() -> list[tuple[list[int], object]]:
    """The engine's greedy 8x threads on three chain problems: (the sequence each fed its model, its result)."""
    engine = build_engine(WorkerConfig(model=str(SHIPPED_MODEL)))
    chain = get_family("chain")
    prompts = {f"p{i}": chain.encode(p["prompt"], engine.tokenizer) for i, p in enumerate(generate_suite(3, 6, 12, seed=21))}
    for problem_id, ids in prompts.items():
        engine.submit(problem_id, ids, [0], SamplingParams(temperature=0.0, max_new_tokens=400, logprobs=True), 8.0)
    threads = engine.run()
    engine.close()
    return [(prompts[t.problem_id] + list(t.token_ids), t) for t in threads]


def test_one_teacher_forced_pass_holds_what_decoding_held(dms_model, engine_threads_8x):
    """The task-agnostic fit reads finished threads in one pass: on the engine's own 8x threads, that pass realizes
    exactly the ratio each thread reported, so a fit on text predicts what serving realizes."""
    path = adapter_path(SHIPPED_MODEL, 8)
    threshold = read_adapter_metadata(path)["dms_config"]["threshold"]
    for sequence, thread in engine_threads_8x:
        assert thread.realized_cr > 2  # the gates evicted: the comparison is not 1 against 1
        assert measure_teacher_forced(dms_model[0], path, threshold, [sequence]) == pytest.approx(thread.realized_cr,
                                                                                                   rel=1e-4)


def test_the_teacher_forced_fit_moves_towards_the_target(adapter_8x, dms_model, engine_threads_8x):
    model = dms_model[0]
    sequences = [sequence for sequence, _ in engine_threads_8x]
    start = measure_teacher_forced(model, adapter_8x, 0.0, sequences)
    fit = fit_threshold(adapter_8x, teacher_forced(model, sequences), len(sequences), seed=0, max_trials=4,
                        progress=False, source="teacher_forced")
    assert fit.accuracy is None and fit.source == "teacher_forced" and fit.trials <= 4
    assert abs(fit.realized_cr / 8 - 1) <= abs(start / 8 - 1)
    assert fit.realized_cr == pytest.approx(measure_teacher_forced(model, adapter_8x, fit.threshold, sequences))
    if abs(start / 8 - 1) > 0.03:
        assert (fit.threshold > 0) == (start > 8)


def test_the_shipped_retrofit_is_what_its_config_trains_and_a_higher_ratio_holds_less(dms_model):
    """The shipped model (checkpoints/chain-qwen3) comes from configs/retrofit_chain_more.yaml continuing
    configs/retrofit_chain.yaml (its ratios, steps and difficulty range), every adapter loads onto its weights at its
    fitted threshold, and on the same problems each higher ratio holds less KV while the greedy threads still solve
    them."""
    first = RetrofitConfig.from_yaml(REPO_ROOT / "configs" / "retrofit_chain.yaml")
    config = RetrofitConfig.from_yaml(REPO_ROOT / "configs" / "retrofit_chain_more.yaml")
    assert (REPO_ROOT / config.output).resolve() == SHIPPED_MODEL.resolve() and config.full_finetune
    assert config.continue_from == first.output and config.total_steps > first.total_steps
    problems = generate_suite(3, 4, 6, seed=13)
    realized = {}
    for cr in config.ratios:
        metadata = read_adapter_metadata(adapter_path(SHIPPED_MODEL, cr))
        assert metadata["target_cr"] == cr and metadata["train_steps"] == config.total_steps
        assert metadata["continued_from"] == first.output
        assert metadata["threshold_fit"]["k"] == [config.k_min, config.k_max]
        assert sorted(metadata["ratios_trained_together"]) == sorted(config.ratios)
        threshold = metadata["dms_config"]["threshold"]
        realized[cr], accuracy = measure(*dms_model, adapter_path(SHIPPED_MODEL, cr), threshold, problems)
        assert accuracy >= 2 / 3, f"{cr}x"
    ratios = sorted(realized)
    assert realized[ratios[0]] > 1 and all(realized[a] < realized[b] for a, b in zip(ratios, ratios[1:]))


@pytest.mark.parametrize(("config_file", "k_range"), [("retrofit_chain_1h.yaml", (1, 20)),
                                                      ("retrofit_chain_8x_long.yaml", (12, 20))])
def test_the_first_models_8x_only_recipes_still_read(config_file, k_range):
    """The 8x-only retrofits of the first shipped model are no longer shipped; their configs rebuild them
    (docs/history.md): 8x alone, every row training it, on the first model, over their difficulty range."""
    config = RetrofitConfig.from_yaml(REPO_ROOT / "configs" / config_file)
    assert config.ratios == [8] and not config.anchor_rows and (config.k_min, config.k_max) == k_range
    assert Path(config.model) == Path("checkpoints/chain-qwen3-v1") and config.total_steps == 720
