"""Task families (tasks/families.py): input formatting, stop rules, extraction and comparison on planted outputs."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dms_runtime.loading import SHIPPED_MODEL
from policies.extraction import extract_boxed, math_answer_key, math_answers_match, normalize_math_answer
from policies.voting import majority_vote, verified_vote
from tasks.families import FAMILIES, MATH_INSTRUCTION, MathFamily, default_family, get_family
from tasks.prompt import format_prompt

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen3's switch, in miniature: thinking off writes an empty think block after the assistant header.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tiny_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on a few sentences, with Qwen-style special tokens."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["What is 1/2 + 1/4? Please reason step by step.", "The answer is \\boxed{3/4}.", "x = 5, so y = 10."] * 20
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


# -- math: extraction and comparison ------------------------------------------------------------------------
def test_boxed_extraction_takes_the_last_complete_box_with_nested_braces():
    assert extract_boxed(r"so the answer is \boxed{\frac{\sqrt{3}}{2}}.") == r"\frac{\sqrt{3}}{2}"
    assert extract_boxed(r"first \boxed{1}, then \boxed{2}, finally \boxed{ 3 }") == "3"
    assert extract_boxed("no box here, 42") is None
    assert extract_boxed(r"\boxed{}") is None
    assert extract_boxed(r"\boxed{7} and then a cut-off \boxed{\frac{1}{") == "7"
    assert extract_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert extract_boxed(r"$\boxed 5$") == "5"
    math = get_family("math")
    assert math.extract(r"<think>maybe \boxed{2}?</think> The answer is $\boxed{1/2}$.") == "1/2"
    assert math.extract("I think it is 0.5") is None  # no box: no answer (the math family guesses no number)


@pytest.mark.parametrize("a, b", [
    (r"1/2", "0.5"), (r"\frac{1}{2}", "1/2"), (r"\dfrac12", "0.5"), (r"\tfrac{1}{2}", ".5"), (r"-\frac12", "-0.5"),
    (r"\left( 1, 2 \right)", "(1,2)"), (r"3\!000", "3000"), ("1,000", "1000"), ("12,345,678", "12345678"),
    ("5.", "5"), ("$5$", "5"), (r"\$5", "5"), (r"5\text{ cm}", "5"), (r"10 \text{ meters}", "10"), (r"90^\circ", "90"),
    (r"\frac{\sqrt3}{2}", r"\dfrac{\sqrt{3}}{2}"), ("x = 3", "3"), ("0.50", r"\frac{2}{4}"), (r"\text{(B)}", "(B)"),
])
def test_equal_math_answers_match(a, b):
    assert math_answers_match(a, b) and get_family("math").same(a, b)
    assert math_answer_key(a) == math_answer_key(b)


@pytest.mark.parametrize("a, b", [("0.333", "1/3"), ("(1,2)", "[1,2]"), ("12", "1,2"), (r"\rightarrow", "arrow"),
                                  ("2", "-2")])
def test_different_math_answers_do_not_match(a, b):
    assert not math_answers_match(a, b)
    assert not math_answers_match(None, a) and not get_family("math").same(a, None)


def test_normalisation_keeps_tuples_and_strips_latex_dressing():
    assert normalize_math_answer(r"\left(1, 2\right)") == "(1,2)"
    assert normalize_math_answer(r"\displaystyle \dfrac{a}{b}.") == r"\frac{a}{b}"


def test_votes_group_equal_answers_and_the_verifier_picks_best_of_n():
    math = get_family("math")
    vote = majority_vote(["0.5", "3", r"\frac{1}{2}", "3", "1/2"], key=math.key)
    assert vote.answer == "0.5" and vote.counts == {"0.5": 3, "3": 2}
    assert majority_vote(["0.5", "3", r"\frac{1}{2}", "3"]).answer == "3"  # without the key they are three answers
    calls = []

    def verifier(problem: str, answer: str) -> bool:
        calls.append(answer)
        return problem == "2+1" and math.same(answer, "3")

    family = get_family("math", verifier=verifier)
    assert family.verifier is verifier and isinstance(family, MathFamily)
    best = verified_vote("2+1", ["0.5", "3", r"\frac{1}{2}", "3.0", None], family.verifier, key=family.key)
    assert best.answer == "3" and sorted(calls) == ["0.5", "3"]  # one call per distinct answer
    assert verified_vote("p", ["1", "2", "2"], lambda p, a: 0.0).answer == "2"  # equal scores: the majority
    with pytest.raises(ValueError, match="verifier"):
        get_family("math", verifier="not callable")  # type: ignore[arg-type]


# -- regex ------------------------------------------------------------------------------------------------
def test_regex_family_takes_the_last_match_and_its_first_group():
    family = get_family("regex", answer_pattern=r"Answer:\s*(\w+)")
    assert family.extract("Answer: cat ... no wait. Answer: dog") == "dog"
    assert family.extract("nothing") is None
    assert family.same("dog", " dog ") and not family.same("dog", "Dog")
    whole = get_family("regex", answer_pattern=r"\d+")
    assert whole.extract("between 3 and 17 apples") == "17"
    loose = dataclass_replace(family, ignore_case=True)
    assert loose.same("Dog", "dog") and loose.extract("answer: Cat") == "Cat"
    with pytest.raises(ValueError, match="answer_pattern"):
        get_family("regex")
    with pytest.raises(ValueError, match="answer_pattern: not a regular expression"):
        get_family("regex", answer_pattern="(unclosed")
    with pytest.raises(ValueError, match="answer_pattern"):
        get_family("math", answer_pattern=r"\d+")


def dataclass_replace(family, **changes):
    import dataclasses
    return dataclasses.replace(family, **changes)


# -- registry, validation, defaults -------------------------------------------------------------------------
def test_unknown_task_is_a_clear_error_listing_the_known_families():
    with pytest.raises(ValueError, match=r"task: unknown task family 'poetry'; known: chain, math, regex"):
        get_family("poetry")
    assert set(FAMILIES) == {"chain", "math", "regex"}


def test_prompts_are_validated_with_errors_naming_the_prompt():
    with pytest.raises(ValueError, match=r"^prompt: .*';\?"):
        get_family("chain").validate("a=1;b=2;c=a+b")
    assert get_family("chain").validate("a=1;b=2;c=a+b;?c") == "a=1;b=2;c=a+b;?c"
    math = get_family("math")
    assert math.validate("What is 1/2 + 1/4?") == "What is 1/2 + 1/4?"
    for bad, message in [("", "must not be empty"), ("x" * 20_001, "over the limit of 20000"), (7, "must be a string")]:
        with pytest.raises(ValueError, match=f"^prompt: .*{message}"):
            math.validate(bad)


def test_default_family_of_a_model_directory(tmp_path):
    assert default_family(SHIPPED_MODEL) == "chain"  # nothing declared, the chain tokenizer
    tiny_tokenizer().save_pretrained(tmp_path)
    assert default_family(tmp_path) == "math"  # nothing declared, a natural-language tokenizer
    (tmp_path / "thinkpool.json").write_text(json.dumps({"task": "regex"}))
    assert default_family(tmp_path) == "regex"
    (tmp_path / "thinkpool.json").write_text(json.dumps({"task": "haiku"}))
    with pytest.raises(ValueError, match="task: .*unknown task family 'haiku'"):
        default_family(tmp_path)
    (tmp_path / "thinkpool.json").write_text("{not json")
    with pytest.raises(ValueError, match="thinkpool.json: not valid JSON"):
        default_family(tmp_path)


# -- input formatting -----------------------------------------------------------------------------------------
def test_math_input_goes_through_the_chat_template_with_enable_thinking():
    tokenizer = tiny_tokenizer()
    problem = "What is 1/2 + 1/4?"
    user = f"<|im_start|>user\n{problem}\n\n{MATH_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    assert get_family("math").format_input(problem, tokenizer) == user
    assert get_family("math", thinking=False).format_input(problem, tokenizer) == user + "<think>\n\n</think>\n\n"
    assert get_family("math").format_input(problem, tokenizer) == tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{problem}\n\n{MATH_INSTRUCTION}"}], add_generation_prompt=True, tokenize=False,
        enable_thinking=True)
    ids = get_family("math").encode(problem, tokenizer)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and tokenizer.decode(ids) == user
    regex = get_family("regex", answer_pattern=r"\d+")
    expected = "<|im_start|>user\nHow many?<|im_end|>\n<|im_start|>assistant\n"
    assert regex.format_input("How many?", tokenizer) == expected


def test_without_a_chat_template_the_raw_template_is_used():
    plain = tiny_tokenizer(chat_template=None)
    assert get_family("math").format_input("1+1?", plain) == f"1+1?\n\n{MATH_INSTRUCTION}\n"
    assert get_family("math").format_input("1+1?") == f"1+1?\n\n{MATH_INSTRUCTION}\n"
    raw = dataclass_replace(get_family("math"), raw_template="Problem: {problem}\nSolution:", instruction="")
    assert raw.format_input("1+1?", plain) == "Problem: 1+1?\nSolution:"


def test_chain_input_is_exactly_format_prompt_and_its_tokens_unchanged():
    chain = get_family("chain")
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL, local_files_only=True)
    problem = "a=7;b=42;c=a+b;d=c*a;?d"
    assert chain.format_input(problem) == format_prompt(problem) == chain.format_input(problem, tokenizer)
    assert chain.encode(problem, tokenizer) == tokenizer(format_prompt(problem))["input_ids"]
    assert chain.extract("c=49\n#07") == "7" and chain.same("07", "7") and not chain.same("70", "7")


def test_chain_stop_rule_is_the_workers_rule_over_text():
    from workers.thread import SamplingParams, StopRule, Thread

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL, local_files_only=True)
    rule = StopRule.for_tokenizer(tokenizer)
    chain = get_family("chain")
    for text in ["c=4#9\n", "ab#12;x", "#\n", "no marker\n", "a#1", "#7#8 "]:
        thread = Thread("p", 0, [1], SamplingParams(max_new_tokens=100))
        stopped_at = next((i for i, t in enumerate(tokenizer(text, add_special_tokens=False)["input_ids"])
                           if thread.append(t, 0.0, rule)), None)
        by_text = next((i for i in range(len(text)) if chain.should_stop(text[: i + 1])), None)
        assert stopped_at == by_text, text
    assert not get_family("math").should_stop("the answer is #1 and then more")  # the # rule is the chain's alone
    assert dataclass_replace(get_family("math"), stop_strings=("</answer>",)).should_stop("x</answer>")
