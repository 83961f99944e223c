"""DMS runtime on tiny random Llama and Qwen3 models: masks, cache, equivalences, adapters, retrofit."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dms_runtime.adapters import AdapterError, load_adapter, read_adapter_metadata, save_adapter
from dms_runtime.attach import attach_dms
from dms_runtime.attention import _bias_mask_attention, _explicit_attention, eviction_bias, shifted_decisions, straight_through_alpha
from dms_runtime.config import DMSConfig
from dms_runtime.evicting_attention import evicting_attention
from dms_runtime.gates import build_gates
from training.retrofit import RetrofitConfig, target_ratio

VOCAB = 51  # the chain tokenizer's size, so tiny models can decode real prompts


def tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, pad_token_id=0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()
    return LlamaForCausalLM(LlamaConfig(**common)).eval()


def set_logits(gates, logit: float):
    """Make every gate emit a constant logit (positive: evict everything, negative: keep everything)."""
    for gate in gates:
        gate.weight.data.zero_()
        object.__setattr__(gate.config, "init_offset", logit)


MODELS = ["qwen3", "llama"]


def test_training_bias_matches_a_direct_construction():
    torch.manual_seed(0)
    alpha = (torch.rand(2, 3, 10) > 0.5).float()
    window = 3
    bias = eviction_bias(alpha, q_len=10, window=window)
    for b in range(2):
        for h in range(3):
            for i in range(10):
                for j in range(10):
                    expected = -1e9 if (i - j > window and alpha[b, h, j] == 1) else 0.0
                    assert bias[b, h, i, j].item() == pytest.approx(expected)


@pytest.mark.parametrize("decisions", [2, 1], ids=["per-head", "per-layer"])
def test_training_attention_gives_the_written_out_attention_and_its_gradients(decisions):
    """Both training paths (the CPU's fused kernel, and SDPA with the eviction bias as a float mask) against
    the attention written out: outputs, and the gradients of the gates, queries, keys and values. Grouped-query
    heads, left padding in one row, a length that is not a multiple of the fused path's block."""
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim, window = 2, 6, 2, 70, 8, 5
    query, key, value = (torch.randn(batch, h, length, dim) for h in (heads, kv_heads, kv_heads))
    allowed = torch.ones(length, length, dtype=torch.bool).tril()[None, None].repeat(batch, 1, 1, 1)
    allowed[1, :, :, :3] = False  # row 1 starts with three padding tokens, each of which sees only itself
    allowed[1, :, range(3), range(3)] = True
    results = {}
    for path in ("fused", "bias_mask", "explicit"):
        logits = (3 * torch.randn(batch, length, decisions, generator=torch.Generator().manual_seed(1))).requires_grad_()
        inputs = [t.clone().requires_grad_() for t in (query, key, value)]
        alpha = straight_through_alpha(shifted_decisions(logits), 0.1, noise=False)
        if path != "explicit":
            attend = {"fused": evicting_attention, "bias_mask": _bias_mask_attention}[path]
            out = attend(*inputs, alpha, allowed, window, None)
        else:
            bias = eviction_bias(alpha, length, window).expand(-1, kv_heads, -1, -1)
            out, _ = _explicit_attention(*inputs, allowed, None, bias)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).square().sum().backward()
        results[path] = [out.detach(), logits.grad] + [t.grad for t in inputs]
    assert 0 < alpha.detach().mean() < 1  # some keys evicted, some kept
    assert results["explicit"][1].abs().sum() > 0
    for path in ("fused", "bias_mask"):
        for got, expected in zip(results[path], results["explicit"]):
            assert torch.allclose(got, expected, atol=1e-4), path


def test_decision_about_a_token_comes_from_the_next_position():
    logits = torch.arange(5.0).view(1, 5, 1)  # position t emits logit t
    decisions = shifted_decisions(logits)[0, 0]
    assert decisions[:4].tolist() == [1.0, 2.0, 3.0, 4.0] and decisions[4] < -1e8


def test_schedule_ramps_every_ratio_linearly_then_holds():
    config = RetrofitConfig(ratios=[2, 4, 8], ramp_steps=10, hold_steps=5)
    assert [target_ratio(0, r, config) for r in (2, 4, 8)] == [1.0, 1.0, 1.0]
    assert [target_ratio(5, r, config) for r in (2, 4, 8)] == [1.5, 2.5, 4.5]
    assert [target_ratio(12, r, config) for r in (2, 4, 8)] == [2.0, 4.0, 8.0]
    assert config.total_steps == 15


def test_retrofit_batches_write_minus_lines_as_the_base_model_was_trained():
    """A retrofit distils on the base model's own chain of thought: ``-`` lines read from the right only for a base
    whose tokenizer holds ``~`` (the shipped model's: ``configs/train_reversed_minus.yaml``), never for the first one's."""
    from training.retrofit import chain_batch
    from tasks.chain_tokenizer import build_tokenizer

    config = RetrofitConfig(any_order=True, k_min=12, k_max=12, tokens_per_batch=4000)
    for reversed_minus in (False, True):
        tokenizer = build_tokenizer(reversed_minus)
        texts = tokenizer.batch_decode(chain_batch(config, tokenizer, 0).input_ids, skip_special_tokens=True)
        assert any("~" in text for text in texts) == reversed_minus


def test_learning_rates_hold_then_decay_linearly_to_zero_over_the_last_steps():
    from training.retrofit import lr_scale

    config = RetrofitConfig(ramp_steps=10, hold_steps=10, lr_decay_steps=8)
    assert [lr_scale(step, config) for step in (0, 11, 12)] == [1.0, 1.0, 1.0]
    assert [lr_scale(step, config) for step in (16, 19)] == [0.5, 0.125]
    assert lr_scale(19, RetrofitConfig(ramp_steps=10, hold_steps=10)) == 1.0  # no decay by default


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("parametrization", ["adapter", "query_neuron"])
def test_generate_with_eviction_off_is_token_identical(kind, per_head, parametrization):
    model = tiny(kind)
    ids = torch.randint(3, VOCAB, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    config = DMSConfig(parametrization=parametrization, per_head=per_head, window=4)
    handle = attach_dms(model, build_gates(model, config), config)
    handle.set_mode("off" if parametrization == "query_neuron" else "infer")
    cache = handle.new_cache() if parametrization == "adapter" else None
    output = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, past_key_values=cache)
    assert torch.equal(output, reference)
    if cache is not None:
        # Nothing evicted: every real token is held (padding is released), in every head.
        held = cache.layers[0].held_tokens()
        assert held[0].tolist() == [6 + 23] * 2 and held[1].tolist() == [9 + 23] * 2
    handle.detach()
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False), reference)


@pytest.mark.parametrize("kind", MODELS)
def test_evicted_slots_are_reused_and_bytes_follow_tokens_held(kind):
    model = tiny(kind)
    window = 5
    config = DMSConfig(window=window)
    gates = build_gates(model, config)
    set_logits(gates, 10.0)  # evict every token once it leaves the window
    handle = attach_dms(model, gates, config)
    cache = handle.new_cache()
    ids = torch.randint(3, VOCAB, (2, 30))
    model.generate(input_ids=ids, max_new_tokens=150, min_new_tokens=150, do_sample=False, past_key_values=cache)
    layer = cache.layers[0]
    # Visible: the window, plus the newest token whose decision is not made yet.
    assert layer.held_tokens().max().item() == window + 1
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    per_token = 2 * head_dim * 4
    assert cache.bytes_held() == 2 * 2 * 2 * (window + 1) * per_token  # layers x rows x heads x tokens
    # 180 tokens went through, but the slots stay at what the 30-token prefill needed.
    assert layer.keys.shape[2] <= 30 + 64
    assert torch.allclose(cache.realized_compression(), torch.tensor([179 / (window + 1)] * 2))
    handle.detach()


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("per_head", [True, False])
def test_training_attention_matches_cache_inference(kind, per_head):
    """Teacher-forced logits in training mode (hard decisions, no noise) equal incremental DMS decoding."""
    model = tiny(kind, seed=1)
    config = DMSConfig(window=3, per_head=per_head)
    gates = build_gates(model, config)
    torch.manual_seed(2)
    for gate in gates:
        gate.weight.data.normal_(0, 0.003)  # mixed keep/evict decisions
        object.__setattr__(gate.config, "init_offset", 0.0)
    handle = attach_dms(model, gates, config)
    ids = torch.randint(3, VOCAB, (2, 24))
    with torch.no_grad(), handle.mode("train"):
        for module in handle.modules:
            module.dms.noise = False
        trained = model(input_ids=ids, use_cache=False).logits
        evicted = sum(a.sum().item() for a in handle.alphas())
    assert evicted > 10  # the comparison is meaningful: many tokens are evicted
    cache = handle.new_cache()
    with torch.no_grad():
        steps = [model(input_ids=ids[:, :6], past_key_values=cache).logits]
        for t in range(6, 24):
            steps.append(model(input_ids=ids[:, t : t + 1], past_key_values=cache).logits)
    incremental = torch.cat(steps, dim=1)
    assert torch.allclose(trained, incremental, atol=1e-4)
    assert cache.layers[1].held_tokens().min() < 24


def test_adapter_round_trip_and_wrong_base_is_refused(tmp_path):
    model = tiny("qwen3")
    config = DMSConfig(window=7, parametrization="query_neuron")
    gates = build_gates(model, config)
    gates[0].weight.data.fill_(0.01)
    path = save_adapter(tmp_path / "dms-4x.safetensors", gates, config, model, 4.0)
    metadata = read_adapter_metadata(path)
    assert metadata["target_cr"] == 4 and metadata["dms_config"]["window"] == 7
    assert metadata["dms_config"]["parametrization"] == "query_neuron"
    handle = load_adapter(model, path)
    assert torch.equal(handle.gates[0].weight, gates[0].weight) and handle.config.window == 7
    handle.detach()
    other = tiny("qwen3", seed=5)
    with pytest.raises(AdapterError, match="was trained for base model"):
        load_adapter(other, path)
    with pytest.raises(AdapterError, match="no DMS adapter"):
        load_adapter(model, tmp_path / "missing.safetensors")


@pytest.mark.parametrize("kind", MODELS)
def test_kvpress_press_matches_the_dms_cache(kind, tmp_path):
    from dms_runtime.press import DMSGatePress

    model = tiny(kind, seed=3)
    config = DMSConfig(window=4)
    gates = build_gates(model, config)
    torch.manual_seed(4)
    for gate in gates:
        gate.weight.data.normal_(0, 0.003)
        object.__setattr__(gate.config, "init_offset", 0.0)
    path = save_adapter(tmp_path / "dms-2x.safetensors", gates, config, model, 2.0)
    ids = torch.randint(3, VOCAB, (1, 12))
    press = DMSGatePress.from_adapter(model, path)
    with press(model):
        pressed = model.generate(input_ids=ids, max_new_tokens=40, do_sample=False)
    assert press.compression_ratio > 0.2  # the press really masked keys
    handle = load_adapter(model, path)
    cache = handle.new_cache(dense_prefill=True)
    ours = model.generate(input_ids=ids, max_new_tokens=40, do_sample=False, past_key_values=cache)
    handle.detach()
    assert torch.equal(pressed, ours)


@pytest.mark.parametrize("method", ["window", "streaming", "tova", "h2o", "knorm", "snapkv"])
def test_baselines_hold_the_cache_to_their_ratio(method):
    from evaluation.baselines import HeldRatioPress
    from tasks.chain_tokenizer import build_tokenizer
    from evaluation.reference_decode import KVPolicy, SamplingParams, generate_group

    model = tiny("qwen3")
    press = HeldRatioPress(method=method, compression=4.0, interval=4)
    prompt = "a=1;b=2;c=a+b;d=c*c;?d"  # 23 tokens with <bos>
    outputs, peak = generate_group(model, build_tokenizer(), [prompt], [(0, 0), (0, 1)],
                                   SamplingParams(temperature=1.0, max_new_tokens=64), kv=KVPolicy(press=press))
    ratios = [o.realized_cr for o in outputs if o.tokens > 40]
    assert ratios and all(3.0 <= r <= 4.2 for r in ratios), ratios
    per_token = 2 * 2 * 2 * 16 * 4  # layers x K/V x heads x head_dim x fp32
    assert peak <= 2 * (23 + 64) * per_token


def test_fingerprint_ignores_dtype_but_not_weights():
    from dms_runtime.adapters import model_fingerprint

    model = tiny("llama")
    fingerprint = model_fingerprint(model)
    assert model_fingerprint(tiny("llama").to(torch.bfloat16)) == fingerprint
    changed = tiny("llama")
    with torch.no_grad():
        changed.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0
    assert model_fingerprint(changed) != fingerprint


@pytest.mark.parametrize("full_finetune", [False, True])
def test_retrofit_on_a_tiny_model_trains_every_ratio_and_resumes(tmp_path, full_finetune):
    from dms_runtime.adapters import load_adapter
    from dms_runtime.loading import load_model
    from training.retrofit import RetrofitConfig, eviction_target, held_tokens, retrofit
    from tasks.chain_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    model = tiny("qwen3")
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    config = RetrofitConfig(model=str(tmp_path / "base"), ratios=[2, 4], ramp_steps=2, hold_steps=1,
                            tokens_per_batch=300, k_max=4, window=4, checkpoint_every=1, full_finetune=full_finetune)
    assert retrofit(config, steps=2, quiet=True) == []  # stopped before the end: nothing exported yet
    written = retrofit(config, quiet=True)  # resumes at step 2
    out = tmp_path / ("base-dms" if full_finetune else "base")
    assert written == [out / "dms-2x.safetensors", out / "dms-4x.safetensors"]
    assert read_adapter_metadata(written[1])["train_steps"] == 3
    # Every adapter loads onto the weights it was trained with (fine-tuned ones: the new model directory).
    trained, _ = load_model(out)
    for path in written:
        load_adapter(trained, path).detach()
    if full_finetune:
        with pytest.raises(AdapterError):
            load_adapter(tiny("qwen3"), written[0])
    # The eviction target reproduces the named ratio on average over the lengths it was solved for.
    lengths = [60, 200, 900]
    fraction = eviction_target(4.0, 16, lengths)
    assert sum(n / held_tokens(n, 16, fraction) for n in lengths) / 3 == pytest.approx(4.0, rel=1e-3)


def test_retrofit_continues_from_a_finished_runs_export(tmp_path):
    from dms_runtime.adapters import load_gates
    from dms_runtime.loading import load_model
    from training.retrofit import RetrofitConfig, retrofit
    from tasks.chain_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    tiny("qwen3").save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    settings = dict(model=str(tmp_path / "base"), ratios=[2, 4], ramp_steps=1, tokens_per_batch=300, k_max=4,
                    window=4, full_finetune=True, warmstart_steps=3, gate_supervision=0.1)
    first = RetrofitConfig(**settings, hold_steps=1, output=str(tmp_path / "first"))
    retrofit(first, quiet=True)
    with pytest.raises(ValueError, match="already has 2 steps"):
        retrofit(RetrofitConfig(**settings, hold_steps=1, continue_from=first.output, output=str(tmp_path / "x")), quiet=True)
    with pytest.raises(ValueError, match="trained with ratios"):
        retrofit(RetrofitConfig(**settings | {"ratios": [2, 8]}, hold_steps=3, continue_from=first.output,
                                output=str(tmp_path / "x")), quiet=True)
    longer = RetrofitConfig(**settings, hold_steps=3, continue_from=first.output, output=str(tmp_path / "longer"))
    written = retrofit(longer, quiet=True)
    assert read_adapter_metadata(written[1])["train_steps"] == 4
    assert read_adapter_metadata(written[1])["continued_from"] == first.output
    # It started from the first run's weights and gates, and its two steps moved both a little.
    before, _ = load_model(tmp_path / "first")
    after, _ = load_model(tmp_path / "longer")
    moved = [(a - b).abs().max().item() for a, b in zip(after.parameters(), before.parameters())]
    assert 0 < max(moved) < 0.05
    old, _ = load_gates(before, tmp_path / "first" / "dms-4x.safetensors")
    new, _ = load_gates(after, written[1])
    gate_moves = [(a - b).abs().max().item() for a, b in zip(new.parameters(), old.parameters())]
    assert 0 < max(gate_moves) < 0.05


@pytest.mark.parametrize("kind", MODELS)
def test_probe_mode_is_the_vanilla_model_and_reports_far_attention(kind):
    from dms_runtime.attention import far_attention

    model = tiny(kind)
    ids = torch.randint(1, VOCAB, (2, 12))
    with torch.no_grad():
        vanilla = model(input_ids=ids).logits
    handle = attach_dms(model, build_gates(model, DMSConfig(window=3)), DMSConfig(window=3))
    with torch.no_grad(), handle.mode("probe"):
        probed = model(input_ids=ids).logits
        far = handle.far_attentions()
    torch.testing.assert_close(probed, vanilla, rtol=1e-4, atol=1e-4)
    assert len(far) == 2 and far[0].shape == (2, 2, 12)  # layers x [B, kv_heads, T]
    assert (far[0][..., -4:] == 0).all() and (far[0][..., :8] > 0).all()  # the last w+1 keys have no far query
    # far_attention on a hand-made pattern: key 0 gets 0.9 from query 5 (far), key 4 only near queries.
    probs = torch.zeros(1, 2, 6, 6)
    probs[0, 1, 5, 0] = 0.9
    probs[0, 0, 5, 4] = 0.8
    assert far_attention(probs, kv_heads=1, window=2)[0, 0].tolist() == pytest.approx([0.9, 0, 0, 0, 0, 0])


def test_far_attention_labels_evict_the_least_read_keys_at_the_fraction():
    from training.gate_labels import far_attention_labels

    far = [torch.tensor([[[0.5, 0.01, 0.02, 0.9, 0.03, 0.2, 0.0, 0.0]]])]  # 1 layer, 1 row, 1 head, T = 8
    labels, weights, eligible = far_attention_labels(far, torch.tensor([8]), window=1, fraction=0.5)
    assert eligible[0, 0, 0].tolist() == [True] * 6 + [False] * 2
    assert labels[0, 0, 0].tolist() == [0, 1, 1, 0, 1, 0, 0, 0]  # the three least-read of six are evicted
    assert weights[0, 0, 0, 3] > weights[0, 0, 0, 0] > 1 and weights[0, 0, 0, 1] == 1
    # per token: two layers of two heads; a token read by any one head is kept by all four
    far = [torch.tensor([[[0.9, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]]]),
           torch.tensor([[[0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.8, 0.0, 0.0]]])]
    labels, _, _ = far_attention_labels(far, torch.tensor([5]), window=1, fraction=0.5, per_token=True)
    assert all(labels[layer, 0, head].tolist() == [0, 1, 0, 0, 0] for layer in range(2) for head in range(2))  # 3, 4: in the window


def test_token_regions_find_the_long_lived_values_of_a_chain_of_thought():
    from training.chain_data import IGNORE, token_regions
    from tasks.chain_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    prompt, cot = "a=7;?a", "a:07\nc=a+b|a:07+b:42|7+2=09\nc:49\n#49"
    ids = tokenizer(prompt + cot, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(prompt + cot)  # one character per token, so regions line up with characters
    found = token_regions(tokenizer, ids, [IGNORE] * len(prompt) + ids[len(prompt):])
    by_char = list(zip(prompt + cot, found))
    assert all(region == "prompt" for _, region in by_char[: len(prompt)])
    assert [c for c, region in by_char if region == "register"] == list(":07:49")
    assert [c for c, region in by_char if region == "facts"] == list("7+2=09")
    assert [c for c, region in by_char if region == "answer"] == list("#49")


def test_role_labels_keep_long_lived_tokens_whole_in_the_pairs_that_read_them_most():
    from training.gate_labels import RoleLabels, eligible_mask, fit_label_threshold, label_ratio, pair_bonus

    # layer 0 never gets a band (its gates cannot see roles); the rest are ranked by how much they read
    bonus = pair_bonus(torch.tensor([[0.9, 0.9], [0.1, 0.3], [0.2, 0.05]]))
    assert bonus.tolist() == [[0, 0], [2, 4], [3, 1]]
    roles = RoleLabels(bonus, [0.25, 3.0])
    far = [torch.tensor([[[0.3, 0.0, 0.2, 0.1, 0.0, 0.0], [0.0, 0.4, 0.0, 0.0, 0.0, 0.0]]])] * 3  # [B=1, kv=2, T=6]
    long_lived = torch.tensor([[False, True, False, True, False, False]])
    scores = roles.scores(far, long_lived)  # [layers, B, kv, T]
    assert torch.equal(scores[0], far[0])
    assert scores[1, 0, 1].tolist() == pytest.approx([0.0, 4.4, 0.0, 4.0, 0.0, 0.0])
    # window 1, length 6: keys 0..3 can be evicted. The milder ratio evicts scratch read under 0.25 only ...
    labels, weights, eligible = roles.labels(scores, torch.tensor([6]), window=1, ratio_index=0)
    assert labels[0, 0].tolist() == [[0, 1, 1, 1, 0, 0], [1, 0, 1, 1, 0, 0]]
    assert weights[1, 0, 1, 1] > weights[0, 0, 0, 0] > 1 and eligible[0, 0, 0].tolist() == [True] * 4 + [False] * 2
    # ... the stronger one keeps long-lived tokens only in the pairs with band >= 3, whole, and no scratch
    labels, _, _ = roles.labels(scores, torch.tensor([6]), window=1, ratio_index=1)
    assert labels[:, 0, :, 1].tolist() == [[1, 1], [1, 0], [0, 1]] and labels[:, 0, :, 3].tolist() == [[1, 1], [1, 0], [0, 1]]
    assert roles.kept_pairs(1) == 2 and roles.kept_pairs(0) == 4

    # The thresholds realize the asked ratio as eval measures it; every sample (difficulty) weighs the same.
    samples = [(scores, eligible_mask(scores, torch.tensor([6]), 1), torch.tensor([6]))]
    assert label_ratio(samples, 0.0) == 1.0
    assert label_ratio(samples, 10.0) == pytest.approx(3.0)  # every pair holds its window + 1 = 2 of 6
    short = torch.zeros(3, 3, 2, 3)  # three rows of length 3: one key leaves the window, so each holds 2 of 3
    samples_by_k = samples + [(short, eligible_mask(short, torch.tensor([3, 3, 3]), 1), torch.tensor([3, 3, 3]))]
    assert label_ratio(samples_by_k, 10.0) == pytest.approx((3.0 + 1.5) / 2)  # not (3 + 3 * 1.5) / 4 by rows
    threshold = fit_label_threshold(samples, 2.5, top_band=4)
    assert threshold == 3.0  # above the scratch: a whole band floor (two pairs keep their long-lived tokens)
    assert label_ratio(samples, threshold) == pytest.approx(2.5)
    mild = fit_label_threshold(samples, 1.2, top_band=4)
    assert 0 < mild < 1 and label_ratio(samples, mild) >= 1.2  # scratch alone: bisected below the bands


def inference_decisions(model_dir, adapter, batch) -> tuple[torch.Tensor, DMSConfig]:
    """A retrofitted model's eviction decisions ``[layers, B, decisions, T]`` on ``batch``, deterministic as at
    inference, and the adapter's config."""
    from dms_runtime.adapters import load_gates
    from dms_runtime.loading import load_model

    model, _ = load_model(model_dir)
    gates, dms = load_gates(model, adapter)
    handle = attach_dms(model, gates, dms)
    with torch.no_grad(), handle.mode("train"):
        for module in handle.modules:
            module.dms.noise = False
        model(input_ids=batch.input_ids)
        alphas = torch.stack([a.float() for a in handle.alphas()])
    handle.detach()
    return alphas, dms


def test_gate_warm_start_moves_the_gates_to_the_eviction_target(tmp_path):
    import random

    from training.chain_data import difficulty_batch, sample_lengths
    from training.retrofit import RetrofitConfig, evicted_fraction, eviction_target, retrofit
    from tasks.chain_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    tiny("llama").save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    config = RetrofitConfig(model=str(tmp_path / "base"), ratios=[4], ramp_steps=1, hold_steps=6, warmstart_steps=40,
                            warmstart_lr=0.01, tokens_per_batch=300, k_max=4, window=4, full_finetune=True,
                            freeze_gates=True, checkpoint_every=1)
    retrofit(config, steps=1, quiet=True)
    written = retrofit(config, quiet=True)  # resumes after the warm start, with its calibrated offsets
    batch = difficulty_batch(tokenizer, random.Random(1), 3, 3, 600)
    alphas, dms = inference_decisions(tmp_path / "base-dms", written[0], batch)
    fraction, _ = evicted_fraction(list(alphas), batch.lengths, dms.window)
    target = eviction_target(4.0, 4, sample_lengths(tokenizer, 1, 4))
    assert abs(fraction.item() - target) < 0.15  # zero-initialised gates evict nothing
    assert dms.init_offset != RetrofitConfig().init_offset  # the calibrated offset travels with the adapter


def test_retrofit_batches_follow_the_base_models_chain_of_thought_order():
    from training.retrofit import chain_batch
    from tasks.chain_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    plain = RetrofitConfig(k_min=8, k_max=8, tokens_per_batch=1500)
    varied = plain.model_copy(update={"any_order": True})
    assert torch.equal(chain_batch(plain, tokenizer, 3).input_ids, chain_batch(plain, tokenizer, 3).input_ids)
    assert not torch.equal(chain_batch(plain, tokenizer, 3).input_ids, chain_batch(varied, tokenizer, 3).input_ids)
    assert chain_batch(varied, tokenizer, 3, 2, 2).k == 2


def test_frozen_gates_need_full_finetuning():
    with pytest.raises(ValueError, match="freeze_gates needs full_finetune"):
        RetrofitConfig(freeze_gates=True)
    with pytest.raises(ValueError, match="gate_supervision keeps the warm start's labels"):
        RetrofitConfig(gate_supervision=0.1)
    with pytest.raises(ValueError, match="cannot be combined with freeze_gates"):
        RetrofitConfig(gate_supervision=0.1, warmstart_steps=5, full_finetune=True, freeze_gates=True)


def test_supervised_role_gates_keep_long_lived_tokens_rather_than_scratch(tmp_path):
    import random

    from training.chain_data import difficulty_batch, long_lived_mask
    from training.gate_labels import left_window_mask
    from training.retrofit import RetrofitConfig, retrofit
    from tasks.chain_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    tiny("qwen3").save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    config = RetrofitConfig(model=str(tmp_path / "base"), ratios=[10], ramp_steps=1, hold_steps=4, warmstart_steps=60,
                            warmstart_lr=0.003, warmstart_labels="cot_roles", gate_supervision=0.5, tokens_per_batch=400,
                            k_max=4, window=4, full_finetune=True)
    written = retrofit(config, quiet=True)
    batch = difficulty_batch(tokenizer, random.Random(3), 4, 4, 800)
    alphas, dms = inference_decisions(tmp_path / "base-dms", written[0], batch)
    evicted = alphas[1:]  # [layers after the first, B, kv, T]
    old = left_window_mask(batch.lengths, evicted.shape[-1], dms.window)
    long_lived = long_lived_mask(tokenizer, batch)
    rate = lambda tokens: evicted[:, tokens[:, None, :].expand(-1, evicted.shape[2], -1)].mean().item()
    assert rate(old & long_lived) < rate(old & ~long_lived) - 0.3  # roles, learnt from a token's context
    assert read_adapter_metadata(written[0])["long_lived_pairs"] == 2  # both pairs of layer 1 keep them
