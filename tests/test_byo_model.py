"""Bring your own model: tiny Qwen3 and Llama directories as people have them (chat template, BPE tokenizer,
generation_config.json, bf16 or sharded weights) and a tiny NVIDIA-layout directory, through REST, the SDK, batch
and the CLI; the task families' stop rules, sampling defaults and the errors a bad directory or request gets."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from byo_models import ANSWERS, CONTEXT, GENERATION, bpe_tokenizer, nvidia_config, write_model_dir
from cli_runner import cli
from orchestrator.api import create_app
from orchestrator.jobs import MemoryJobStore
from orchestrator.service import service_factory
from http_server import serving
from tasks.families import get_family

REPO = Path(__file__).resolve().parent.parent
HALF = "What is 1/2 + 1/4?"
FOUR = "What is 2 + 2?"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("qwen3") / "model", "qwen3", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("llama") / "model", "llama", dtype=torch.float16, shards=True)


@pytest.fixture(scope="module")
def nvidia_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("nvidia") / "model", "qwen3", nvidia=nvidia_config())


def serve(model_dir: Path):
    """``thinkpool serve --model DIR`` in miniature: the app over real HTTP on a loopback port."""
    return serving(create_app(service_factory(model_dir, 4_000_000, 0), store=MemoryJobStore()))


@pytest.fixture(scope="module")
def qwen_server(qwen_dir):
    with serve(qwen_dir) as url:
        yield url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


# -- REST -------------------------------------------------------------------------------------------------------
def test_a_math_prompt_is_answered_through_rest_and_stops_at_an_eos_of_generation_config(qwen_server):
    response = post(qwen_server, "/v1/solve", {"prompt": HALF, "samples": 1, "max_tokens": 60})
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["task"] == "math" and result["answer"] == r"\frac{3}{4}"
    thread = result["threads"][0]
    # <|im_end|> is not the tokenizer's EOS: only generation_config.json says it ends a thread. "#1" did not stop it.
    assert thread["finish_reason"] == "eos" and thread["tokens"] < 60 and "Step #1: a half" in thread["text"]
    assert result["prompt_tokens"] == len(get_family("math").encode(HALF, bpe_tokenizer()))
    sampled = post(qwen_server, "/v1/solve", {"prompt": FOUR, "samples": 3, "max_tokens": 60, "task": "math"}).json()
    assert sampled["answer"] == "4" and sampled["samples"] == 3  # at the model's temperature 0.6, top_k 20
    regex = post(qwen_server, "/v1/solve", {"prompt": FOUR, "samples": 1, "max_tokens": 60, "task": "regex",
                                            "answer_pattern": r"it is \\boxed\{(\d+)\}"}).json()
    assert regex["task"] == "regex" and regex["answer"] == "4"


def test_openai_completions_return_the_generated_text(qwen_server):
    response = post(qwen_server, "/v1/completions", {"prompt": FOUR, "n": 1, "max_tokens": 60}).json()
    text = response["choices"][0]["text"]
    assert text == ANSWERS[FOUR].replace("<think>", "").replace("</think>", "")  # special tokens are skipped
    assert response["choices"][0]["finish_reason"] == "stop"
    usage = response["usage"]
    assert usage["prompt_tokens"] == len(get_family("math").encode(FOUR, bpe_tokenizer())) > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    models = httpx.get(f"{qwen_server}/v1/models").json()
    assert models["data"][0]["task"] == "math"


@pytest.mark.parametrize("body, field, message", [
    ({"prompt": HALF, "task": "poetry"}, "task", "unknown task family 'poetry'; known: chain, math, regex"),
    ({"prompt": HALF, "task": "regex"}, "answer_pattern", "needs a pattern"),
    ({"prompt": HALF, "answer_pattern": "("}, "answer_pattern", "not a regular expression"),
    ({"prompt": HALF, "task": "math", "answer_pattern": r"\d"}, "answer_pattern", "only the regex task"),
    ({"prompt": "a=1;b=2;c=a+x;?c", "task": "chain"}, "prompt", "unknown variable 'x'"),
    ({"prompt": HALF, "samples": 1, "max_tokens": 250}, "max_tokens",
     f"exceed the model's context of {CONTEXT} tokens (max_position_embeddings)"),
    ({"prompt": "zq " * 200, "samples": 1, "max_tokens": 10}, "prompt", f"the model's context is {CONTEXT} tokens"),
    ({"prompt": HALF, "mode": "controller"}, "mode", "needs a calibration profile for the math task"),
    ({"prompt": "x" * 20_001}, "prompt", "at most 20000 characters"),
])
def test_bad_requests_get_422_naming_the_field(qwen_server, body, field, message):
    response = post(qwen_server, "/v1/solve", body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert field in detail["loc"] and message in detail["msg"], detail


# -- the SDK and batch --------------------------------------------------------------------------------------------
def test_the_sdk_solves_on_a_sharded_fp16_llama_and_takes_a_verifier(llama_dir):
    from orchestrator import LocalClient

    client = LocalClient(model=str(llama_dir), kv_budget=4_000_000)
    result = client.solve(HALF, samples=1, max_tokens=60)
    assert result.answer == r"\frac{3}{4}" and result.task == "math" and result.threads[0].finish_reason == "eos"
    assert get_family("math").same(result.answer, "0.75")
    seen = []

    def verifier(problem: str, answer: str) -> float:
        seen.append((problem, answer))
        return 1.0

    best = client.solve(FOUR, samples=2, max_tokens=40, verifier=verifier)
    assert best.answer == "4" and seen == [(FOUR, "4")]  # each distinct answer is scored once
    client.service.pool.shutdown()


def test_batch_rows_name_their_task_and_are_scored_by_it(qwen_dir, tmp_path):
    problems = tmp_path / "problems.jsonl"
    rows = [{"id": "half", "prompt": HALF, "answer": "0.75"},  # the model's family: math, 3/4 == 0.75
            {"id": "four", "prompt": FOUR, "answer": "4", "task": "regex", "answer_pattern": r"\\boxed\{(\d+)\}"},
            {"id": "four-again", "prompt": FOUR, "answer": "5"}]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = tmp_path / "results.jsonl"
    done = subprocess.run([sys.executable, "-m", "orchestrator.batch", "--workers", "0", "--model", str(qwen_dir),
                           "--input", str(problems), "--output", str(output), "--samples", "1"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    results = {r["id"]: r for r in map(json.loads, output.read_text().splitlines())}
    half = results["half"]
    assert half["correct"] and half["task"] == "math" and half["answer"] == r"\frac{3}{4}"
    assert results["four"]["correct"] and results["four"]["task"] == "regex"
    assert not results["four-again"]["correct"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "prompt": HALF, "task": "haiku"}) + "\n")
    refused = subprocess.run([sys.executable, "-m", "orchestrator.batch", "--workers", "0", "--model", str(qwen_dir),
                              "--input", str(bad), "--output", str(tmp_path / "x.jsonl")],
                             capture_output=True, text=True, timeout=300, cwd=REPO)
    assert refused.returncode == 2 and "bad.jsonl:1: field 'task': unknown task family 'haiku'" in refused.stderr


# -- NVIDIA's layout ----------------------------------------------------------------------------------------------
def test_an_nvidia_directory_is_served_as_it_is_at_its_dms_cr(nvidia_dir):
    with serve(nvidia_dir) as url:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["ratios"] == [1.0, 8.0]
        compressed = post(url, "/v1/solve", {"prompt": HALF, "samples": 1, "cr": 8, "max_tokens": 60})
        assert compressed.status_code == 200, compressed.text
        result = compressed.json()
        assert result["cr"] == 8 and result["realized_cr"] > 1 and result["threads"][0]["kv_cr"] > 1
        vanilla = post(url, "/v1/solve", {"prompt": HALF, "samples": 1, "cr": 1, "max_tokens": 60}).json()
        assert vanilla["realized_cr"] == 1 and vanilla["answer"] == r"\frac{3}{4}"  # eviction off: the plain model
        refused = post(url, "/v1/solve", {"prompt": HALF, "samples": 1, "cr": 4})
        assert refused.status_code == 422 and "no DMS adapter for 4x" in refused.json()["detail"][0]["msg"]


# -- the CLI ----------------------------------------------------------------------------------------------------
def test_info_reads_the_directory_without_its_weights(capsys, nvidia_dir, tmp_path):
    code, out, _ = cli(capsys, "info", "--model", str(nvidia_dir), "--json")
    info = json.loads(out)
    assert code == 0 and info["architecture"] == "Qwen3ForCausalLM" and info["layout"] == "nvidia"
    assert info["ratios"] == [1.0, 8.0] and info["windows"] == {"8": 16} and info["task"] == "math"
    assert info["chat_template"] and info["stored_dtype"] == "bfloat16" and info["max_position_embeddings"] == CONTEXT
    assert info["num_layers"] == 2 and info["num_kv_heads"] == 2 and info["head_dim"] == 16
    assert info["generation"] == GENERATION and len(info["eos_token_ids"]) == 2 and info["parameters"] > 0
    bare = tmp_path / "bare"  # no weights at all: info still reads what the directory is
    bare.mkdir()
    (bare / "config.json").write_text((nvidia_dir / "config.json").read_text())
    bpe_tokenizer().save_pretrained(bare)
    code, out, _ = cli(capsys, "info", "--model", str(bare), "--json")
    assert code == 0 and json.loads(out)["parameters"] is None and json.loads(out)["kv_bytes_per_token"] == 512


def test_bad_model_directories_get_a_clear_error(capsys, qwen_dir, tmp_path):
    untokenized = write_model_dir(tmp_path / "untokenized", tokenizer=False)
    with pytest.raises(ValueError, match="no tokenizer in .*untokenized: expected tokenizer.json"):
        service_factory(untokenized, None, 0)()
    code, _, err = cli(capsys, "solve", HALF, "--model", str(untokenized), "--workers", "0")
    assert code == 2 and "argument --model: no tokenizer in" in err
    narrow = tmp_path / "narrow"  # a window of 8 over NVIDIA's block of 8: their code refuses it, and so does serve
    write_model_dir(narrow, nvidia=nvidia_config(window_size=16))
    config = json.loads((narrow / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps(config | {"dms_window_size": 8}))
    code, _, err = cli(capsys, "serve", "--model", str(narrow))
    assert code == 2 and "dms_window_size: 8 must be larger than dms_paged_attention_block_size (8)" in err
    code, _, err = cli(capsys, "solve", HALF, "--model", str(qwen_dir), "--max-new-tokens", "250", "--workers", "0")
    assert code == 2 and "argument --max-new-tokens: the prompt's" in err and "context of 256 tokens" in err
    code, _, err = cli(capsys, "solve", HALF, "--model", str(qwen_dir), "--task", "chain", "--workers", "0")
    assert code == 2 and "argument prompt:" in err


def test_thinkpool_solve_answers_a_math_prompt(capsys, qwen_dir):
    code, out, err = cli(capsys, "solve", FOUR, "--model", str(qwen_dir), "--workers", "0", "--max-new-tokens", "60",
                         "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["answer"] == "4" and report["task"] == "math"


# -- the pieces: stop rules, sampling filters, dtypes, problem files -------------------------------------------
def test_only_the_chain_family_stops_at_its_marker_and_every_family_at_every_eos():
    from workers.thread import SamplingParams, StopRule, Thread

    tokenizer = bpe_tokenizer()
    im_end, endoftext = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    chain = StopRule.for_tokenizer(tokenizer, eos_ids=[im_end, endoftext])
    math = StopRule.for_tokenizer(tokenizer, get_family("math"), [im_end, endoftext])
    assert chain.marker == tokenizer.convert_tokens_to_ids("#")  # single-character digits: today's rule, chain only
    assert math.marker is None and math.is_eos(im_end) and math.is_eos(endoftext) and chain.is_eos(im_end)
    stopping = get_family("regex", answer_pattern="x", stop_strings=["</answer>"])
    rule = StopRule.for_tokenizer(tokenizer, stopping)
    thread = Thread("p", 0, [1], SamplingParams(max_new_tokens=100), family=stopping, stop=rule)
    ids = tokenizer("Step #1: x</answer> and more", add_special_tokens=False)["input_ids"]
    stopped = next(i for i, token in enumerate(ids) if thread.append(token, 0.0))
    assert thread.finish_reason == "stop" and tokenizer.decode(ids[: stopped + 1]).endswith("</answer>")
    chain_stopping = get_family("chain", stop_strings=[";c="])  # a caller's stop string ends a chain thread too
    assert chain_stopping.should_stop("a=1;b=2;c=") and not chain_stopping.should_stop("a=1;b=2")


def test_top_k_and_min_p_filter_and_leave_other_rows_drawing_as_before():
    from workers.sampler import sample_rows

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    warm = torch.ones(6)

    def streams():
        return [torch.Generator().manual_seed(i) for i in range(6)]

    before = sample_rows(logits, warm, torch.ones(6), streams())
    assert torch.equal(before, sample_rows(logits, warm, torch.ones(6), streams(), torch.zeros(6, dtype=torch.long),
                                           torch.zeros(6)))
    assert torch.equal(sample_rows(logits, warm, torch.ones(6), streams(), torch.ones(6, dtype=torch.long)),
                       logits.argmax(-1))
    assert torch.equal(sample_rows(logits, warm, torch.ones(6), streams(), None, torch.ones(6)), logits.argmax(-1))
    top2 = logits.topk(2, dim=-1).indices
    mixed_k = torch.tensor([2, 0, 2, 0, 2, 0])
    for seed in range(20):
        fresh = [torch.Generator().manual_seed(seed * 6 + i) for i in range(6)]
        drawn = sample_rows(logits, warm, torch.ones(6), fresh, mixed_k)
        assert all(drawn[row] in top2[row] for row in (0, 2, 4))


def test_weights_load_in_their_stored_dtype_on_a_gpu_and_fp32_on_the_cpu(tmp_path):
    from dms_runtime.loading import load_dtype

    for stored, on_gpu in [("float16", torch.float16), ("bfloat16", torch.bfloat16), ("float32", torch.bfloat16),
                           (None, torch.bfloat16)]:
        (tmp_path / "config.json").write_text(json.dumps({"dtype": stored} if stored else {}))
        assert load_dtype(tmp_path, "cuda") == on_gpu and load_dtype(tmp_path, "cpu") == torch.float32


def test_problem_file_rows_name_their_task(tmp_path):
    from tasks.jsonl import ProblemFileError, read_problems

    path = tmp_path / "mixed.jsonl"
    rows = [{"id": "c", "prompt": "a=1;b=2;c=a+b;?c", "answer": "3"},
            {"id": "m", "prompt": HALF, "answer": "0.75", "task": "math"},
            {"id": "r", "prompt": FOUR, "task": "regex", "answer_pattern": r"(\d+)"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    read = read_problems(path)
    assert [r["id"] for r in read] == ["c", "m", "r"] and read[0]["k"] >= 1 and "task" not in read[0]
    path.write_text(json.dumps({"id": "m", "prompt": HALF}) + "\n")
    assert read_problems(path, task="math")[0]["prompt"] == HALF  # free-text rows need no answer
    path.write_text(json.dumps({"id": "m", "prompt": HALF, "answer": "0.75"}) + "\n")
    with pytest.raises(ProblemFileError, match="mixed.jsonl:1: field 'prompt'"):
        read_problems(path)  # the chain task by default: HALF is no chain problem
    path.write_text(json.dumps({"id": "r", "prompt": FOUR, "task": "regex"}) + "\n")
    with pytest.raises(ProblemFileError, match="field 'answer_pattern': the regex task needs a pattern"):
        read_problems(path)


def test_the_served_fingerprint_changes_with_the_gates_alone(nvidia_dir, tmp_path):
    """Results are cached by the worker's fingerprint: gates retrained over the same weights must not be answered
    from the old gates' cache (transformers leaves an NVIDIA directory's gates out of the model it loads)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from workers.worker import ModelWorker, WorkerConfig

    changed = tmp_path / "model"
    shutil.copytree(nvidia_dir, changed)
    tensors = load_file(changed / "model.safetensors")
    name = "model.layers.1.self_attn.dms_proj_alpha.weight"
    tensors[name] = -tensors[name]
    save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    prints = []
    for path in (nvidia_dir, nvidia_dir, changed):
        worker = ModelWorker(WorkerConfig(model=str(path), kv_budget_bytes=100_000, device="cpu", torch_threads=1))
        prints.append(worker.fingerprint)
        worker.engine.close()
    assert prints[0] == prints[1] != prints[2]
