"""``thinkpool retrofit`` for a user's own model: its sampled completions of a problem file as the training text, and
NVIDIA's separate gates exported in NVIDIA's layout; on tiny model directories as people have them."""

import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dms_runtime.adapters import load_gates, read_adapter_metadata
from dms_runtime.attach import attach_dms
from dms_runtime.loading import load_model
from dms_runtime.nvidia_gates import NvidiaDMSConfig, SeparateGate, build_gates, gate_logits
from dms_runtime.nvidia_layout import load_nvidia_layout
from orchestrator.cli import main
from tasks.chain_tokenizer import build_tokenizer, writes_reversed_minus_lines
from tasks.families import get_family
from tests.byo_models import ANSWERS, GENERATION, write_model_dir
from training.chain_data import IGNORE, difficulty_batch, sample_lengths
from training.completions import CACHE_NAME, calibration_sequences, read_cache
from training.retrofit import RetrofitConfig, RowGates, chain_batch, retrofit
from training.thresholds import DEFAULT_PROBLEMS, measure_teacher_forced
from training.retrofit_data import ChainText, ProblemText, training_text

PROMPTS = [*ANSWERS, "What is 3 + 5?"]
RECIPE = {"window": 8, "ratios": [2, 4], "max_new_tokens": 16, "warmstart_steps": 2, "warmstart_labels": "per_head",
          "ramp_steps": 1, "hold_steps": 1, "tokens_per_batch": 160, "checkpoint_every": 1, "threshold_problems": 0,
          "kv_growth_problems": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("byo") / "model")


@pytest.fixture
def problems(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


def recipe(tmp_path: Path, **changes) -> Path:
    path = tmp_path / f"recipe-{len(list(tmp_path.glob('recipe-*')))}.yaml"
    path.write_text(yaml.safe_dump(RECIPE | changes))
    return path


def retrofit_cli(*args) -> int:
    return main(["retrofit", *map(str, args)])


def refused(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        retrofit_cli(*args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# -- the problem-file source ----------------------------------------------------------------------------------------
def test_a_retrofit_from_a_problem_file_distils_on_the_models_own_cached_completions(tmp_path, model_dir, problems,
                                                                                   monkeypatch):
    out = tmp_path / "out"
    assert retrofit_cli("--config", recipe(tmp_path), "--model", model_dir, "--problems", problems,
                        "--output", out) == 0
    cache = out / CACHE_NAME
    rows = read_cache(cache)
    tokenizer = load_model(model_dir)[1]
    family = get_family("math")  # the family of a model with a BPE tokenizer and no thinkpool.json
    assert [row.id for row in rows] == ["p0", "p1", "p2"]
    for row, prompt in zip(rows, PROMPTS):
        assert row.prompt_ids == family.encode(prompt, tokenizer)  # chat template, thinking, the math instruction
        assert row.completion_ids and row.sampling["temperature"] == GENERATION["temperature"]
        assert row.sampling["top_k"] == GENERATION["top_k"] and row.sampling["max_new_tokens"] == 16
    for ratio in (2, 4):
        metadata = read_adapter_metadata(out / f"dms-{ratio}x.safetensors")
        assert metadata["train_steps"] == 2 and metadata["dms_config"]["parametrization"] == "adapter"

    # A rerun reuses the cache: nothing is sampled (no engine is built), and the file is left as it was.
    before = cache.read_bytes()

    def no_engine(*args, **kwargs):
        raise AssertionError("a rerun sampled again")

    monkeypatch.setattr("training.completions.build_engine", no_engine)
    assert retrofit_cli("--config", recipe(tmp_path), "--model", model_dir, "--problems", problems,
                        "--output", out) == 0
    assert cache.read_bytes() == before
    monkeypatch.undo()
    # More completions per prompt: only the new ones are sampled, appended after the cached rows.
    assert retrofit_cli("--config", recipe(tmp_path, completions_per_problem=2), "--model", model_dir,
                        "--problems", problems, "--output", out) == 0
    assert cache.read_bytes().startswith(before)
    assert [(row.id, row.sample) for row in read_cache(cache)][3:] == [("p0", 1), ("p1", 1), ("p2", 1)]


def test_the_threshold_fit_defaults_to_the_teacher_forced_fit_wherever_there_is_a_threshold():
    assert RetrofitConfig(problems="x.jsonl").threshold_problems == DEFAULT_PROBLEMS
    assert RetrofitConfig(problems="x.jsonl", parametrization="nvidia_separate").threshold_problems == 0
    assert RetrofitConfig().threshold_problems == 0  # generated chain problems: a recipe names its greedy fit
    assert RetrofitConfig(problems="x.jsonl", threshold_problems=8).threshold_problems == 8


def test_a_problem_file_retrofit_fits_each_threshold_on_its_own_completions(tmp_path, model_dir, problems, capsys):
    """Nothing chain-specific and nothing generated: each ratio's threshold is fitted teacher-forced on the cached
    completions, recorded with the adapter, and realizes there what the record says; --thresholds-only refits
    from the cache alone."""
    out = tmp_path / "out"
    config = recipe(tmp_path, threshold_problems=2)
    assert retrofit_cli("--config", config, "--model", model_dir, "--problems", problems, "--output", out) == 0
    model = load_model(model_dir)[0]
    sequences = calibration_sequences(read_cache(out / CACHE_NAME), 2)
    assert len(sequences) == 2
    for ratio in (2, 4):
        path = out / f"dms-{ratio}x.safetensors"
        metadata = read_adapter_metadata(path)
        fit = metadata["threshold_fit"]
        assert fit["source"] == "teacher_forced" and fit["problems"] == 2 and fit["accuracy"] is None
        assert fit["tokens"] == sum(map(len, sequences)) and fit["target_cr"] == ratio
        assert fit["threshold"] == metadata["dms_config"]["threshold"]
        assert measure_teacher_forced(model, path, fit["threshold"], sequences) == pytest.approx(fit["realized_cr"])
    capsys.readouterr()
    assert retrofit_cli("--config", config, "--model", model_dir, "--problems", problems, "--output", out,
                        "--thresholds-only") == 0
    assert '"source": "teacher_forced"' in capsys.readouterr().out


def test_calibration_batches_of_a_problem_file_see_every_length():
    examples = tuple((tuple(range(1, length + 1)), 1) for length in range(2, 42))  # lengths 2..41, shortest first
    text = ProblemText(examples, 0, 6000, 0)
    batches = text.spread_batches(3)
    lengths = [batch.lengths.tolist() for batch in batches]
    assert [len(row) for row in lengths] == [4, 4, 4] and lengths[0][0] == 2 and lengths[-1][-1] == 41
    flat = [n for row in lengths for n in row]
    assert flat == sorted(set(flat)) and max(b - a for a, b in zip(flat, flat[1:])) <= 4  # spread evenly, none twice
    assert sorted(n for batch in text.spread_batches(100) for n in batch.lengths.tolist()) == list(range(2, 42))


def test_problem_batches_score_the_completion_tokens_only(tmp_path, model_dir, problems):
    from training.completions import sample_completions

    completions = sample_completions(model_dir, problems, tmp_path, samples=1, max_new_tokens=12, quiet=True)
    text = training_text(RetrofitConfig(problems=str(problems), tokens_per_batch=10), load_model(model_dir)[1],
                         completions)
    assert sorted(text.lengths()) == sorted(len(c.prompt_ids) + len(c.completion_ids) for c in completions)
    by_ids = {tuple(c.prompt_ids + c.completion_ids): c for c in completions}
    for offset in range(6):
        batch = text.batch(offset)
        assert torch.equal(batch.input_ids, text.batch(offset).input_ids)  # a seed's batch is always the same
        assert len(batch.input_ids) == 1  # each example is longer than 10 tokens: one a batch
        row = by_ids[tuple(batch.input_ids[0, : batch.lengths[0]].tolist())]
        labelled = (batch.labels[0] != IGNORE).nonzero().flatten().tolist()
        assert labelled == list(range(len(row.prompt_ids), len(row.prompt_ids) + len(row.completion_ids)))
    wide = ProblemText(text.examples, 0, 10_000, 0).batch(0)  # every example once, however many tokens are asked
    assert len(wide.input_ids) == len(completions)


def test_role_labels_need_the_chain_task(tmp_path, model_dir, problems, capsys):
    err = refused(capsys, "--config", "configs/retrofit_chain.yaml", "--model", model_dir, "--problems", problems,
                  "--output", tmp_path / "out")
    assert "warmstart_labels" in err and "cot_roles" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_role_labels_take_a_chain_models_own_completions(tmp_path):
    """A chain model's completions of chain prompts are chain text: the chain roles label them (the bound a
    task-agnostic long-lived set is measured against); another family's rows are refused, as above."""
    from training.retrofit import RetrofitConfig

    prompts = tmp_path / "chain.jsonl"
    prompts.write_text(json.dumps({"id": "c0", "prompt": "a=7;b=42;c=a+b;?c"}) + "\n")
    config = RetrofitConfig(model="checkpoints/chain-qwen3-base", problems=str(prompts), warmstart_labels="cot_roles")
    assert config.warmstart_labels == "cot_roles"
    with pytest.raises(ValueError, match="cot_roles.*'math'"):
        RetrofitConfig(model="checkpoints/chain-qwen3-base", problems=str(prompts), task="math",
                       warmstart_labels="cot_roles")


def test_effect_roles_plan_a_long_lived_set_on_a_problem_files_completions_and_keep_it_across_a_resume(
        tmp_path, model_dir, problems):
    """The role labels without the chain task: the long-lived kinds are found on the model's own completions, the
    labels keep them whole in some (layer, head) pairs, and a stopped run resumes with the same plan."""
    from training.retrofit import restore_role_labels

    out = tmp_path / "out"
    roles_recipe = recipe(tmp_path, warmstart_labels="effect_roles", effect_kinds=4, effect_batches=2, effect_mass=0.5,
                          gate_supervision=0.5, hold_steps=2, full_finetune=True)
    config = RetrofitConfig(**yaml.safe_load(roles_recipe.read_text()), model=str(model_dir), problems=str(problems),
                            output=str(out))
    assert retrofit(config, steps=2, quiet=True) == []  # stopped: 2 of the 3 steps
    state = torch.load(next(out.glob("retrofit_state-*.pt")), weights_only=False)
    planned = restore_role_labels(state["roles"])
    assert planned.kinds is not None and planned.kinds.long_lived.any() and not planned.kinds.long_lived.all()
    assert len(planned.kinds.centroids) == 4 and planned.kinds.layer == 1  # the middle of the model's 2 layers
    written = retrofit(config, quiet=True)  # resumed: the state's plan, not a new one
    assert [p.name for p in written] == ["dms-2x.safetensors", "dms-4x.safetensors"]
    resumed = restore_role_labels(torch.load(next(out.glob("retrofit_state-*.pt")), weights_only=False)["roles"])
    assert torch.equal(resumed.kinds.centroids, planned.kinds.centroids) and resumed.thresholds == planned.thresholds
    assert all(read_adapter_metadata(path)["long_lived_pairs"] >= 1 for path in written)


def test_bad_problem_files_and_options_are_named(tmp_path, model_dir, problems, capsys):
    duplicate = tmp_path / "dup.jsonl"
    duplicate.write_text(problems.read_text() + json.dumps({"id": "p0", "prompt": "again"}) + "\n")
    assert "argument --problems:" in refused(capsys, "--config", recipe(tmp_path), "--model", model_dir,
                                             "--problems", duplicate)
    assert "argument --problems: problem file not found" in refused(capsys, "--model", model_dir, "--problems",
                                                                     tmp_path / "missing.jsonl")
    err = refused(capsys, "--config", recipe(tmp_path), "--model", model_dir, "--task", "math")
    assert "argument --task: names the family of a problem file's rows" in err
    with pytest.raises(ValidationError, match="threshold_problems"):  # NVIDIA's gates have no threshold to fit
        RetrofitConfig(problems="x.jsonl", threshold_problems=8, parametrization="nvidia_separate", layout="nvidia")
    with pytest.raises(ValidationError, match="task"):
        RetrofitConfig(problems="x.jsonl", task="poetry")


# -- NVIDIA's separate gates and layout -----------------------------------------------------------------------------
def test_layout_nvidia_needs_nvidias_separate_gates(tmp_path, model_dir, problems, capsys):
    err = refused(capsys, "--config", recipe(tmp_path), "--model", model_dir, "--problems", problems,
                  "--layout", "nvidia")
    assert "argument --layout:" in err and "parametrization nvidia_separate" in err
    err = refused(capsys, "--config", recipe(tmp_path, window=4, nvidia_block_size=4), "--model", model_dir,
                  "--problems", problems, "--parametrization", "nvidia_separate")
    assert "nvidia_block_size: 4 must be smaller than the window (4)" in err
    with pytest.raises(ValidationError, match="window: NVIDIA's layout needs a window larger than its paged block"):
        RetrofitConfig(parametrization="nvidia_separate", window=1)


def decisions(model, handle, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        model(input_ids=ids, past_key_values=handle.new_cache(), use_cache=True)
    found = [module.dms.logits > 0 for module in handle.modules]
    handle.detach()
    return found


def test_nvidia_separate_gates_export_per_ratio_and_reload_with_the_trained_decisions(tmp_path, model_dir, problems):
    out = tmp_path / "out"
    assert retrofit_cli("--config", recipe(tmp_path), "--model", model_dir, "--problems", problems, "--output", out,
                        "--parametrization", "nvidia_separate", "--layout", "nvidia") == 0
    row = read_cache(out / CACHE_NAME)[0]
    ids = torch.tensor([row.prompt_ids + row.completion_ids])  # a real text, prompt and completion
    for ratio in (2, 4):
        exported = out / f"nvidia-{ratio}x"
        config = json.loads((exported / "config.json").read_text())
        assert config["dms_cr"] == ratio and config["dms_window_size"] == 8 and config["dms_separate_alpha"] is True
        assert config["dms_paged_attention_block_size"] == 4 and config["dms_alpha_per"] == "head"
        assert (exported / "tokenizer.json").is_file() and (exported / "generation_config.json").is_file()
        assert json.loads((exported / "generation_config.json").read_text())["top_k"] == GENERATION["top_k"]
        # The trained gates (the run's own adapter file) on the base model, and the export as NVIDIA's code reads it.
        base, _ = load_model(model_dir)
        gates, dms = load_gates(base, out / f"dms-{ratio}x.safetensors")
        assert dms.parametrization == "nvidia_separate" and all(isinstance(g, SeparateGate) for g in gates)
        trained = decisions(base, attach_dms(base, gates, dms), ids)
        served, _ = load_model(exported)
        layout = load_nvidia_layout(served, exported)
        assert layout.ratio == ratio and layout.config.initial_alpha_offset == pytest.approx(-dms.init_offset)
        reloaded = decisions(served, layout.attach(served), ids)
        assert all(torch.equal(a, b) for a, b in zip(trained, reloaded))
        assert any(d.any() for d in trained) and not all(d.all() for d in trained)  # the gates decide both ways


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_training_gives_separate_gates_the_layer_input_nvidias_code_reads(tmp_path, kind):
    """Each batch row gets its ratio's gate, computed from the layer's input before its norm, as NVIDIA's formula."""
    model, _ = load_model(write_model_dir(tmp_path / kind, kind))
    dms = NvidiaDMSConfig(window_size=8, block_size=4, cr=2.0, separate_alpha=True)
    per_ratio = [build_gates(model, dms) for _ in range(2)]
    torch.manual_seed(1)
    for gates in per_ratio:
        for gate in gates:
            gate.weight.data.normal_(0, 0.05)
            gate.norm_weight.data.uniform_(0.5, 1.5)
    row_gates = torch.nn.ModuleList(RowGates([gates[layer] for gates in per_ratio]) for layer in range(2))
    handle = attach_dms(model, row_gates, dms.dms_config)
    inputs: list = [None, None]
    hooks = [layer.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0].detach().clone()))
             for i, layer in enumerate(model.model.layers)]
    for gates in row_gates:
        gates.row_ratio = torch.tensor([0, 1, 1])
    with handle.mode("probe"), torch.no_grad():
        model(input_ids=torch.randint(5, 200, (3, 10)), use_cache=False)
        logits = [module.dms.logits.detach() for module in handle.modules]
    for hook in hooks:
        hook.remove()
    handle.detach()
    for layer in range(2):
        for row, ratio in enumerate([0, 1, 1]):
            gate = per_ratio[ratio][layer]
            tensors = {"self_attn.dms_proj_alpha.weight": gate.weight.detach(),
                       "self_attn.dms_proj_alpha_norm.weight": gate.norm_weight.detach()}
            expected = gate_logits(tensors, inputs[layer][row : row + 1], dms, model.config)
            assert torch.allclose(logits[layer][row : row + 1], expected, atol=1e-4)


# -- the chain source ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chain_tokenizer():
    return build_tokenizer()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), offset=st.integers(-10**6, 10**6), k=st.tuples(st.integers(1, 8), st.integers(0, 4)),
       tokens=st.integers(1, 600), any_order=st.booleans())
def test_the_chain_source_draws_the_batches_it_always_drew(chain_tokenizer, seed, offset, k, tokens, any_order):
    """What the shipped recipe trained on: the difficulty batch of seed ``seed * 1_000_003 + offset``."""
    k_min, k_max = k[0], k[0] + k[1]
    config = RetrofitConfig(seed=seed, k_min=k_min, k_max=k_max, tokens_per_batch=tokens, any_order=any_order)
    expected = difficulty_batch(chain_tokenizer, random.Random(seed * 1_000_003 + offset), k_min, k_max, tokens,
                                any_order, writes_reversed_minus_lines(chain_tokenizer))
    text = training_text(config, chain_tokenizer)
    assert isinstance(text, ChainText)
    for batch in (text.batch(offset), chain_batch(config, chain_tokenizer, offset)):
        assert torch.equal(batch.input_ids, expected.input_ids) and torch.equal(batch.labels, expected.labels)
        assert torch.equal(batch.lengths, expected.lengths) and batch.k == expected.k


def test_the_chain_source_averages_ratios_over_the_lengths_it_always_did(chain_tokenizer):
    config = RetrofitConfig(k_min=2, k_max=5)
    assert training_text(config, chain_tokenizer).lengths() == sample_lengths(chain_tokenizer, 2, 5)
