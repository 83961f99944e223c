"""Training-free KV eviction baselines as kvpress presses, applied while decoding and held to a ratio.

Every ``interval`` decoding steps (and right after the prefill) each layer's cache is cut back to
``ceil(tokens processed / compression)`` tokens per head, keeping the tokens a method scores highest:

* ``window``: the most recent tokens;
* ``streaming`` (StreamingLLM): the first ``sinks`` tokens plus the most recent ones;
* ``tova``: the current query's attention, averaged over heads (TOVA);
* ``h2o``: attention accumulated over every query so far (heavy hitters), half of the budget kept
  for the most recent tokens (H2O);
* ``knorm``: the smallest key norms;
* ``snapkv``: attention of the last ``window`` queries, average-pooled over neighbouring keys (SnapKV).

The newest token is always kept, and kept tokens stay in positional order, so recency-based scores
stay meaningful after many rounds. kvpress's own ``DecodingPress`` buffers hidden states without their
rotary positions and reorders kept keys by score, which breaks the positional methods; hence this press.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from kvpress.presses.base_press import BasePress, is_prefilling
from kvpress.utils import get_prerope_query_states
from torch import nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

BASELINES = ("window", "streaming", "tova", "h2o", "knorm", "snapkv")


@dataclass
class HeldRatioPress(BasePress):
    method: str = "tova"
    compression: float = 8.0
    interval: int = 8
    sinks: int = 4
    snap_window: int = 8
    snap_kernel: int = 5
    state: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.method not in BASELINES:
            raise ValueError(f"unknown baseline {self.method!r}; expected one of {', '.join(BASELINES)}")
        if self.compression < 1:
            raise ValueError(f"compression must be >= 1, got {self.compression}")

    def _attention(self, module: nn.Module, hidden: torch.Tensor, keys: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """Post-RoPE queries of the new tokens and their attention probabilities ``[B, Hq, q, L]``."""
        query = get_prerope_query_states(module, hidden)
        cos, sin = kwargs["position_embeddings"]
        query, _ = apply_rotary_pos_emb(query, query, cos, sin)
        groups = query.shape[1] // keys.shape[1]
        scores = torch.matmul(query, keys.repeat_interleave(groups, dim=1).transpose(-1, -2)) / math.sqrt(query.shape[-1])
        q_len, k_len = query.shape[2], keys.shape[2]
        future = torch.arange(k_len, device=keys.device)[None, :] > torch.arange(k_len - q_len, k_len, device=keys.device)[:, None]
        probs = torch.softmax(scores.float().masked_fill(future, float("-inf")), dim=-1)
        return query, probs

    @torch.no_grad()
    def forward_hook(self, module: nn.Module, input, kwargs: dict, output):
        layer = module.layer_idx
        hidden = kwargs["hidden_states"]
        cache_layer = kwargs["past_key_values"].layers[layer]
        keys, values = cache_layer.keys, cache_layer.values
        batch, heads, length, _ = keys.shape
        prefill = is_prefilling(kwargs["cache_position"], hidden.shape[1])
        if prefill:
            self.state[layer] = {"acc": keys.new_zeros(batch, heads, 0, dtype=torch.float32), "queries": None, "steps": 0}
        state = self.state[layer]
        query, probs = self._attention(module, hidden, keys, kwargs)
        per_head = probs.view(batch, heads, -1, *probs.shape[2:]).sum(dim=(2, 3))  # [B, H, L]
        state["acc"] = F.pad(state["acc"], (0, length - state["acc"].shape[-1])) + per_head
        recent = query[:, :, -self.snap_window :]
        state["queries"] = recent if state["queries"] is None else torch.cat([state["queries"], recent], 2)[:, :, -self.snap_window :]
        state["steps"] += 1
        processed = int(kwargs["position_ids"].max()) + 1
        target = max(1, math.ceil(processed / self.compression))
        if length > target and (prefill or state["steps"] % self.interval == 0):
            scores = self._scores(state, keys, probs)
            scores[..., -1] = float("inf")  # the newest token stays
            if self.method == "streaming":
                scores[..., : self.sinks] = float("inf")
            keep = scores.topk(target, dim=-1).indices.sort(dim=-1).values
            index = keep[..., None].expand(-1, -1, -1, keys.shape[-1])
            cache_layer.keys = keys.gather(2, index).contiguous()
            cache_layer.values = values.gather(2, index).contiguous()
            state["acc"] = state["acc"].gather(2, keep)
        return output

    def _scores(self, state: dict, keys: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        batch, heads, length, _ = keys.shape
        position = torch.arange(length, device=keys.device, dtype=torch.float32).expand(batch, heads, length).clone()
        if self.method in ("window", "streaming"):
            return position
        if self.method == "knorm":
            return -keys.float().norm(dim=-1)
        if self.method == "tova":
            return probs[:, :, -1].mean(dim=1, keepdim=True).expand(batch, heads, length).clone()
        if self.method == "h2o":
            # Half the budget for the most recent tokens, the rest by accumulated attention.
            scores = state["acc"].clone()
            target = max(1, math.ceil(length / self.compression))
            scores[..., -max(1, target // 2) :] = float("inf")
            return scores
        # snapkv: attention of the last queries, pooled over neighbouring keys.
        queries = state["queries"]
        groups = queries.shape[1] // heads
        logits = torch.matmul(queries, keys.repeat_interleave(groups, dim=1).transpose(-1, -2)) / math.sqrt(queries.shape[-1])
        attention = torch.softmax(logits.float(), dim=-1).mean(dim=2)  # [B, Hq, L]
        attention = attention.view(batch, heads, groups, length).mean(dim=2)
        return F.avg_pool1d(attention, self.snap_kernel, padding=self.snap_kernel // 2, stride=1)
