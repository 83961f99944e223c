"""The engine's storage on its own: the KV pool's device-side books and the packed per-head slot lines, against the
DMS cache (``DMSCache``) as the reference for what each head holds."""

import pytest
import torch

from dms_runtime.attach import attach_dms
from dms_runtime.kv_pool import KVPool, PoolExhausted
from tests.test_dms import tiny
from tests.test_engine import PROMPTS, engine_for, ids, random_gates
from workers.decode_graph import DecodeGraph, decode_shape
from workers.sync_probe import SyncProbe
from workers.thread import SamplingParams

from tasks.chain_tokenizer import build_tokenizer


def test_the_pool_frees_a_shared_slot_once_and_counts_without_reading_the_device():
    pool = KVPool(budget_bytes=10 * 2 * 4 * 4, head_dim=4)  # 10 slots of fp32, head_dim 4
    owners = torch.tensor([1, 1, 1, 2])
    with SyncProbe() as probe:
        slots = pool.allocate(4, owners)
        pool.retain(slots[:2], times=2)  # two more threads share the first two slots
        # Three rows release the shared slots in one go, and a masked-out entry names a slot it does not hold.
        pool.release(torch.cat([slots[:2], slots[:2], slots[:2], slots[2:3]]),
                     torch.tensor([True] * 6 + [False]))
        assert pool.has_free(6)  # by the host's bound: 4 handed out of 10
    assert probe.syncs == 0
    assert pool.used == 2 and sorted(pool.refs[slots].tolist()) == [0, 0, 1, 1]
    pool.check()
    assert pool.owner_used[1].item() == 1 and pool.owner_used[2].item() == 1 and pool.owner_peak[1].item() == 3
    again = pool.allocate(8)  # the two freed slots are handed out again, each once
    assert len(set(again.tolist()) | set(slots[2:].tolist())) == 10 and pool.high_water == 10
    pool.check()
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    pool.release(torch.cat([again, slots[2:]]))
    assert pool.used == 0 and pool.owner_used.sum().item() == 0
    pool.check()


def held_positions(layer, row: int) -> list[set[int]]:
    """Per KV head: the positions a row's line holds."""
    count, pos = layer.count[row].tolist(), layer.pos[row].tolist()
    return [set(pos[h][: count[h]]) for h in range(len(count))]


@pytest.mark.parametrize("per_head", [True, False])
def test_lines_stay_packed_and_hold_what_the_dms_cache_holds(per_head):
    """Mid-thread, each head's line holds exactly the positions the DMS cache holds after the same tokens, packed
    (its last entry the newest token, no mark past its count), with every marked entry still in the window."""
    tokenizer = build_tokenizer()
    model = tiny("qwen3", seed=1)
    gates, config = random_gates(model, window=3, seed=2, per_head=per_head)
    for gate in gates:  # decisions far from the threshold: float rounding cannot flip one
        gate.weight.data.normal_(0, 0.2)
    engine = engine_for(model, tokenizer, {4: (gates, config)})
    prompt = ids(PROMPTS[1])
    engine.submit("p", prompt, [0, 1], SamplingParams(temperature=1.0, max_new_tokens=60, seed=3), cr=4)
    for _ in range(35):
        engine.step()
    thread = engine.rows[1]
    cache = engine.cache
    fed = prompt + thread.tokens[:-1]
    for layer in cache.layers:
        assert layer.length[1].item() == len(fed)
        count, pos, evict = layer.count[1], layer.pos[1], layer.evict[1]
        for h in range(count.shape[0]):
            n = int(count[h])
            assert pos[h, n - 1].item() == len(fed) - 1  # the newest token is last
            assert len(set(pos[h, :n].tolist())) == n and not evict[h, n:].any()
            assert ((len(fed) - 1 - pos[h, :n])[evict[h, :n]] <= 3).all()  # marked, but the last query still saw it
    engine_held = [held_positions(layer, 1) for layer in cache.layers]
    assert sum(map(len, sum(engine_held, []))) < len(fed) * 2 * len(cache.layers)  # the gates evicted
    engine.close()

    handle = attach_dms(model, gates, config)
    reference = handle.new_cache()
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt]), past_key_values=reference, use_cache=True)
        for position, token in enumerate(thread.tokens[:-1], start=len(prompt)):
            model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]), past_key_values=reference,
                  use_cache=True)
    handle.detach()
    for mine, theirs in zip(engine_held, reference.layers):
        pos = theirs.pos[0].tolist()
        assert mine == [{p for p in head if p >= 0} for head in pos]


def test_a_decode_step_reads_the_device_once_and_never_waits_inside_the_model():
    """Mixed ratios, sampling filters, threads sharing a prompt: a decode step's only read is the one it means (its
    tokens, log-probs and the counters); nothing in the layers, the sampler or the bookkeeping reads the device."""
    tokenizer = build_tokenizer()
    model = tiny("llama", seed=1)
    adapters = {2: random_gates(model, window=3, seed=2), 4: random_gates(model, window=5, seed=3)}
    engine = engine_for(model, tokenizer, adapters)
    for cr, params in ((1, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=80)),
                       (2, SamplingParams(temperature=0.7, top_k=5, min_p=0.05, max_new_tokens=80)),
                       (4, SamplingParams(max_new_tokens=80))):
        engine.submit(f"r{cr}", ids(PROMPTS[cr % 3]), [0, 1, 2], params, cr=cr)
    for _ in range(3):
        engine.step()
    for _ in range(20):
        with SyncProbe() as probe:
            finished = engine.step()
        assert not finished and len(engine.rows) == 9
        assert probe.syncs == 0, dict(probe.ops)
        assert probe.reads == 1
    engine.run()
    assert engine.pool.used == 0
    engine.pool.check()


def test_a_decode_step_rebinds_no_tensor_and_a_replay_adds_its_host_books():
    """What replaying a captured decode step needs: its device work (``_decode_logits``, ``_sample``) rebinds no state
    tensor while the tables keep their width, and changes on the host exactly what ``PagedDMSCache.host_step`` adds."""
    tokenizer = build_tokenizer()
    model = tiny("qwen3", seed=1)
    engine = engine_for(model, tokenizer, {4: random_gates(model, window=3, seed=2)})
    engine.submit("dms", ids(PROMPTS[1]), [0, 1], SamplingParams(temperature=1.0, max_new_tokens=60), cr=4)
    engine.submit("vanilla", ids(PROMPTS[2]), [0], SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=60))
    engine.step()
    layers, steady = engine.cache.layers, 0
    for _ in range(30):
        threads, widths, shape = list(engine.rows), [layer.width for layer in layers], decode_shape(engine)
        bounds, handed = [(layer.widest, layer.longest) for layer in layers], engine.pool._handed_out
        with torch.inference_mode():  # as Engine.step runs it
            packed = engine._sample(engine._decode_logits(), slice(None))
        assert [(layer.widest, layer.longest) for layer in layers] == [(w + 1, n + 1) for w, n in bounds]
        assert engine.pool._handed_out == handed + len(threads) * engine.slots_per_token
        if [layer.width for layer in layers] == widths:
            assert decode_shape(engine) == shape
            steady += 1
        assert not engine._advance(threads, None, packed=packed)
    assert steady > 20


def test_graphs_fall_back_to_eager_steps_when_capture_fails():
    """On the CPU a capture fails: the engine puts its books back, says why, and gives the tokens it gives without."""
    tokenizer = build_tokenizer()
    model = tiny("qwen3", seed=1)
    adapters = {4: random_gates(model, window=3, seed=2)}
    texts = []
    for graphs in (False, True):
        engine = engine_for(model, tokenizer, adapters)
        if graphs:
            engine.graphs = DecodeGraph(engine)
        engine.submit("p", ids(PROMPTS[1]), [0, 1, 2], SamplingParams(temperature=1.0, max_new_tokens=40, seed=5), cr=4)
        texts.append({r.sample: r.text for r in engine.run()})
        assert engine.pool.used == 0
        engine.pool.check()
        engine.close()
    assert texts[0] == texts[1]
    assert engine.graphs.failure and engine.graphs.captures == 0
