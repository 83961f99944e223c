"""Eviction gates: one eviction logit per token and per KV head (or per layer), from the attention input.

Two parametrizations, as in the DMS paper and its reference code:

* ``adapter``: a separate linear map hidden -> decisions behind its own RMSNorm; the base model is untouched.
* ``query_neuron``: one channel of the query projection (the last channel of the first query head of each
  KV group) is repurposed: its value is the logit, and the channel is zeroed before attention.

A third, ``nvidia_separate``, is NVIDIA's own separate gate (``dms_runtime.nvidia_gates.SeparateGate``): like
``adapter`` but reading the layer's input before its input norm, and exportable in NVIDIA's layout.

Either way the gate sees the hidden state at position ``t`` and decides about the token at ``t - 1``
(the one-position shift): the decision about a token is made once the model has seen what follows it.
"""

from __future__ import annotations

import torch
from torch import nn

from dms_runtime import nvidia_gates
from dms_runtime.config import DMSConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class EvictionGate(nn.Module):
    """Logits ``[batch, seq, decisions]`` from the attention input ``[batch, seq, hidden]``.

    ``decisions`` is the number of KV heads (per-head decisions) or 1 (one decision per layer).
    ``query_channels`` lists, for ``query_neuron``, the query-projection output channels to zero.
    """

    def __init__(self, hidden_size: int, decisions: int, config: DMSConfig, query_channels: list[int] | None = None):
        super().__init__()
        self.config = config
        self.norm = RMSNorm(hidden_size) if config.parametrization == "adapter" else None
        # Zero-initialised: every logit starts at init_offset, i.e. "keep everything".
        self.weight = nn.Parameter(torch.zeros(decisions, hidden_size))
        self.query_channels = list(query_channels or [])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.norm(hidden) if self.norm is not None else hidden
        logits = nn.functional.linear(x.float(), self.weight.float())
        return self.config.logit_scale * logits + self.config.init_offset


def query_channels_for(num_heads: int, num_kv_heads: int, head_dim: int, per_head: bool) -> list[int]:
    """The repurposed query channel of each KV group: the last channel of the group's first query head."""
    group = num_heads // num_kv_heads
    heads = [g * group for g in range(num_kv_heads)] if per_head else [0]
    return [h * head_dim + head_dim - 1 for h in heads]


def build_gates(model: nn.Module, config: DMSConfig) -> nn.ModuleList:
    """One untrained gate per decoder layer of a Hugging Face Llama/Qwen3-style model."""
    if config.parametrization == "nvidia_separate":
        return nvidia_gates.build_gates(model, nvidia_gates.separate_config(config))
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    decisions = c.num_key_value_heads if config.per_head else 1
    channels = None
    if config.parametrization == "query_neuron":
        channels = query_channels_for(c.num_attention_heads, c.num_key_value_heads, head_dim, config.per_head)
    return nn.ModuleList(EvictionGate(c.hidden_size, decisions, config, channels) for _ in range(c.num_hidden_layers))
