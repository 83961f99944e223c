"""Base-model training (``thinkpool train``): resumable, and able to start from a trained checkpoint."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from training.base_model import ModelShape, OptimConfig, TrainConfig, train
from training.chain_data import difficulty_batch
from dms_runtime.loading import load_model
from tasks.chain_tokenizer import build_tokenizer

TINY = ModelShape(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  intermediate_size=64)


def tiny_config(out, any_order: bool = False, **overrides) -> TrainConfig:
    return TrainConfig(output_dir=str(out), model=TINY, data={"k_min": 1, "k_max": 3, "any_order": any_order},
                       optim=OptimConfig(steps=4, tokens_per_batch=300, warmup_steps=1), checkpoint_every=1, **overrides)


def test_training_resumes_where_it_stopped_and_exports(tmp_path):
    config = tiny_config(tmp_path / "run")
    train(config, steps=2, quiet=True)
    assert torch.load(tmp_path / "run" / "train_state.pt", weights_only=False)["step"] == 2
    assert not (tmp_path / "run" / "model.safetensors").exists()  # not exported before the last step
    train(config, quiet=True)
    assert torch.load(tmp_path / "run" / "train_state.pt", weights_only=False)["step"] == 4
    model, tokenizer = load_model(tmp_path / "run")
    assert model.config.hidden_size == 32 and tokenizer("a=1;?a")["input_ids"]


def test_a_fine_tune_starts_from_the_given_weights(tmp_path):
    train(tiny_config(tmp_path / "base"), quiet=True)
    tuned = tiny_config(tmp_path / "tuned", any_order=True, init_from=str(tmp_path / "base"))
    tuned.optim.lr = 1e-9
    tuned.optim.steps = 1
    train(tuned, quiet=True)
    base, _ = load_model(tmp_path / "base")
    after, _ = load_model(tmp_path / "tuned")
    weight = "model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(after.state_dict()[weight], base.state_dict()[weight], atol=1e-3, rtol=0)
    scratch = tiny_config(tmp_path / "scratch")
    scratch.optim.lr, scratch.optim.steps = 1e-9, 1
    train(scratch, quiet=True)
    untrained, _ = load_model(tmp_path / "scratch")
    assert not torch.allclose(untrained.state_dict()[weight], base.state_dict()[weight], atol=1e-3)  # without init_from


def test_any_order_batches_hold_the_same_problems_in_other_words():
    tokenizer = build_tokenizer()
    plain = difficulty_batch(tokenizer, random.Random(7), 6, 6, 2000)
    varied = difficulty_batch(tokenizer, random.Random(7), 6, 6, 2000, any_order=True)
    assert plain.k == varied.k and torch.equal(plain.lengths, varied.lengths)  # swapping operands keeps lengths
    prompts = (plain.labels == -100) & (plain.input_ids != tokenizer.pad_token_id)
    assert torch.equal(plain.input_ids[prompts], varied.input_ids[prompts])  # the same problems
    assert not torch.equal(plain.input_ids, varied.input_ids)  # written along other paths


def test_a_fine_tune_grows_an_older_checkpoints_vocabulary_and_records_its_forms(tmp_path):
    """The one-path model predates the ``~`` character: a fine-tune from it keeps its 51 embedding rows, adds the
    new one, and its export says it writes reversed ``-`` lines (``tasks.cot.writes_reversed_minus``)."""
    from dms_runtime.loading import REPO_ROOT
    from tasks.cot import writes_reversed_minus

    base_dir = REPO_ROOT / "checkpoints" / "chain-qwen3-onepath"
    base, _ = load_model(base_dir)
    config = TrainConfig(output_dir=str(tmp_path / "tuned"), init_from=str(base_dir),
                         data={"k_min": 1, "k_max": 2, "any_order": True, "reversed_minus": True},
                         optim=OptimConfig(steps=1, tokens_per_batch=200, warmup_steps=0, lr=1e-9), checkpoint_every=1)
    train(config, quiet=True)
    tuned, tokenizer = load_model(tmp_path / "tuned")
    old, new = base.get_input_embeddings().weight, tuned.get_input_embeddings().weight
    assert old.shape[0] == 51 and new.shape[0] == len(tokenizer) == 52
    torch.testing.assert_close(new[:51], old, atol=2e-3, rtol=0)
    assert writes_reversed_minus(tuned) and not writes_reversed_minus(base)


def test_init_from_must_name_a_checkpoint(tmp_path):
    with pytest.raises(ValidationError, match="no checkpoint at"):
        tiny_config(tmp_path / "run", init_from=str(tmp_path / "missing"))
