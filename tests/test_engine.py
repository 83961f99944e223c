"""The engine on tiny random models: equivalence with Hugging Face and with the DMS cache, mixed ratios in
one batch, seeds, a pool that is never overrun, preemption and resume, cancel, budget errors."""

import math

import pytest
import torch

from dms_runtime.config import DMSConfig
from dms_runtime.gate_bank import AdapterSet
from dms_runtime.gates import build_gates
from dms_runtime.kv_growth import KVGrowth
from dms_runtime.attach import attach_dms
from tasks.chain_tokenizer import build_tokenizer
from workers.engine import BudgetError, Engine
from workers.kv_budget import KVBudgetModel, group_tokens_per_head, threads_that_fit
from workers.sampler import counter_uniforms
from workers.thread import SamplingParams

from tests.test_dms import tiny

PROMPTS = ["a=1;b=2;c=a+b;?c\n", "a=17;b=3;c=b*a;d=c-b;?d\n", "a=9;?a\n"]
GREEDY = SamplingParams(max_new_tokens=40)
NO_STOP = 10**6  # tiny random models never say EOS by design; make sure "#" does not stop them either


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def ids(prompt: str) -> list[int]:
    """A prompt's token ids: the engine takes tokenized prompts."""
    return build_tokenizer()(prompt)["input_ids"]


def random_gates(model, window: int, seed: int, per_head: bool = True, offset: float = 0.0):
    """Gates with mixed keep/evict decisions; a positive ``offset`` makes them evict most tokens."""
    config = DMSConfig(window=window, per_head=per_head)
    gates = build_gates(model, config)
    torch.manual_seed(seed)
    for gate in gates:
        gate.weight.data.normal_(0, 0.003)
        object.__setattr__(gate.config, "init_offset", offset)
    return gates, config


def hf_greedy(model, tokenizer, prompt: str, **kwargs) -> str:
    """Hugging Face's greedy continuation, 40 tokens, EOS treated as any other token (as the engine's tests do)."""
    model.generation_config.eos_token_id = None
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(input_ids=ids, max_new_tokens=40, do_sample=False, pad_token_id=0, **kwargs)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def engine_for(model, tokenizer, adapters=None, budget=2_000_000, max_running=64):
    engine = Engine(model, tokenizer, AdapterSet(model, adapters or {}), kv_budget_bytes=budget, max_running=max_running)
    engine.stop = type(engine.stop)(eos=NO_STOP)
    return engine


def texts(results):
    return {(r.problem_id, r.sample): r.text for r in results}


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_cr1_greedy_matches_hugging_face_generate(kind, tokenizer):
    model = tiny(kind)
    expected = {(str(i), 0): hf_greedy(model, tokenizer, prompt) for i, prompt in enumerate(PROMPTS)}
    engine = engine_for(model, tokenizer)
    engine.submit("0", ids(PROMPTS[0]), [0], GREEDY)
    engine.step(), engine.step()  # the others join a batch that is already running
    engine.submit("1", ids(PROMPTS[1]), [0], GREEDY)
    engine.step()
    engine.submit("2", ids(PROMPTS[2]), [0], GREEDY)
    assert texts(engine.run()) == expected


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("per_head", [True, False])
def test_dms_rows_match_the_dms_cache_and_ratios_mix_in_one_batch(kind, per_head, tokenizer):
    model = tiny(kind, seed=1)
    adapters = {2: random_gates(model, window=3, seed=2, per_head=per_head), 4: random_gates(model, window=5, seed=3, per_head=per_head)}
    expected = {}
    for cr, (gates, config) in adapters.items():
        handle = attach_dms(model, gates, config)
        for i, prompt in enumerate(PROMPTS):
            expected[(f"{i}@{cr}", 0)] = hf_greedy(model, tokenizer, prompt, past_key_values=handle.new_cache())
        handle.detach()
    engine = engine_for(model, tokenizer, adapters)
    for cr in adapters:
        for i, prompt in enumerate(PROMPTS):
            engine.submit(f"{i}@{cr}", ids(prompt), [0], GREEDY, cr=cr)
    results = engine.run()
    assert texts(results) == expected
    assert all(r.realized_cr > 1.2 for r in results)  # the gates really evicted
    assert all(1.0 < r.kv_cr <= r.realized_cr + 1e-6 for r in results)  # a ratio of sums never exceeds the mean of ratios
    assert engine.pool.used == 0  # every slot came back
    engine.pool.check()


def test_same_seed_same_thread_whatever_shares_the_batch(tokenizer):
    model = tiny("qwen3")
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=30, seed=7)
    alone = engine_for(model, tokenizer)
    alone.submit("p", ids(PROMPTS[1]), [3], sampled)
    alone_text = texts(alone.run())[("p", 3)]
    alone.close()
    crowd = engine_for(model, tokenizer)
    crowd.submit("q", ids(PROMPTS[0]), list(range(5)), SamplingParams(temperature=0.7, max_new_tokens=30, seed=1))
    crowd.submit("p", ids(PROMPTS[1]), [0, 1, 2, 3], sampled)
    together = texts(crowd.run())
    assert alone_text == together[("p", 3)]
    assert len({together[("p", i)] for i in range(4)}) > 1  # different threads really differ


def test_a_threads_random_stream_is_its_seed_and_its_token_count():
    seeds = torch.tensor([0, 1, 2**62 + 5, 7])
    counters = torch.tensor([0, 0, 3, 9])
    drawn = counter_uniforms(seeds, counters)
    assert len(set(drawn.tolist())) == 4
    assert torch.equal(counter_uniforms(seeds[2:3], counters[2:3]), drawn[2:3])  # alone or in any batch order
    assert torch.equal(counter_uniforms(seeds.flip(0), counters.flip(0)), drawn.flip(0))
    n = 20_000
    for stream in (counter_uniforms(torch.full((n,), 12345), torch.arange(n)),  # one thread's successive draws
                   counter_uniforms(torch.arange(n), torch.zeros(n, dtype=torch.long))):  # many threads' first
        assert 0 < stream.min() and stream.max() < 1
        assert (torch.histc(stream.float(), bins=10, min=0, max=1) - n / 10).abs().max() < 200  # ~5 sigma
        assert abs(torch.corrcoef(torch.stack([stream[:-1], stream[1:]]))[0, 1]) < 0.05


def test_shared_prompt_is_prefilled_once_and_referenced_by_every_thread(tokenizer):
    model = tiny("qwen3")
    engine = engine_for(model, tokenizer)
    prompt_tokens = len(tokenizer(PROMPTS[1])["input_ids"])
    engine.submit("p", ids(PROMPTS[1]), list(range(8)), SamplingParams(temperature=1.0, max_new_tokens=30))
    engine.step()  # prefill + first token of all 8 threads, then one decode step
    slots_per_token = engine.slots_per_token
    # shared prompt once, plus each thread's own first generated token
    assert engine.pool.used == (prompt_tokens + 8) * slots_per_token


def test_threads_sharing_a_prefill_reserve_its_prompt_once(tokenizer):
    model = tiny("qwen3")
    prompt_tokens = len(tokenizer(PROMPTS[1])["input_ids"])
    probe = engine_for(model, tokenizer)
    token_bytes = probe.pool.slot_bytes * probe.slots_per_token
    probe.close()
    params = SamplingParams(temperature=1.0, max_new_tokens=30)
    # Room for the prompt once and four threads' own tokens: four start together (counting the prompt per
    # thread, three would), and they finish without a preemption.
    engine = engine_for(model, tokenizer, budget=(prompt_tokens + 4 * 30) * token_bytes)
    assert engine.fit(ids(PROMPTS[1]), params, 1.0) == 4
    engine.submit("p", ids(PROMPTS[1]), list(range(5)), params)
    engine.step()
    assert len(engine.scheduler.running) == 4 and len(engine.scheduler.waiting) == 1
    results = engine.run()
    assert len(results) == 5 and all(r.tokens == 30 for r in results)
    assert engine.preemptions == 0
    assert engine.pool.high_water <= engine.pool.capacity


def test_pool_is_never_overrun_and_preempted_threads_resume_identically(tokenizer):
    model = tiny("qwen3")
    roomy = engine_for(model, tokenizer)
    for i in range(6):
        roomy.submit(str(i), ids(PROMPTS[i % 3]), [0, 1], SamplingParams(temperature=0.8, max_new_tokens=60, seed=i))
    expected = texts(roomy.run())
    roomy.close()
    slot_bytes = roomy.pool.slot_bytes * roomy.slots_per_token
    # Room for about 3 threads' reservations: the burst must queue; an underestimate forces preemption.
    tight = engine_for(model, tokenizer, budget=3 * 75 * slot_bytes)
    # Admission trusts a growth estimate far too low: threads keep ten times what it reserves.
    tight.scheduler.budget_model = KVBudgetModel(tight.budget_model.kv_bytes_per_token, growths={1.0: KVGrowth(0.1, 0.1)})
    for i in range(6):
        tight.submit(str(i), ids(PROMPTS[i % 3]), [0, 1], SamplingParams(temperature=0.8, max_new_tokens=60, seed=i))
    peak_used = 0
    results = []
    while tight.has_work():
        results += tight.step()
        peak_used = max(peak_used, tight.pool.used)
        assert tight.pool.used <= tight.pool.capacity
    assert tight.pool.high_water <= tight.pool.capacity
    assert tight.preemptions > 0
    assert any(r.preemptions for r in results)
    assert texts(results) == expected
    assert len(results) == 12
    assert tight.pool.used == 0
    tight.pool.check()


def test_cancel_frees_memory_at_once(tokenizer):
    model = tiny("qwen3")
    engine = engine_for(model, tokenizer)
    engine.submit("keep", ids(PROMPTS[0]), [0], GREEDY)
    engine.submit("drop", ids(PROMPTS[1]), list(range(6)), SamplingParams(temperature=1.0, max_new_tokens=40))
    for _ in range(5):
        engine.step()
    before = engine.pool.used
    assert engine.cancel("drop") == 6
    assert engine.pool.used < before / 3
    results = engine.run()
    assert [r.problem_id for r in results] == ["keep"]
    assert engine.pool.used == 0


def test_evicted_slots_return_to_the_pool_while_decoding(tokenizer):
    model = tiny("qwen3")
    gates, config = random_gates(model, window=4, seed=0)
    for gate in gates:  # evict every token once it leaves the window
        gate.weight.data.zero_()
        object.__setattr__(gate.config, "init_offset", 10.0)
    engine = engine_for(model, tokenizer, {8: (gates, config)})
    engine.submit("p", ids(PROMPTS[0]), [0, 1], SamplingParams(temperature=1.0, max_new_tokens=200), cr=8)
    used = []
    while engine.has_work():
        engine.step()
        used.append(engine.pool.used)
    # Window + the undecided newest token, per head and layer and thread, whatever the length; and the task's held
    # prompt, whose last window of tokens its own row never gets past.
    assert max(used[5:]) <= (2 + 1) * (4 + 2) * engine.slots_per_token
    assert engine.tokens_generated == 2 * 200


def test_a_budget_too_small_for_one_thread_is_refused_before_any_work(tokenizer):
    model = tiny("qwen3")
    engine = engine_for(model, tokenizer, budget=20_000)
    with pytest.raises(BudgetError, match="kv_budget"):
        engine.submit("p", ids(PROMPTS[0]), [0], SamplingParams(max_new_tokens=500))
    assert not engine.has_work()
    with pytest.raises(ValueError, match="no DMS adapter for 8x"):
        engine.submit("p", ids(PROMPTS[0]), [0], GREEDY, cr=8)


def test_tables_shrink_when_rows_leave(tokenizer):
    model = tiny("qwen3")
    engine = engine_for(model, tokenizer, {})
    engine.submit("long", ids(PROMPTS[0]), [0, 1], GREEDY)
    for _ in range(5):
        engine.step()
    assert engine.cache.layers[0].table.shape[2] > 0
    engine.run()
    assert [layer.table.shape[2] for layer in engine.cache.layers] == [0] * len(engine.cache.layers)


def test_the_budget_model_counts_a_shared_prompt_once_and_each_thread_at_its_growth():
    vanilla = KVGrowth.nominal(1)
    assert group_tokens_per_head(100, [50, 50, 50], 0, vanilla) == 100 + 3 * 50
    # One thread at the nominal 8x: DESIGN's w + (P + L - w) / CR, and the window of the task's held prompt (its row
    # stays at the prompt's end, where the last w + 1 prompt tokens are still visible to a thread starting there).
    assert group_tokens_per_head(100, [900], 32, KVGrowth.nominal(8)) == (33 + math.ceil(67 / 8)) + (33 + math.ceil(867 / 8))
    measured = KVGrowth(prompt=0.8, generated=0.05)  # what trained gates do: keep the prompt, drop the scratch
    assert group_tokens_per_head(100, [900, 900], 32, measured) == (33 + 54) + 2 * (33 + 44)
    assert threads_that_fit(4000, 100, 900, 32, measured) > 1.5 * threads_that_fit(4000, 100, 900, 32, KVGrowth.nominal(8))
    # However short the threads, the held prompt's last window is whole and the rest at its kept fraction.
    assert group_tokens_per_head(100, [10], 32, measured) == (33 + 54) + 10


def test_threads_report_what_their_gates_kept(tokenizer):
    model = tiny("qwen3", seed=1)
    engine = engine_for(model, tokenizer, {4: random_gates(model, window=3, seed=2)})
    params = SamplingParams(temperature=1.0, max_new_tokens=40)
    engine.submit("dms", ids(PROMPTS[2]), [0, 1], params, cr=4)
    engine.submit("vanilla", ids(PROMPTS[2]), [0], params)
    results = {r.problem_id: r for r in engine.run()}
    assert results["vanilla"].prompt_kept == results["vanilla"].generated_kept == 1.0
    dms = results["dms"]
    assert 0 < dms.generated_kept < 1 and 0 < dms.prompt_kept < 1
    # What is held past the window, plus the window, is what the row held: its memory compression.
    prompt = len(tokenizer(PROMPTS[2])["input_ids"])
    length = prompt + dms.tokens - 1  # the last sampled token is never fed back
    past = length - 3 - 1
    held = (length - past) + dms.prompt_kept * prompt + dms.generated_kept * (past - prompt)
    assert abs(length / held - dms.kv_cr) < 0.05 * dms.kv_cr


def test_a_threads_kept_curve_is_what_it_held_when_it_was_that_long(tokenizer):
    """A token's fate is final once it leaves the window, so the long thread's curve at p must equal what the
    same thread (same seed, alone) held when stopped p tokens past its window."""
    model = tiny("qwen3", seed=1)
    adapters = {4: random_gates(model, window=3, seed=2)}
    long_run = engine_for(model, tokenizer, adapters)
    long_run.submit("p", ids(PROMPTS[2]), [0], SamplingParams(temperature=1.0, max_new_tokens=140, seed=5), cr=4)
    [long] = long_run.run()
    long_run.close()
    curve = dict(long.generated_kept_curve)
    assert sorted(curve) == [32, 64, 128]  # 140 tokens: 135 past the window of 3 (the last one is never fed back)
    for p in (32, 64):
        short_run = engine_for(model, tokenizer, adapters)
        short_run.submit("p", ids(PROMPTS[2]), [0], SamplingParams(temperature=1.0, max_new_tokens=p + 3 + 2, seed=5), cr=4)
        [short] = short_run.run()
        short_run.close()
        assert long.text.startswith(short.text)
        assert short.generated_kept == pytest.approx(curve[p], abs=1e-6)
    assert curve[128] == pytest.approx(long.generated_kept, abs=0.05)  # 128 of its 135


def test_a_growth_curve_reserves_what_threads_of_that_length_kept():
    curve = KVGrowth(prompt=0.8, generated=0.1, generated_curve=((32, 0.5), (64, 0.3), (128, 0.2)))
    assert [curve.kept_generated(p) for p in (0, 16, 32, 48, 64, 128)] == pytest.approx([0, 8, 16, 17.6, 19.2, 25.6])
    assert curve.kept_generated(256) == pytest.approx(0.2 * 256)  # beyond the last point: its fraction
    # Kept counts never fall between points, whatever quantiles the points were taken at.
    assert KVGrowth(0.8, 0.1, ((32, 0.5), (64, 0.2))).kept_generated(64) == pytest.approx(16)
    assert KVGrowth(0.8, 0.1).kept_generated(100) == pytest.approx(10)  # no curve: the long-run fraction
    # A short thread is reserved at its length's fraction, a long one near the long-run fraction.
    flat = KVGrowth(0.8, 0.2)
    assert group_tokens_per_head(100, [60], 32, curve) == (33 + 54) + 33 + 14  # 27 past the window at 0.5
    assert group_tokens_per_head(100, [161], 32, curve) == group_tokens_per_head(100, [161], 32, flat)
    assert KVBudgetModel.from_dict(KVBudgetModel(3072, {4.0: 32}, {4.0: curve}).as_dict()).growth(4.0) == curve


def test_a_measured_growth_admits_more_threads_and_the_pool_still_holds(tokenizer):
    model = tiny("qwen3", seed=1)
    adapters = {4: random_gates(model, window=3, seed=2, offset=4.0)}  # keeps far less than a quarter
    params = SamplingParams(temperature=1.0, max_new_tokens=60, seed=3)
    probe = engine_for(model, tokenizer, adapters)
    probe.submit("probe", ids(PROMPTS[2]), list(range(4)), params, cr=4)
    kept = probe.run()
    growth = KVGrowth(max(r.prompt_kept for r in kept), max(r.generated_kept for r in kept))
    token_bytes = probe.pool.slot_bytes * probe.slots_per_token
    probe.close()
    budget = 60 * token_bytes
    nominal = engine_for(model, tokenizer, adapters, budget=budget)
    fits_nominal = nominal.fit(ids(PROMPTS[2]), params, 4)
    nominal.close()
    engine = Engine(model, tokenizer, AdapterSet(model, adapters, {4: growth}), kv_budget_bytes=budget)
    engine.stop = type(engine.stop)(eos=NO_STOP)
    fits = engine.fit(ids(PROMPTS[2]), params, 4)
    assert fits > fits_nominal >= 1
    engine.submit("p", ids(PROMPTS[2]), list(range(fits)), params, cr=4)
    engine.step()
    assert len(engine.scheduler.running) == fits  # all admitted at once
    results = engine.run()
    assert sorted(r.sample for r in results) == list(range(fits))
    assert engine.pool.high_water <= engine.pool.capacity and engine.pool.used == 0


def test_a_kept_task_prefills_its_prompt_once_across_requests_and_reports_its_own_peak(tokenizer):
    """A controller's chunks and rounds are requests of one task: the prompt is prefilled once and held until
    the task closes, later threads are the same threads a single request would have run, and each result
    carries its task's KV peak, not another task's."""
    model = tiny("qwen3")
    adapters = {4: random_gates(model, window=3, seed=2)}
    params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=4)
    together = engine_for(model, tokenizer, adapters)
    together.submit("all", ids(PROMPTS[1]), [0, 1, 2, 3], params, cr=4)
    expected = {r.sample: r.text for r in together.run()}
    together.close()

    engine = engine_for(model, tokenizer, adapters)
    engine.submit("round-1", ids(PROMPTS[1]), [0, 1], params, cr=4, task_id="task", keep=True)
    first = engine.run()
    assert engine.pool.used > 0  # the held prompt outlives the request
    engine.submit("round-2", ids(PROMPTS[1]), [2, 3], params, cr=4, task_id="task", keep=True)
    engine.submit("other", ids(PROMPTS[2]), [0], GREEDY)  # a task of its own, closed with its last thread
    results = first + engine.run()
    assert engine.prompt_prefills == 2  # "task" once across both rounds, "other" once
    assert {r.sample: r.text for r in results if r.problem_id.startswith("round")} == expected
    task_peak = max(r.kv_peak_bytes for r in results if r.problem_id.startswith("round"))
    other_peak = next(r.kv_peak_bytes for r in results if r.problem_id == "other")
    per_token = engine.budget_model.kv_bytes_per_token
    assert len(ids(PROMPTS[2])) * per_token < other_peak <= (len(ids(PROMPTS[2])) + 40) * per_token  # vanilla keeps all
    # Each task counts its own slots: together they explain the pool's peak, and neither exceeds it.
    assert 0 < max(task_peak, other_peak) <= engine.pool.high_water_bytes <= task_peak + other_peak
    engine.close_task("task")
    assert engine.pool.used == 0 and not engine.tasks and not engine.scheduler.held
    engine.pool.check()


def test_cancelling_a_task_stops_all_its_requests_and_frees_its_prompt(tokenizer):
    model = tiny("qwen3")
    engine = engine_for(model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=200)
    engine.submit("a", ids(PROMPTS[0]), [0, 1], params, task_id="task", keep=True)
    engine.submit("b", ids(PROMPTS[0]), [2, 3], params, task_id="task", keep=True)
    engine.submit("keep", ids(PROMPTS[1]), [0], GREEDY)
    for _ in range(5):
        engine.step()
    assert engine.close_task("task") == 4
    assert {t.problem_id for t in engine.rows} == {"keep"}
    engine.run()
    assert engine.pool.used == 0
