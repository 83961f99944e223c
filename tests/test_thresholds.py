"""Fitting a DMS adapter's threshold to its target ratio, on the shipped retrofitted model and its adapters."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from dms_runtime.adapters import adapter_path, load_gates, read_adapter_metadata, set_threshold
from dms_runtime.loading import REPO_ROOT, load_model
from training.retrofit import RetrofitConfig
from training.thresholds import fit_threshold, measure
from tasks.chain import generate_suite

SHIPPED_DMS = REPO_ROOT / "checkpoints" / "chain-qwen3-dms"
# The 8x-only retrofits of the first shipped model (chain-qwen3-v1), kept beside the three-ratio ones: each with
# the config that trains it and a difficulty range it serves (the long-reasoning one never saw short problems).
EIGHT_X_RETROFITS = [("chain-qwen3-v1-dms-8x-1h", "retrofit_chain_1h.yaml", (4, 6)),
                     ("chain-qwen3-v1-dms-8x-long", "retrofit_chain_8x_long.yaml", (12, 14))]


@pytest.fixture(scope="module")
def dms_model():
    return load_model(SHIPPED_DMS)


@pytest.fixture()
def adapter_8x(tmp_path):
    path = tmp_path / "dms-8x.safetensors"
    shutil.copy(adapter_path(SHIPPED_DMS, 8), path)
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
    fit = fit_threshold(*dms_model, adapter_8x, problems, seed=12, max_trials=3, progress=False)
    assert fit.trials <= 3 and fit.target_cr == 8
    assert abs(fit.realized_cr / 8 - 1) <= abs(start / 8 - 1)
    if abs(start / 8 - 1) > 0.03:  # it had to move: up when the gates overshoot, down when they fall short
        assert (fit.threshold > 0) == (start > 8)


@pytest.mark.parametrize(("checkpoint", "config_file", "k_range"), EIGHT_X_RETROFITS)
def test_an_8x_retrofit_is_what_its_config_trains_and_it_compresses(checkpoint, config_file, k_range):
    """Each shipped 8x-only retrofit comes from its config (8x alone, its steps, its difficulty range), loads onto
    its own weights, and solves problems of a difficulty it serves greedily at several times less KV."""
    config = RetrofitConfig.from_yaml(REPO_ROOT / "configs" / config_file)
    model_dir = REPO_ROOT / "checkpoints" / checkpoint
    metadata = read_adapter_metadata(adapter_path(model_dir, 8))
    assert config.ratios == [8] and metadata["target_cr"] == 8 and metadata["train_steps"] == config.total_steps
    assert metadata["threshold_fit"]["k"] == [config.k_min, config.k_max]
    model, tokenizer = load_model(model_dir)
    realized, accuracy = measure(model, tokenizer, adapter_path(model_dir, 8), metadata["dms_config"]["threshold"],
                                 generate_suite(3, *k_range, seed=13))
    assert realized > 3 and accuracy >= 2 / 3
