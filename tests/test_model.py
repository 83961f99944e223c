"""The shipped model: offline load through the plain transformers Auto classes, and real solving."""

import random

from transformers import AutoModelForCausalLM, AutoTokenizer

from dms_runtime.loading import SHIPPED_MODEL, kv_geometry
from tasks.chain import generate_problem, generate_suite
from tasks.cot import REVERSED_MINUS, is_valid_cot, writes_reversed_minus
from tasks.prompt import format_prompt
from evaluation.reference_decode import SamplingParams, generate_threads


def test_auto_classes_load_the_shipped_model_offline():
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, local_files_only=True)
    config = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    assert tokenizer.decode(tokenizer("a=1;b=2;c=a+b;?c")["input_ids"], skip_special_tokens=True) == "a=1;b=2;c=a+b;?c"


def test_kv_geometry_counts_k_and_v_of_every_layer_and_head(shipped):
    model, _ = shipped
    geometry = kv_geometry(model)
    c = model.config
    assert geometry.kv_bytes_per_token == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4


def test_greedy_solves_easy_problems(shipped):
    model, tokenizer = shipped
    records = generate_suite(16, 1, 4, seed=2024)
    result = generate_threads(
        model, tokenizer, [format_prompt(r["prompt"]) for r in records], 1, SamplingParams(max_new_tokens=400), progress=False
    )
    correct = sum(t.answer == r["answer"] for t, r in zip(result.threads, records))
    assert correct >= 14, [t.text for t in result.threads]


def test_greedy_output_is_the_trained_chain_of_thought(shipped):
    model, tokenizer = shipped
    problem = generate_problem(random.Random(99), 4)
    result = generate_threads(
        model, tokenizer, [format_prompt(problem.text)], 1, SamplingParams(max_new_tokens=400), progress=False
    )
    assert is_valid_cot(result.threads[0].text, problem)  # any operand order of + and *


def test_loop_matches_transformers_generate_greedy(shipped):
    model, tokenizer = shipped
    prompts = [format_prompt(r["prompt"]) for r in generate_suite(3, 2, 6, seed=77)]
    ours = generate_threads(model, tokenizer, prompts, 1, SamplingParams(max_new_tokens=60), progress=False)
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    reference = model.generate(**encoded, max_new_tokens=60, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    for thread, row in zip(ours.threads, reference[:, encoded["input_ids"].shape[1] :]):
        row = row[row != tokenizer.pad_token_id]
        assert thread.text == tokenizer.decode(row, skip_special_tokens=True)


def test_sampled_threads_are_reproducible_whatever_the_batch(shipped):
    model, tokenizer = shipped
    prompts = [format_prompt(r["prompt"]) for r in generate_suite(2, 6, 7, seed=5)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=80, seed=3)
    together = generate_threads(model, tokenizer, prompts, 3, sampling, batch_size=6, progress=False)
    apart = generate_threads(model, tokenizer, prompts, 3, sampling, batch_size=1, progress=False)
    assert [t.text for t in together.threads] == [t.text for t in apart.threads]
    assert len({t.text for t in together.threads}) > 1


def test_the_shipped_model_samples_several_valid_chains_of_thought(shipped):
    model, tokenizer = shipped
    problem = generate_problem(random.Random(5), 6)
    result = generate_threads(model, tokenizer, [format_prompt(problem.text)], 8,
                              SamplingParams(temperature=0.5, max_new_tokens=600, seed=3), progress=False)
    texts = {t.text for t in result.threads}
    assert sum(t.answer == problem.answer for t in result.threads) >= 6
    assert sum(is_valid_cot(text, problem) for text in texts) >= 2  # at least two different valid paths


def test_the_shipped_model_reads_a_subtraction_either_way():
    """The shipped model (configs/train_reversed_minus.yaml): its config records the extra form, its tokenizer holds
    ``~`` (one row more than the stage-1 model it was fine-tuned from, which has one form), and its sampled threads
    take both forms of a ``-`` line, validly."""
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, local_files_only=True)
    stage1_dir = SHIPPED_MODEL.parent / "chain-qwen3-onepath"
    stage1 = AutoModelForCausalLM.from_pretrained(stage1_dir, local_files_only=True)
    assert writes_reversed_minus(model) and not writes_reversed_minus(stage1)
    assert tokenizer.convert_tokens_to_ids(REVERSED_MINUS) == len(tokenizer) - 1
    stage1_tokenizer = AutoTokenizer.from_pretrained(stage1_dir, local_files_only=True)
    assert REVERSED_MINUS not in stage1_tokenizer.get_vocab() and len(stage1_tokenizer) == len(tokenizer) - 1
    rng = random.Random(11)
    problem = next(p for p in (generate_problem(rng, 6) for _ in range(100))
                   if any(a.op == "-" and a.y != a.z for a in p.assignments))
    result = generate_threads(model, tokenizer, [format_prompt(problem.text)], 8,
                              SamplingParams(temperature=1.0, max_new_tokens=600, seed=3), progress=False)
    reversed_threads = [t.text for t in result.threads if REVERSED_MINUS in t.text]
    assert 0 < len(reversed_threads) < 8 and any(is_valid_cot(text, problem) for text in reversed_threads)
