"""``thinkpool eval`` across KV methods (vanilla, DMS adapters, training-free presses) on a tiny model."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dms_runtime.adapters import save_adapter
from dms_runtime.config import DMSConfig
from dms_runtime.gates import build_gates
from evaluation.scoring import realized_cr_by_length
from tasks.chain_tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Qwen3 with the chain tokenizer and a 2x adapter whose gates evict about half the tokens."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    dms = DMSConfig(window=4, init_offset=0.0)
    gates = build_gates(model, dms)
    for gate in gates:
        gate.weight.data.normal_(0, 0.003)
    save_adapter(path / "dms-2x.safetensors", gates, dms, model, 2.0)
    return path


def run(*args):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True, timeout=600)


def test_eval_compares_vanilla_dms_and_a_press(tiny_dir, easy_file, tmp_path):
    plot = tmp_path / "pareto.png"
    done = run("eval", "--model", str(tiny_dir), "--problems", str(easy_file), "--limit", "4", "--max-new-tokens", "60",
               "--cr", "1", "2", "--press", "window", "--compression", "4", "--json", "--plot", str(plot), "--workers", "0")
    assert done.returncode == 0, done.stderr
    runs = {r["method"]: r for r in json.loads(done.stdout)["runs"]}
    assert set(runs) == {"vanilla", "dms-2x", "window-4x"}
    assert runs["vanilla"]["realized_cr"] == pytest.approx(1.0, abs=0.15)
    assert runs["dms-2x"]["realized_cr"] > 1.3
    assert 3.0 < runs["window-4x"]["realized_cr"] <= 4.5
    assert runs["dms-2x"]["kv_peak_bytes"] < runs["vanilla"]["kv_peak_bytes"]
    bands = runs["dms-2x"]["realized_cr_by_length"]  # every thread in one band, the bands averaging to the whole
    assert sum(b["threads"] for b in bands.values()) == 4
    assert sum(b["threads"] * b["realized_cr"] for b in bands.values()) / 4 == pytest.approx(runs["dms-2x"]["realized_cr"], abs=0.01)
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_missing_adapter_and_unknown_press_are_refused_before_work(tiny_dir, easy_file):
    done = run("eval", "--model", str(tiny_dir), "--problems", str(easy_file), "--cr", "8")
    assert done.returncode == 2 and "argument --cr: no DMS adapter for 8x" in done.stderr
    done = run("eval", "--model", str(tiny_dir), "--problems", str(easy_file), "--press", "lru", "--compression", "4")
    assert done.returncode == 2 and "argument --press: unknown press 'lru'" in done.stderr


def test_realized_ratio_is_reported_per_length_band_in_order():
    threads = [{"tokens": 40, "realized_cr": 1.5}, {"tokens": 900, "realized_cr": 9.0}, {"tokens": 127, "realized_cr": 2.5},
               {"tokens": 2000, "realized_cr": 12.0}, {"tokens": 128, "realized_cr": 3.0}]
    bands = realized_cr_by_length([{"threads": threads[:2]}, {"threads": threads[2:]}])
    assert list(bands) == ["0-127", "128-255", "512-1023", "1024+"]
    assert bands["0-127"] == {"threads": 2, "realized_cr": 2.0} and bands["1024+"]["realized_cr"] == 12.0
    assert realized_cr_by_length([{"threads": [{"answer": "1", "tokens": 50}]}]) == {}  # records from before the field
