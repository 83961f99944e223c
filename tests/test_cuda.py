"""DMS on CUDA in bf16 (skipped without a GPU; run on a device machine: pytest tests/test_cuda.py)."""

import pytest
import torch

from dms_runtime.attach import attach_dms
from dms_runtime.config import DMSConfig
from dms_runtime.gates import build_gates

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_bf16_cuda_generation_and_training_step(kind):
    from test_dms import tiny

    model = tiny(kind).to("cuda", torch.bfloat16)
    config = DMSConfig(window=4, init_offset=0.0)
    gates = build_gates(model, config)
    for gate in gates:
        gate.weight.data.normal_(0, 0.003)
    handle = attach_dms(model, gates, config)
    ids = torch.randint(3, 51, (2, 16), device="cuda")
    cache = handle.new_cache()
    out = model.generate(input_ids=ids, max_new_tokens=32, do_sample=False, past_key_values=cache)
    assert out.shape == (2, 48) and cache.bytes_held() < cache.layers[0].keys.element_size() * 2 * 2 * 2 * 48 * 16
    with handle.mode("train"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
        loss.backward()
    assert all(p.grad is not None for p in gates.parameters() if p.requires_grad)
    handle.detach()


def test_engine_on_cuda_in_bf16_mixes_ratios_within_its_pool():
    from test_dms import tiny
    from test_engine import PROMPTS, engine_for, random_gates
    from tasks.chain_tokenizer import build_tokenizer
    from workers.thread import SamplingParams

    tokenizer = build_tokenizer()
    model = tiny("qwen3").to("cuda", torch.bfloat16)
    engine = engine_for(model, tokenizer, {4: random_gates(model, window=3, seed=2)}, budget=400_000)
    assert engine.pool.keys.is_cuda and engine.pool.keys.dtype == torch.bfloat16
    for i, prompt in enumerate(PROMPTS):
        engine.submit(f"{i}", engine.encode(prompt), [0, 1, 2], SamplingParams(temperature=0.8, max_new_tokens=64, seed=i), cr=4 if i % 2 else 1)
    results = engine.run()
    assert len(results) == 9 and all(r.tokens == 64 for r in results)
    assert engine.pool.high_water <= engine.pool.capacity and engine.pool.used == 0
    assert max(r.realized_cr for r in results) > 1.3
