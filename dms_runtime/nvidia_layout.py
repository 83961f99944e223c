"""NVIDIA's DMS checkpoint layout (Model-Optimizer ``experimental/dms``, ``nvidia/Qwen3-8B-DMS-8x``), served as it is.

Such a directory is a plain Qwen3 (or Llama) checkpoint whose ``config.json`` adds ``dms_*`` fields and, for
separate gates, whose weights add two tensors per layer. Transformers loads it as the plain model (the extra
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

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F

from dms_runtime.attach import DMSHandle, attention_modules
from dms_runtime.config import DMSConfig
from dms_runtime.gate_bank import NEVER, NO_GATE, AdapterSet
from dms_runtime.kv_growth import KVGrowth

FIELDS = ("dms_alpha_scale", "dms_initial_alpha_offset", "dms_window_size", "dms_paged_attention_block_size",
          "dms_cr", "dms_separate_alpha", "dms_alpha_per", "dms_disable_eviction")
ALPHA = "model.layers.{layer}.self_attn.dms_proj_alpha.{part}"
ALPHA_NORM = "model.layers.{layer}.self_attn.dms_proj_alpha_norm.weight"


@dataclass(frozen=True)
class NvidiaDMSConfig:
    """The ``dms_*`` fields of an NVIDIA-layout ``config.json`` (defaults: NVIDIA's ``Qwen3ConfigDMS``)."""

    alpha_scale: float = 100.0
    initial_alpha_offset: float = 5.0
    window_size: int = 512
    block_size: int = 256  # dms_paged_attention_block_size: NVIDIA's kernel's business, checked as they do
    cr: float = 8.0
    separate_alpha: bool = False
    alpha_per: str = "head"
    disable_eviction: bool = False

    def __post_init__(self) -> None:
        numbers = (("dms_alpha_scale", self.alpha_scale), ("dms_initial_alpha_offset", self.initial_alpha_offset))
        for name, value in numbers:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}: must be a finite number, got {value!r}")
        for name, value in (("dms_window_size", self.window_size), ("dms_paged_attention_block_size", self.block_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: must be an integer, got {value!r}")
        if self.block_size <= 0:
            raise ValueError(f"dms_paged_attention_block_size: must be > 0, got {self.block_size}")
        if self.window_size <= self.block_size:
            raise ValueError(f"dms_window_size: {self.window_size} must be larger than dms_paged_attention_block_size "
                             f"({self.block_size})")
        if self.alpha_per not in ("head", "layer"):
            raise ValueError(f"dms_alpha_per: must be 'head' or 'layer', got {self.alpha_per!r}")
        if isinstance(self.cr, bool) or not isinstance(self.cr, (int, float)) or not self.cr > 1:
            raise ValueError(f"dms_cr: must be a number > 1 (the ratio the gates are served as), got {self.cr!r}")
        flags = (("dms_separate_alpha", self.separate_alpha), ("dms_disable_eviction", self.disable_eviction))
        for name, value in flags:
            if not isinstance(value, bool):
                raise ValueError(f"{name}: must be true or false, got {value!r}")

    @property
    def per_head(self) -> bool:
        return self.alpha_per == "head"

    @property
    def dms_config(self) -> DMSConfig:
        """The same gates in thinkpool's terms (the window, the scale, the offset; threshold 0)."""
        return DMSConfig(parametrization="nvidia_separate" if self.separate_alpha else "query_neuron",
                         per_head=self.per_head,
                         window=self.window_size, logit_scale=float(self.alpha_scale),
                         init_offset=-float(self.initial_alpha_offset))

    def config_fields(self) -> dict:
        """The ``dms_*`` entries of ``config.json``."""
        values = (self.alpha_scale, self.initial_alpha_offset, self.window_size, self.block_size, self.cr,
                  self.separate_alpha, self.alpha_per, self.disable_eviction)
        return dict(zip(FIELDS, values))


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


# -- the gate formula ---------------------------------------------------------------------------------------
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Qwen3's and Llama's RMSNorm compute it: float32 statistics, the weight applied in the input's dtype."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _separate_raw(layer_input: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, eps: float, decisions: int) -> torch.Tensor:
    """``[B, T, decisions]``: ``dms_proj_alpha(dms_proj_alpha_norm(layer_input))`` for the first ``decisions`` heads."""
    x = _rms_norm(layer_input, norm_weight.to(layer_input.dtype), eps)
    return F.linear(x, weight[:decisions].to(x.dtype), None if bias is None else bias[:decisions].to(x.dtype))


def _query_raw(attention_input: torch.Tensor, q_weight: torch.Tensor, q_bias: torch.Tensor | None,
               q_norm_weight: torch.Tensor | None, num_heads: int, num_kv_heads: int, eps: float,
               decisions: int) -> torch.Tensor:
    """``[B, T, decisions]``: channel -1 of the (normalised) pre-RoPE query of the first head of each KV group, for
    the first ``decisions`` groups: only those heads' rows of the projection are computed."""
    hidden = attention_input.shape[-1]
    head_dim = q_weight.shape[0] // num_heads
    rows = q_weight.view(num_kv_heads, num_heads // num_kv_heads, head_dim, hidden)[:decisions, 0]  # [n, D, hidden]
    x = attention_input.reshape(1, -1, hidden)
    query = torch.matmul(x, rows.transpose(-1, -2).to(x.dtype))  # [n, B*T, D]
    if q_bias is not None:
        query = query + q_bias.view(num_kv_heads, -1, head_dim)[:decisions, 0, None, :].to(query.dtype)
    if q_norm_weight is not None:
        query = _rms_norm(query, q_norm_weight.to(query.dtype), eps)
    return query[..., -1].transpose(0, 1).reshape(*attention_input.shape[:-1], decisions)


def _logits(raw: torch.Tensor, dms: NvidiaDMSConfig) -> torch.Tensor:
    return raw.float() * float(dms.alpha_scale) - float(dms.initial_alpha_offset)


def gate_logits(layer: Mapping[str, torch.Tensor], layer_input: torch.Tensor, dms: NvidiaDMSConfig,
                model_config) -> torch.Tensor:
    """Eviction logits ``[B, T, decisions]`` (evict where > 0; decisions: KV heads, or 1 per layer) straight from a
    decoder layer's tensors, named as in its ``state_dict`` (``input_layernorm.weight``, ``self_attn.q_proj.weight``,
    ``self_attn.dms_proj_alpha.weight``...), and the layer's input ``[B, T, hidden]`` (before its input norm)."""
    c = model_config
    decisions = c.num_key_value_heads if dms.per_head else 1
    if dms.separate_alpha:
        raw = _separate_raw(layer_input, layer["self_attn.dms_proj_alpha_norm.weight"],
                            layer["self_attn.dms_proj_alpha.weight"], layer.get("self_attn.dms_proj_alpha.bias"),
                            c.rms_norm_eps, decisions)
    else:
        attention_input = _rms_norm(layer_input, layer["input_layernorm.weight"], c.rms_norm_eps)
        raw = _query_raw(attention_input, layer["self_attn.q_proj.weight"], layer.get("self_attn.q_proj.bias"),
                         layer.get("self_attn.q_norm.weight"), c.num_attention_heads, c.num_key_value_heads,
                         c.rms_norm_eps, decisions)
    return _logits(raw, dms)


# -- gate modules: what a DMSHandle or an AdapterSet attaches -------------------------------------------------
class _NvidiaGate(nn.Module):
    """Shared by both kinds: logits for the rows of a batch, rows without a gate (``row_adapter == NO_GATE``, the
    engine's cr 1) never evict. ``query_channels`` is empty: the repurposed channel is zeroed by the model itself
    (:func:`zero_repurposed_queries`), at every ratio."""

    def __init__(self, dms: NvidiaDMSConfig, decisions: int):
        super().__init__()
        self.dms, self.decisions = dms, decisions
        self.query_channels: list[int] = []
        self.row_adapter: torch.Tensor | None = None  # set by AdapterSet.set_rows; None: every row is gated

    def _rows(self, logits: torch.Tensor) -> torch.Tensor:
        if self.row_adapter is None or not len(self.row_adapter):
            return logits
        index = self.row_adapter.to(logits.device)
        if len(index) != logits.shape[0]:
            raise ValueError(f"gate has adapters for {len(index)} rows, the batch has {logits.shape[0]}")
        return logits.masked_fill((index == NO_GATE)[:, None, None], NEVER)


class SeparateGate(_NvidiaGate):
    """``dms_proj_alpha(dms_proj_alpha_norm(x))`` of the layer input ``x`` before the input norm: a forward pre-hook
    on the layer's ``input_layernorm`` hands it over (any :class:`DMSHandle` installs it for a gate that
    ``reads_layer_input``), since the attention module, where DMS gates run, only sees the normalised input.

    ``config`` is the same gate in thinkpool's terms (parametrization ``nvidia_separate``); setting it moves the scale
    and offset, as a retrofit's calibration does."""

    reads_layer_input = True

    def __init__(self, hidden_size: int, num_kv_heads: int, dms: NvidiaDMSConfig, eps: float, bias: bool = False):
        super().__init__(dms, num_kv_heads if dms.per_head else 1)
        self.weight = nn.Parameter(torch.zeros(num_kv_heads, hidden_size))  # zero: every logit is -offset, keep all
        self.bias = nn.Parameter(torch.zeros(num_kv_heads)) if bias else None
        self.norm_weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.layer_input: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x, self.layer_input = self.layer_input, None
        if x is None:
            raise RuntimeError("a separate NVIDIA gate needs its layer's input before the input norm: attach it with "
                               "NvidiaGateHandle (or NvidiaAdapterSet), which hands it over")
        raw = _separate_raw(x, self.norm_weight, self.weight, self.bias, self.eps, self.decisions)
        return self._rows(_logits(raw, self.dms))

    @property
    def config(self) -> DMSConfig:
        return self.dms.dms_config

    @config.setter
    def config(self, config: DMSConfig) -> None:
        self.dms = dataclasses.replace(self.dms, alpha_scale=float(config.logit_scale),
                                       initial_alpha_offset=-float(config.init_offset))


class QueryChannelGate(_NvidiaGate):
    """The repurposed query channel, read from the attention module's own ``q_proj`` (and ``q_norm``): nothing is
    stored, the weights are the model's."""

    def __init__(self, attention: nn.Module, num_heads: int, num_kv_heads: int, dms: NvidiaDMSConfig, eps: float):
        super().__init__(dms, num_kv_heads if dms.per_head else 1)
        object.__setattr__(self, "attention", attention)  # not a submodule: its weights must not become the gate's
        self.num_heads, self.num_kv_heads, self.eps = num_heads, num_kv_heads, eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        attention = self.attention
        q_norm = getattr(attention, "q_norm", None)
        raw = _query_raw(hidden, attention.q_proj.weight, attention.q_proj.bias,
                         None if q_norm is None else q_norm.weight, self.num_heads, self.num_kv_heads, self.eps,
                         self.decisions)
        return self._rows(_logits(raw, self.dms))


def zero_repurposed_queries(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Zero channel -1 of the first query head of each KV group in every layer, before RoPE (a hook on ``q_norm``,
    or on ``q_proj`` for models without one) and after (``dms_attention`` reads ``zeroed_query_heads``), and switch
    the model to the ``"dms"`` attention, which a DMS handle restores when it detaches."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    heads = list(range(0, c.num_attention_heads, c.num_attention_heads // c.num_key_value_heads))
    hooks = []
    for attention in attention_modules(model):
        attention.zeroed_query_heads = heads
        if getattr(attention, "q_norm", None) is not None:
            hooks.append(attention.q_norm.register_forward_hook(_zero_channels((..., heads, head_dim - 1))))
        else:
            channels = [h * head_dim + head_dim - 1 for h in heads]
            hooks.append(attention.q_proj.register_forward_hook(_zero_channels((..., channels))))
    model.set_attn_implementation("dms")
    return hooks


def _zero_channels(index):
    def hook(module, args, output):
        output = output.clone()
        output[index] = 0
        return output

    return hook


def build_gates(model: nn.Module, dms: NvidiaDMSConfig,
                tensors: Mapping[str, torch.Tensor] | None = None) -> nn.ModuleList:
    """One gate per decoder layer: separate gates filled from ``tensors`` (NVIDIA's names; untrained, keep-all gates
    without them: what a retrofit in this layout starts from), or the model's repurposed query channels."""
    c = model.config
    modules = attention_modules(model)
    if not dms.separate_alpha:
        return nn.ModuleList(QueryChannelGate(m, c.num_attention_heads, c.num_key_value_heads, dms, c.rms_norm_eps)
                             for m in modules)
    gates = nn.ModuleList()
    for layer in range(len(modules)):
        bias_name = ALPHA.format(layer=layer, part="bias")
        bias = bool(getattr(c, "attention_bias", False)) or (tensors is not None and bias_name in tensors)
        gate = SeparateGate(c.hidden_size, c.num_key_value_heads, dms, c.rms_norm_eps, bias=bias)
        if tensors is not None:
            with torch.no_grad():
                gate.weight.copy_(_tensor(tensors, ALPHA.format(layer=layer, part="weight"), gate.weight.shape))
                gate.norm_weight.copy_(_tensor(tensors, ALPHA_NORM.format(layer=layer), gate.norm_weight.shape))
                if gate.bias is not None:
                    gate.bias.copy_(_tensor(tensors, bias_name, gate.bias.shape))
        gates.append(gate)
    parameter = next(model.parameters())
    return gates.to(parameter.device)


def export_block_size(window: int) -> int:
    """NVIDIA's paged-attention block for gates of ``window``: the largest power of two below the window, at most 256
    (its default); its code refuses a window that is not larger than the block."""
    if window < 2:
        raise ValueError(f"window: NVIDIA's layout needs a window larger than its paged block (at least 2), "
                         f"got {window}")
    return min(256, 1 << ((window - 1).bit_length() - 1))


def separate_config(config: DMSConfig, cr: float = NvidiaDMSConfig.cr,
                    block_size: int | None = None) -> NvidiaDMSConfig:
    """NVIDIA's settings for separate gates of thinkpool's ``config`` (``nvidia_separate``), served as ``cr``; the
    block size defaults to :func:`export_block_size`."""
    return NvidiaDMSConfig(alpha_scale=float(config.logit_scale), initial_alpha_offset=-float(config.init_offset),
                           window_size=config.window, block_size=block_size or export_block_size(config.window), cr=cr,
                           separate_alpha=True, alpha_per="head" if config.per_head else "layer")


def _tensor(tensors: Mapping[str, torch.Tensor], name: str, shape: torch.Size) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"{name}: missing from the checkpoint (dms_separate_alpha is true)")
    if tuple(tensors[name].shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(tensors[name].shape)}, expected {tuple(shape)}")
    return tensors[name].float()


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
