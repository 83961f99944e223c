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
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_missing_adapter_and_unknown_press_are_refused_before_work(tiny_dir, easy_file):
    done = run("eval", "--model", str(tiny_dir), "--problems", str(easy_file), "--cr", "8")
    assert done.returncode == 2 and "argument --cr: no DMS adapter for 8x" in done.stderr
    done = run("eval", "--model", str(tiny_dir), "--problems", str(easy_file), "--press", "lru", "--compression", "4")
    assert done.returncode == 2 and "argument --press: unknown press 'lru'" in done.stderr
