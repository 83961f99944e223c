import random

import pytest
from transformers import AutoTokenizer

from tasks.chain_tokenizer import build_tokenizer
from tasks.chain import generate_problem
from tasks.cot import render_cot
from tasks.prompt import format_prompt


@pytest.mark.parametrize("reversed_minus", [False, True])
def test_round_trip_is_one_token_per_character(tmp_path, reversed_minus):
    tokenizer = build_tokenizer(reversed_minus)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    problem = generate_problem(random.Random(3), 12)
    text = format_prompt(problem.text) + render_cot(problem, random.Random(4), reversed_minus)
    ids = loaded(text)["input_ids"]
    assert ids[0] == loaded.bos_token_id and len(ids) == len(text) + 1
    assert ("~" in text) == reversed_minus and len(loaded) == 51 + reversed_minus  # "~" only where it is written
    assert loaded.convert_tokens_to_ids("|") == 3
    assert loaded.decode(ids, skip_special_tokens=True) == text
