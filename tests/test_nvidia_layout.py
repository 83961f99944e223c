"""NVIDIA's DMS checkpoint layout (dms_runtime/nvidia_layout.py) on tiny Qwen3 and Llama checkpoints written in it."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

import dms_runtime.attention as dms_attention_module
from dms_runtime.cache import DMSCache
from dms_runtime.config import DMSConfig
from dms_runtime.gate_bank import NEVER
from dms_runtime.gates import build_gates as build_thinkpool_gates
from dms_runtime.nvidia_gates import NvidiaDMSConfig, SeparateGate, build_gates, gate_logits
from dms_runtime.nvidia_layout import (
    NvidiaAdapterSet,
    NvidiaGateHandle,
    export_nvidia_layout,
    load_nvidia_layout,
    read_dms_config,
    read_gate_tensors,
)

VOCAB, LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 51, 2, 4, 2, 16, 64
WINDOW, BLOCK, CR = 8, 4, 8
KINDS = ["qwen3", "llama"]
# What Model-Optimizer's extract writes beside the dms_* fields: remote code that thinkpool never runs.
AUTO_MAP = {"AutoConfig": "configuration_qwen3_dms.Qwen3ConfigDMS",
            "AutoModelForCausalLM": "modeling_qwen3_dms.Qwen3ForCausalLMDMS"}


@pytest.fixture(autouse=True)
def quiet_loading():
    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report lists the dms_* tensors the plain model leaves out
    yield
    hf_logging.set_verbosity(verbosity)


def tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    common = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "intermediate_size": 128, "pad_token_id": 0, "head_dim": HEAD_DIM,
              # A short RoPE wavelength: the slowest channel pair turns within a few tokens, so a channel zeroed
              # before RoPE only, or after only, shows in the logits.
              "rope_parameters": {"rope_type": "default", "rope_theta": 10.0}}
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common)).eval()
    return LlamaForCausalLM(LlamaConfig(**common)).eval()


def write_nvidia_dir(path: Path, kind: str = "qwen3", separate: bool = True, alpha_per: str = "head",
                     window: int = WINDOW,
                     disable: bool = False, shards: bool = False, seed: int = 0) -> Path:
    """A checkpoint exactly as NVIDIA's extract writes one: the plain model's weights, ``dms_proj_alpha*`` tensors for
    separate gates, and a config without ``architectures``, with ``auto_map`` and the ``dms_*`` fields."""
    model = tiny(kind, seed)
    model.save_pretrained(path, max_shard_size="40KB" if shards else "10GB")
    config = json.loads((path / "config.json").read_text())
    config.pop("architectures", None)
    config["auto_map"] = AUTO_MAP
    config.update(dms_alpha_scale=100.0, dms_initial_alpha_offset=5.0, dms_window_size=window,
                  dms_paged_attention_block_size=BLOCK, dms_cr=CR, dms_separate_alpha=separate, dms_alpha_per=alpha_per,
                  dms_disable_eviction=disable, dms_tau=0.1, dms_compile_limit=72, dms_manual_inference_mode=False,
                  dms_chunked_prefill=None, dms_preallocate_for_tokens=4096)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if separate:
        generator = torch.Generator().manual_seed(seed + 1)
        gates = {}
        for layer in range(LAYERS):
            prefix = f"model.layers.{layer}.self_attn."
            gates[prefix + "dms_proj_alpha.weight"] = 0.05 * torch.randn(KV_HEADS, HIDDEN, generator=generator)
            gates[prefix + "dms_proj_alpha_norm.weight"] = 1 + 0.2 * torch.randn(HIDDEN, generator=generator)
        if shards:  # the gates in a shard of their own, named in the index
            save_file(gates, path / "model-dms.safetensors", metadata={"format": "pt"})
            index = json.loads((path / "model.safetensors.index.json").read_text())
            index["weight_map"].update({name: "model-dms.safetensors" for name in gates})
            (path / "model.safetensors.index.json").write_text(json.dumps(index))
        else:
            tensors = load_file(path / "model.safetensors") | gates
            save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def all_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors |= load_file(file)
    return tensors


def load(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


def rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def formula(tensors: dict, layer: int, layer_input: torch.Tensor, dms: NvidiaDMSConfig, eps: float) -> torch.Tensor:
    """The eviction logits written out from the checkpoint's tensors and the layer's input (before its input norm)."""
    p = f"model.layers.{layer}."
    if dms.separate_alpha:
        normed = rms(layer_input, tensors[p + "self_attn.dms_proj_alpha_norm.weight"], eps)
        raw = normed @ tensors[p + "self_attn.dms_proj_alpha.weight"].T
    else:
        query = rms(layer_input, tensors[p + "input_layernorm.weight"], eps) @ tensors[p + "self_attn.q_proj.weight"].T
        query = query.view(*layer_input.shape[:2], HEADS, HEAD_DIM)
        if p + "self_attn.q_norm.weight" in tensors:
            query = rms(query, tensors[p + "self_attn.q_norm.weight"], eps)
        raw = query[:, :, :: HEADS // KV_HEADS, -1]
    logits = raw * dms.alpha_scale - dms.initial_alpha_offset
    return logits if dms.per_head else logits[..., :1]


def capture_layer_inputs(model) -> tuple[list, list]:
    inputs: list = [None] * LAYERS
    hooks = [layer.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0].detach().clone()))
             for i, layer in enumerate(model.model.layers)]
    return inputs, hooks


# -- config ----------------------------------------------------------------------------------------------------
def test_config_fields_are_read_and_mapped_to_thinkpool_settings(tmp_path):
    path = write_nvidia_dir(tmp_path / "nv", separate=False, alpha_per="layer")
    dms = read_dms_config(path)
    assert dms == NvidiaDMSConfig(100.0, 5.0, WINDOW, BLOCK, CR, False, "layer", False)
    assert dms.dms_config == DMSConfig(parametrization="query_neuron", per_head=False, window=WINDOW, logit_scale=100.0,
                                       init_offset=-5.0)
    assert dms.config_fields()["dms_window_size"] == WINDOW
    tiny("qwen3").save_pretrained(tmp_path / "plain")
    assert read_dms_config(tmp_path / "plain") is None  # no dms_* field: not NVIDIA's layout


@pytest.mark.parametrize("changes, message", [
    ({"dms_window_size": BLOCK}, r"dms_window_size: 4 must be larger than dms_paged_attention_block_size \(4\)"),
    ({"dms_window_size": 2}, "dms_window_size: 2 must be larger than"),
    ({"dms_paged_attention_block_size": 0}, "dms_paged_attention_block_size: must be > 0"),
    ({"dms_alpha_per": "token"}, "dms_alpha_per: must be 'head' or 'layer'"),
    ({"dms_window_size": "512"}, "dms_window_size: must be an integer"),
    ({"dms_cr": 1}, "dms_cr: must be a number > 1"),
    ({"dms_separate_alpha": "yes"}, "dms_separate_alpha: must be true or false"),
])
def test_bad_dms_config_is_a_clear_error_naming_the_field(tmp_path, changes, message):
    path = write_nvidia_dir(tmp_path, separate=False)
    config = json.loads((path / "config.json").read_text()) | changes
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        read_dms_config(path)
    with pytest.raises(ValueError, match=message):
        load_nvidia_layout(load(path), path)


def test_missing_or_misshapen_gate_tensors_are_named(tmp_path):
    path = write_nvidia_dir(tmp_path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.dms_proj_alpha.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{name}: missing"):
        load_nvidia_layout(load(path), path)
    save_file(tensors | {name: torch.zeros(3, HIDDEN)}, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}: shape \(3, 64\), expected \(2, 64\)"):
        load_nvidia_layout(load(path), path)


# -- decisions ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("alpha_per", ["head", "layer"])
def test_decisions_equal_the_formula_from_the_weights(tmp_path, kind, separate, alpha_per):
    path = write_nvidia_dir(tmp_path, kind, separate, alpha_per)
    tensors, model = all_tensors(path), load(path)
    layout = load_nvidia_layout(model, path)
    dms, eps = layout.config, model.config.rms_norm_eps
    handle = layout.attach(model)
    inputs, hooks = capture_layer_inputs(model)
    ids = torch.randint(3, VOCAB, (2, WINDOW))  # no token outlives the window: every mark is still in the cache
    cache = handle.new_cache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    decided = 0
    for layer, attention in enumerate(model.model.layers):
        expected = formula(tensors, layer, inputs[layer], dms, eps)
        logits = attention.self_attn.dms.logits
        assert logits.shape == (2, WINDOW, KV_HEADS if alpha_per == "head" else 1)
        torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-4)
        prefix = f"model.layers.{layer}."
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        torch.testing.assert_close(gate_logits(state, inputs[layer], dms, model.config), expected, atol=1e-3, rtol=1e-4)
        clear = expected.abs() > 1e-2
        assert torch.equal((logits > 0)[clear], (expected > 0)[clear])
        # The logit at t marks token t-1, in every KV head (one decision per layer spreads over all of them).
        cached = cache.layers[layer]
        assert torch.equal(cached.pos[0, 0, :WINDOW], torch.arange(WINDOW))  # slot s holds token s
        marks = (expected[:, 1:] > 0).transpose(1, 2).expand(-1, KV_HEADS, -1)
        assert torch.equal(cached.evict[:, :, : WINDOW - 1], marks) and not cached.evict[:, :, -1].any()
        decided += int(marks.sum())
    assert 0 < decided < marks.numel() * LAYERS  # the planted gates both keep and evict
    for hook in hooks:
        hook.remove()
    handle.detach()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alpha_per", ["head", "layer"])
def test_the_repurposed_channel_is_zero_in_the_queries_attention_sees(tmp_path, monkeypatch, kind, alpha_per):
    path = write_nvidia_dir(tmp_path, kind, separate=False, alpha_per=alpha_per)
    model = load(path)
    adapters = NvidiaAdapterSet(model, load_nvidia_layout(model, path))
    seen = []
    original = dms_attention_module.grouped_sdpa
    monkeypatch.setattr(dms_attention_module, "grouped_sdpa",
                        lambda query, *rest: seen.append(query) or original(query, *rest))
    ids = torch.randint(3, VOCAB, (2, 12))
    for ratios in ([CR, CR], [1.0, CR], [1.0, 1.0]):  # the channel stays zero at every ratio, eviction off included
        adapters.set_rows(ratios)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=DMSCache.for_model(model, WINDOW), use_cache=True)
    with adapters.handle.mode("off"), torch.no_grad():
        model(input_ids=ids)
    assert len(seen) == 4 * LAYERS
    first = list(range(0, HEADS, HEADS // KV_HEADS))  # every KV group's first head, per layer decisions too
    for query in seen:
        assert query.shape == (2, HEADS, 12, HEAD_DIM)
        assert torch.count_nonzero(query[:, first, :, -1]) == 0
        assert torch.count_nonzero(query[:, 1, :, -1]) > 0 and torch.count_nonzero(query[:, first, :, :-1]) > 0


# -- eviction off: the plain model -----------------------------------------------------------------------------
def nvidia_reference_rope(module, monkeypatch):
    """NVIDIA's ``prepare_attention_input`` on a plain transformers model: the repurposed channel zeroed before RoPE
    and after, by wrapping the modeling module's ``apply_rotary_pos_emb`` (independent of thinkpool's hooks)."""
    rotate, first = module.apply_rotary_pos_emb, slice(None, None, HEADS // KV_HEADS)

    def zeroed(q, k, cos, sin, *args, **kwargs):
        q = q.clone()
        q[:, first, :, -1] = 0
        q, k = rotate(q, k, cos, sin, *args, **kwargs)
        q[:, first, :, -1] = 0
        return q, k

    monkeypatch.setattr(module, "apply_rotary_pos_emb", zeroed)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("separate", [True, False])
def test_with_eviction_off_greedy_tokens_equal_the_plain_model(tmp_path, monkeypatch, kind, separate):
    path = write_nvidia_dir(tmp_path / "on", kind, separate)
    ids = torch.randint(3, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    greedy = {"max_new_tokens": 24, "do_sample": False, "attention_mask": mask}
    with monkeypatch.context() as patch:
        if not separate:  # the plain model of a repurposed checkpoint has its channel zeroed, as NVIDIA's code does
            import importlib
            nvidia_reference_rope(importlib.import_module(f"transformers.models.{kind}.modeling_{kind}"), patch)
        plain = load(path)
        reference = plain.generate(input_ids=ids, **greedy)
        with torch.no_grad():
            reference_logits = plain(input_ids=ids, attention_mask=mask).logits
    model = load(path)
    adapters = NvidiaAdapterSet(model, load_nvidia_layout(model, path))
    assert adapters.ratios == [float(CR)] and adapters.window(CR) == WINDOW and adapters.window(1) == 0
    adapters.set_rows([1.0, 1.0])
    with torch.no_grad():  # not only the same tokens: the same logits (a tiny model's argmax forgives small errors)
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=DMSCache.for_model(model, WINDOW)).logits
    torch.testing.assert_close(logits[mask.bool()], reference_logits[mask.bool()], atol=1e-5, rtol=1e-5)
    cache = DMSCache.for_model(model, WINDOW)
    assert torch.equal(model.generate(input_ids=ids, past_key_values=cache, **greedy), reference)
    with adapters.detached():  # the bare model, e.g. for transformers' generate: still NVIDIA's model
        assert torch.equal(model.generate(input_ids=ids, **greedy), reference)
    # At dms_cr the gates evict: the cache holds fewer tokens than went through, and the tokens may change.
    adapters.set_rows([float(CR)] * 2)
    cache = DMSCache.for_model(model, WINDOW)
    model.generate(input_ids=ids, past_key_values=cache, **greedy)
    assert (cache.realized_compression() > 1.2).all()
    # dms_disable_eviction: no ratio but 1, the same tokens.
    off = write_nvidia_dir(tmp_path / "off", kind, separate, disable=True)
    model = load(off)
    adapters = NvidiaAdapterSet(model, load_nvidia_layout(model, off))
    assert adapters.ratios == []
    with pytest.raises(ValueError, match="no DMS adapter for 8x"):
        adapters.index(CR)
    adapters.set_rows([1.0, 1.0])
    cache = DMSCache.for_model(model, WINDOW)
    assert torch.equal(model.generate(input_ids=ids, past_key_values=cache, **greedy), reference)


def test_rows_without_a_gate_never_evict_beside_rows_at_dms_cr(tmp_path):
    path = write_nvidia_dir(tmp_path)
    tensors, model = all_tensors(path), load(path)
    adapters = NvidiaAdapterSet(model, load_nvidia_layout(model, path))
    inputs, hooks = capture_layer_inputs(model)
    adapters.set_rows([CR, 1.0])
    ids = torch.randint(3, VOCAB, (1, 10)).expand(2, -1)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=DMSCache.for_model(model, WINDOW), use_cache=True)
    for layer, block in enumerate(model.model.layers):
        logits = block.self_attn.dms.logits
        expected = formula(tensors, layer, inputs[layer][:1], adapters.layout.config, model.config.rms_norm_eps)
        torch.testing.assert_close(logits[:1], expected, atol=1e-3, rtol=1e-4)
        assert (logits[1] == NEVER).all()
    for hook in hooks:
        hook.remove()


def test_gates_in_a_sharded_checkpoint_are_found_through_its_index(tmp_path):
    path = write_nvidia_dir(tmp_path, shards=True)
    assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
    tensors = read_gate_tensors(path)
    assert sorted(tensors) == sorted(f"model.layers.{i}.self_attn.{n}" for i in range(LAYERS)
                                     for n in ("dms_proj_alpha.weight", "dms_proj_alpha_norm.weight"))
    layout = load_nvidia_layout(load(path), path)
    assert torch.equal(layout.gates[1].weight.data, tensors["model.layers.1.self_attn.dms_proj_alpha.weight"])


# -- export ------------------------------------------------------------------------------------------------------
def decisions(path: Path, ids: torch.Tensor) -> list[torch.Tensor]:
    model = load(path)
    layout = load_nvidia_layout(model, path)
    handle = layout.attach(model)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=handle.new_cache(), use_cache=True)
    return [block.self_attn.dms.logits > 0 for block in model.model.layers]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alpha_per", ["head", "layer"])
def test_gates_of_the_pre_norm_kind_export_to_nvidias_layout_and_reload_identically(tmp_path, kind, alpha_per):
    """What a retrofit in NVIDIA's layout produces: SeparateGate gates, trained (here: set at random) on a plain
    model."""
    model = tiny(kind)
    dms = NvidiaDMSConfig(window_size=WINDOW, block_size=BLOCK, cr=CR, separate_alpha=True, alpha_per=alpha_per)
    gates = build_gates(model, dms)
    assert all(isinstance(g, SeparateGate) for g in gates) and all(g.weight.abs().sum() == 0 for g in gates)  # keep-all
    torch.manual_seed(3)
    for gate in gates:
        gate.weight.data.normal_(0, 0.05)
        gate.norm_weight.data.uniform_(0.5, 1.5)
    ids = torch.randint(3, VOCAB, (2, 12))
    handle = NvidiaGateHandle(model, gates, dms.dms_config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=handle.new_cache(), use_cache=True)
    before = [block.self_attn.dms.logits > 0 for block in model.model.layers]
    handle.detach()
    out = export_nvidia_layout(model, tmp_path / "exported", dms, gates)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == kind and config["dms_separate_alpha"] is True and config["dms_window_size"] == WINDOW
    assert "model.layers.0.self_attn.dms_proj_alpha.weight" in read_gate_tensors(out)
    after = decisions(out, ids)
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and any(a.any() for a in after)


@pytest.mark.parametrize("kind", KINDS)
def test_a_repurposed_checkpoint_exports_as_it_is_and_thinkpools_own_gates_do_not(tmp_path, kind):
    path = write_nvidia_dir(tmp_path / "nv", kind, separate=False)
    ids = torch.randint(3, VOCAB, (2, 12))
    model = load(path)
    layout = load_nvidia_layout(model, path)
    out = export_nvidia_layout(model, tmp_path / "again", layout.config, layout.gates)
    assert all(torch.equal(a, b) for a, b in zip(decisions(path, ids), decisions(out, ids)))
    plain = tiny(kind)
    for parametrization, separate in (("adapter", True), ("query_neuron", False)):
        ours = build_thinkpool_gates(plain, DMSConfig(parametrization=parametrization))
        dms = NvidiaDMSConfig(window_size=WINDOW, block_size=BLOCK, separate_alpha=separate)
        with pytest.raises(ValueError, match="gates: "):
            export_nvidia_layout(plain, tmp_path / parametrization, dms, ours)
