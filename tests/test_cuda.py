"""DMS on CUDA in bf16 (skipped without a GPU; ``thinkpool bench gpu`` runs this file first on a device machine).

Self-contained on purpose: the GPU machine has no pydantic, so nothing here may import the other test modules
(``tests/test_dms.py`` imports the retrofit, which needs it)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dms_runtime.attach import attach_dms
from dms_runtime.config import DMSConfig
from dms_runtime.gate_bank import AdapterSet
from dms_runtime.gates import build_gates

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 51  # the chain tokenizer's size


def tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, pad_token_id=0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()
    return LlamaForCausalLM(LlamaConfig(**common)).eval()


def random_gates(model, window: int, seed: int):
    config = DMSConfig(window=window, init_offset=0.0)
    gates = build_gates(model, config)
    torch.manual_seed(seed)
    for gate in gates:
        gate.weight.data.normal_(0, 0.003)
    return gates, config


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_bf16_cuda_generation_and_training_step(kind):
    model = tiny(kind).to("cuda", torch.bfloat16)
    gates, config = random_gates(model, window=4, seed=0)
    handle = attach_dms(model, gates, config)
    ids = torch.randint(3, VOCAB, (2, 16), device="cuda")
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
    from tasks.chain_tokenizer import build_tokenizer
    from workers.engine import Engine
    from workers.thread import SamplingParams

    tokenizer = build_tokenizer()
    model = tiny("qwen3").to("cuda", torch.bfloat16)
    adapters = AdapterSet(model, {4: random_gates(model, window=3, seed=2)})
    engine = Engine(model, tokenizer, adapters, kv_budget_bytes=400_000, max_running=64)
    engine.stop = type(engine.stop)(eos=10**6)  # tiny random models: run every thread to its limit
    assert engine.pool.keys.is_cuda and engine.pool.keys.dtype == torch.bfloat16
    prompts = ["a=1;b=2;c=a+b;?c\n", "a=17;b=3;c=b*a;d=c-b;?d\n", "a=9;?a\n"]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.8, max_new_tokens=64, seed=i)
        engine.submit(f"{i}", engine.encode(prompt), [0, 1, 2], params, cr=4 if i % 2 else 1)
    results = engine.run()
    assert len(results) == 9 and all(r.tokens == 64 for r in results)
    assert engine.pool.high_water <= engine.pool.capacity and engine.pool.used == 0
    assert max(r.realized_cr for r in results) > 1.3


def _engine(model, ratios: dict):
    from tasks.chain_tokenizer import build_tokenizer
    from workers.engine import Engine

    engine = Engine(model, build_tokenizer(), AdapterSet(model, ratios), kv_budget_bytes=400_000, max_running=64)
    engine.stop = type(engine.stop)(eos=10**6)
    return engine


def test_engine_decode_steps_wait_for_the_device_once():
    """A decode step's one read (tokens, log-probs, counters) is the only synchronisation CUDA reports."""
    import warnings

    from workers.thread import SamplingParams

    model = tiny("qwen3").to("cuda", torch.bfloat16)
    engine = _engine(model, {4: random_gates(model, window=3, seed=2)})
    for i, cr in enumerate((4, 1)):
        engine.submit(f"{i}", engine.encode("a=17;b=3;c=b*a;d=c-b;?d\n"), [0, 1, 2],
                      SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=64, seed=i), cr=cr)
    for _ in range(3):
        engine.step()
    for _ in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert len(engine.rows) == 6
        assert sum("synchroniz" in str(w.message) for w in caught) <= 1


def test_engine_through_the_kernel_matches_its_reference_attention():
    """fp32 greedy: the Triton decode kernel and the torch reference give the engine the same tokens."""
    from dms_runtime.paged_cache import PagedDMSCache
    from workers.thread import SamplingParams

    model = tiny("qwen3", seed=1).to("cuda")
    ratios = {4: random_gates(model, window=3, seed=2)}
    texts = []
    for use_triton in (None, False):
        PagedDMSCache.use_triton = use_triton
        try:
            engine = _engine(model, ratios)
            engine.submit("dms", engine.encode("a=17;b=3;c=b*a;d=c-b;?d\n"), [0, 1], SamplingParams(max_new_tokens=40),
                          cr=4)
            engine.submit("vanilla", engine.encode("a=9;?a\n"), [0], SamplingParams(max_new_tokens=40))
            texts.append({(r.problem_id, r.sample): r.text for r in engine.run()})
            assert engine.pool.used == 0
            engine.close()
        finally:
            PagedDMSCache.use_triton = None
    assert texts[0] == texts[1]


def test_engine_decode_graphs_replay_the_eager_steps():
    """With CUDA graphs the engine gives the tokens of its eager steps (both bounding the kernel by the table's
    width, as a graph must), replaying most decode steps, through rows joining and leaving."""
    from workers.engine import Engine
    from workers.thread import SamplingParams
    from tasks.chain_tokenizer import build_tokenizer

    model = tiny("qwen3", seed=1).to("cuda", torch.bfloat16)
    ratios = {4: random_gates(model, window=3, seed=2)}
    texts, engines = [], []
    for graphs in (False, True):
        engine = Engine(model, build_tokenizer(), AdapterSet(model, ratios), kv_budget_bytes=400_000, max_running=64,
                        cuda_graphs=graphs)
        engine.stop = type(engine.stop)(eos=10**6)
        engine.cache.static_bounds = True
        for i, cr in enumerate((4, 1, 4)):
            params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=48 + 16 * i, seed=i)
            engine.submit(f"{i}", engine.encode("a=17;b=3;c=b*a;d=c-b;?d\n"), [0, 1], params, cr=cr)
        texts.append({(r.problem_id, r.sample): r.text for r in engine.run()})
        assert engine.pool.used == 0
        engine.pool.check()
        engines.append(engine)
        engine.close()
    graphs = engines[1].graphs
    assert graphs.failure is None and graphs.captures >= 1 and graphs.replays > 40
    assert texts[0] == texts[1]
