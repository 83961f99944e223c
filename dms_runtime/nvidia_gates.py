"""NVIDIA's DMS gates (Model-Optimizer ``experimental/dms``): their settings, the formula, and the gate modules.

Two kinds, as ``nvidia/Qwen3-8B-DMS-8x`` and its siblings have them:

* separate gates (``dms_separate_alpha``): ``dms_proj_alpha`` (``[KV heads, hidden]``, a bias when
  ``attention_bias``) behind its own RMSNorm ``dms_proj_alpha_norm``, reading the layer's input *before* its input
  norm (thinkpool's ``adapter`` gates read it after). A retrofit trains this kind as ``nvidia_separate``;
* repurposed gates: channel -1 of the normalised, pre-RoPE query of the first query head of each KV group. That
  channel is zero in the query attention sees, before and after RoPE, at every ratio (the weights were trained
  so); the gate reads it from the model's own projection.

Logit = raw x ``dms_alpha_scale`` - ``dms_initial_alpha_offset``; a token is evicted where the logit is > 0, per
KV head or (``dms_alpha_per: layer``) head 0's decision for the layer. Reading and writing the checkpoint layout
these gates come in is :mod:`dms_runtime.nvidia_layout`'s job.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dms_runtime.attach import attention_modules
from dms_runtime.config import NEVER, NO_GATE, DMSConfig

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
