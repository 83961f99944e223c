"""Run configs that start from another (``base:``): what a variant resolves to, and the errors of a bad chain."""

import subprocess
import sys

import pytest

from training.base_model import TrainConfig
from dms_runtime.loading import REPO_ROOT
from training.retrofit import RetrofitConfig
from training.yaml_config import ConfigFileError, load_yaml_config


def test_a_variant_overrides_its_base_and_merges_sections(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "base.yaml").write_text("seed: 0\noptim:\n  lr: 0.002\n  steps: 100\nmodel:\n  hidden_size: 64\n")
    (tmp_path / "mid.yaml").write_text("base: recipes/base.yaml\noptim:\n  steps: 300\n")
    (tmp_path / "run.yaml").write_text("base: mid.yaml\nseed: 7\n")
    data = load_yaml_config(tmp_path / "run.yaml")
    assert data == {"seed": 7, "optim": {"lr": 0.002, "steps": 300}, "model": {"hidden_size": 64}}
    config = TrainConfig.from_yaml(tmp_path / "run.yaml")
    assert (config.seed, config.optim.lr, config.optim.steps, config.model.hidden_size) == (7, 0.002, 300, 64)


def test_the_shipped_8x_long_recipe_is_the_one_hour_recipe_on_long_problems():
    long, one_hour = (RetrofitConfig.from_yaml(REPO_ROOT / "configs" / f) for f in ("retrofit_chain_8x_long.yaml", "retrofit_chain_1h.yaml"))
    assert (long.k_min, one_hour.k_min) == (12, 1)
    assert long.model_dump(exclude={"k_min", "output"}) == one_hour.model_dump(exclude={"k_min", "output"})
    assert one_hour.window == 32 and one_hour.ratios == [8.0] and one_hour.anchor_rows is False  # from base and own


@pytest.mark.parametrize(("files", "message"), [
    ({"a.yaml": "base: b.yaml\nseed: 1\n", "b.yaml": "base: a.yaml\n"}, "'base' chain loops (a.yaml -> b.yaml -> a.yaml)"),
    ({"a.yaml": "base: missing.yaml\n"}, "missing.yaml: file not found (the 'base' of"),
    ({}, "a.yaml: file not found"),
    ({"a.yaml": "- seed\n"}, "a config is a mapping of settings, not list"),
])
def test_a_bad_chain_is_named(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigFileError) as error:
        load_yaml_config(tmp_path / "a.yaml")
    assert message in str(error.value)
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "retrofit", "--config", str(tmp_path / "a.yaml")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "argument --config" in done.stderr and message in done.stderr
