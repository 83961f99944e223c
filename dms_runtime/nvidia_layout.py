"""NVIDIA's DMS checkpoint layout (Model-Optimizer ``experimental/dms``, ``nvidia/Qwen3-8B-DMS-8x``), served as it is.

Such a directory is a plain Qwen3 (or Llama) checkpoint whose ``config.json`` adds ``dms_*`` fields and, for
separate gates, whose weights add two tensors per layer (the gates themselves: :mod:`dms_runtime.nvidia_gates`). Transformers loads it as the plain model (the extra
tensors are left out); this module reads what it adds and turns it into thinkpool gates:

* separate gates (``dms_separate_alpha``): ``self_attn.dms_proj_alpha`` (``[KV heads, hidden]``, a bias when
  ``attention_bias``) behind its own RMSNorm ``self_attn.dms_proj_alpha_norm``, reading the layer's input
  *before* its input norm (thinkpool's adapter gates read it after);
* repurposed gates: channel -1 of the normalised, pre-RoPE query of the first query head of each KV group. That
  channel is zero in the query attention sees, before and after RoPE, at every ratio (the weights were trained
  so); the gate reads it from the model's own projection.

Logit = raw x ``dms_alpha_scale`` - ``dms_initial_alpha_offset``; a token is evicted where the logit is > 0, per
KV head or (``dms_alpha_per: layer``) head 0's decision for the layer. The logit at position t decides about
token t-1. NVIDIA builds its cache with ``dms_window_size + 1`` entries because its ring of recent tokens holds
the current one too: in training (``q - k <= window``), in its prefill mask and in its decode ring alike, a
marked token is seen by the ``dms_window_size`` queries after it, which is thinkpool's ``window``.
``dms_cr`` is a label there (what training aimed at); the ratio served is what the gates realize.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dms_runtime.attach import DMSHandle, attention_modules
from dms_runtime.gate_bank import AdapterSet
from dms_runtime.kv_growth import KVGrowth
from dms_runtime.nvidia_gates import (
    ALPHA,
    ALPHA_NORM,
    FIELDS,
    NvidiaDMSConfig,
    QueryChannelGate,
    SeparateGate,
    build_gates,
    zero_repurposed_queries,
)


def read_dms_config(model_dir: str | Path) -> NvidiaDMSConfig | None:
    """The NVIDIA DMS settings of a model directory, ``None`` when its ``config.json`` has no ``dms_*`` field;
    raises ValueError naming the field and its limit for settings NVIDIA's code would refuse."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read the model config ({error})") from error
    if not any(name in config for name in FIELDS):
        return None
    defaults = NvidiaDMSConfig()
    keys = ("alpha_scale", "initial_alpha_offset", "window_size", "block_size", "cr", "separate_alpha", "alpha_per",
            "disable_eviction")
    values = {key: config.get(field, getattr(defaults, key)) for key, field in zip(keys, FIELDS)}
    return NvidiaDMSConfig(**values)


def read_gate_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The ``dms_proj_alpha*`` tensors of a checkpoint, from ``model.safetensors`` or its sharded index."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if ".dms_proj_alpha" in name:
                files.setdefault(file, []).append(name)
    elif (model_dir / "model.safetensors").is_file():
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
            files = {"model.safetensors": [n for n in handle.keys() if ".dms_proj_alpha" in n]}  # noqa: SIM118
    else:
        raise ValueError(f"{model_dir}: no model.safetensors or model.safetensors.index.json to read DMS gates from")
    tensors = {}
    for file, names in files.items():
        with safe_open(str(model_dir / file), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in names})
    return tensors


# -- attaching -------------------------------------------------------------------------------------------------
class NvidiaGateHandle(DMSHandle):
    """A :class:`DMSHandle` for NVIDIA's gates: every DMS handle hands a separate gate its layer's input before the
    input norm (``dms_runtime.attach``), so a retrofit trains these gates on exactly what serving feeds them."""


@dataclass
class NvidiaLayout:
    """What an NVIDIA-layout directory adds to the plain model loaded from it: its settings and its gates (the
    repurposed channel, if any, is already zeroed in the model by :func:`load_nvidia_layout`)."""

    config: NvidiaDMSConfig
    gates: nn.ModuleList
    zeroing: list = field(default_factory=list)  # the hooks zeroing a repurposed channel, for the model's lifetime

    @property
    def ratio(self) -> float:
        """The ratio the gates are served as (``--cr``): ``dms_cr``."""
        return float(self.config.cr)

    @property
    def ratios(self) -> list[float]:
        return [] if self.config.disable_eviction else [self.ratio]

    def attach(self, model: nn.Module) -> NvidiaGateHandle:
        return NvidiaGateHandle(model, self.gates, self.config.dms_config)


def load_nvidia_layout(model: nn.Module, model_dir: str | Path) -> NvidiaLayout | None:
    """Prepare ``model`` (loaded from ``model_dir`` by transformers) for its NVIDIA gates: zero a repurposed query
    channel and build the gates. ``None`` for a directory that is not in NVIDIA's layout."""
    dms = read_dms_config(model_dir)
    if dms is None:
        return None
    if dms.separate_alpha:
        return NvidiaLayout(dms, build_gates(model, dms, read_gate_tensors(model_dir)))
    zeroing = zero_repurposed_queries(model)
    return NvidiaLayout(dms, build_gates(model, dms), zeroing)


class NvidiaAdapterSet(AdapterSet):
    """The engine's :class:`AdapterSet` for an NVIDIA directory: one ratio, ``dms_cr`` (none with
    ``dms_disable_eviction``), whose rows run the directory's gates, and cr 1 rows that never evict."""

    def __init__(self, model: nn.Module, layout: NvidiaLayout, growth: KVGrowth | None = None):
        self.layout = layout
        self.ratios = layout.ratios
        self.windows = {cr: layout.config.window_size for cr in self.ratios}
        self.growths = {cr: growth for cr in self.ratios if growth is not None}
        self.banks = layout.gates
        self.handle: DMSHandle = layout.attach(model)

    @contextmanager
    def detached(self) -> Iterator[None]:
        self.handle.detach()
        try:
            yield
        finally:
            self.handle = self.layout.attach(self.handle.model)


# -- export --------------------------------------------------------------------------------------------------
def export_nvidia_layout(model: nn.Module, out_dir: str | Path, dms: NvidiaDMSConfig,
                         gates: nn.ModuleList | None = None, tokenizer=None) -> Path:
    """Write ``model`` with its gates as NVIDIA's code reads them: the weights in the model's dtype, plus
    ``dms_proj_alpha*`` for separate gates, and the ``dms_*`` fields in ``config.json``.

    Exportable: :class:`SeparateGate` gates (``dms_separate_alpha``), and a model whose repurposed query channel is its
    gate (nothing to add). Not exportable: thinkpool's own ``EvictionGate`` kinds, whose ``adapter`` gates read the
    input after the layer norm and whose ``query_neuron`` gate is a separate map, zeroed before ``q_norm`` and not after
    RoPE: neither is what NVIDIA's code computes. No ``auto_map`` or model code is written (that code is NVIDIA's)."""
    out_dir = Path(out_dir)
    layers = len(attention_modules(model))
    state = dict(model.state_dict())
    if dms.separate_alpha:
        if gates is None or len(gates) != layers or not all(isinstance(g, SeparateGate) for g in gates):
            raise ValueError("gates: separate NVIDIA gates need one SeparateGate per layer (thinkpool's adapter "
                             "gates read the input after the layer norm, which NVIDIA's do not)")
        dtype = next(model.parameters()).dtype
        for layer, gate in enumerate(gates):
            state[ALPHA.format(layer=layer, part="weight")] = gate.weight.detach().to(dtype).contiguous()
            state[ALPHA_NORM.format(layer=layer)] = gate.norm_weight.detach().to(dtype).contiguous()
            if gate.bias is not None or getattr(model.config, "attention_bias", False):
                bias = gate.bias if gate.bias is not None else torch.zeros(gate.weight.shape[0])
                state[ALPHA.format(layer=layer, part="bias")] = bias.detach().to(dtype).contiguous()
    elif gates is not None and not all(isinstance(g, QueryChannelGate) for g in gates):
        raise ValueError("gates: a repurposed NVIDIA gate is the model's own query channel; thinkpool's query_neuron "
                         "gate is a separate map (zeroed before q_norm, not after RoPE) and has no such export")
    model.save_pretrained(out_dir, state_dict=state)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.update(dms.config_fields())
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
