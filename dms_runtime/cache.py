"""A transformers Cache whose memory is slots: evicted tokens free their slot, and new tokens reuse it.

Every layer stores keys and values as ``[batch, kv_heads, slots, head_dim]`` plus, per slot, the logical
index of the token in it (``-1`` = free) and its eviction mark. Each KV head keeps its own set of tokens,
so heads hold different numbers of tokens (variable length per head). A marked token stays visible to
queries at most ``window`` positions after it; once no future query can see it, its slot is freed and
the next token written to that head takes it. Capacity grows only when a head has no free slot, so the
bytes allocated follow the tokens really held, not the tokens processed.

With no gate logits (eviction switched off) every token is kept and attention is the vanilla model's.
Prefill is sparse by default (as in training: a marked prompt token leaves later prompt queries' view);
``dense_prefill=True`` lets the prompt attend to all of itself, as kvpress presses do.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from dms_runtime.eviction import decided_marks, expired

GROWTH = 64  # slots added per head when a layer runs out (amortises reallocation)


def query_length(query: torch.Tensor | int) -> int:
    """The new tokens a layer's ``get_mask_sizes`` is asked about: transformers < 5.3 passes ``cache_position``,
    later versions the query length itself."""
    return query if isinstance(query, int) else query.shape[0]


class DMSLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False

    def __init__(self, window: int, threshold: float = 0.0, dense_prefill: bool = False):
        super().__init__()
        self.window = window
        self.threshold = threshold
        self.dense_prefill = dense_prefill
        self.pending_logits: torch.Tensor | None = None
        self.peak_slots_held = 0

    # -- storage -------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(batch, heads, 0, dim)
        self.values = value_states.new_zeros(batch, heads, 0, value_states.shape[-1])
        self.pos = torch.full((batch, heads, 0), -1, dtype=torch.long, device=self.device)
        self.evict = torch.zeros((batch, heads, 0), dtype=torch.bool, device=self.device)
        self.length = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.padding = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def _grow(self, extra: int) -> None:
        batch, heads, _, dim = self.keys.shape
        self.keys = torch.cat([self.keys, self.keys.new_zeros(batch, heads, extra, dim)], dim=2)
        self.values = torch.cat([self.values, self.values.new_zeros(batch, heads, extra, self.values.shape[-1])], dim=2)
        self.pos = torch.cat([self.pos, self.pos.new_full((batch, heads, extra), -1)], dim=2)
        self.evict = torch.cat([self.evict, self.evict.new_zeros(batch, heads, extra)], dim=2)

    def update(self, key_states, value_states, *args: Any, **kwargs: Any):  # cache kwargs, however named, are unused
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, q_len, dim = key_states.shape
        free = self.pos < 0
        shortfall = q_len - int(free.sum(-1).min()) if free.numel() else q_len
        if shortfall > 0:
            self._grow(max(shortfall, GROWTH))
            free = self.pos < 0
        slots = self.pos.shape[-1]
        # The first q_len free slots of every head, lowest index first.
        order = torch.where(free, 0, slots) + torch.arange(slots, device=self.device)
        target = order.topk(q_len, dim=-1, largest=False).indices  # [B, H, q]
        start = self.length
        new_pos = start[:, None, None] + torch.arange(q_len, device=self.device)
        self.keys.scatter_(2, target[..., None].expand(-1, -1, -1, dim), key_states.to(self.keys.dtype))
        self.values.scatter_(2, target[..., None].expand(-1, -1, -1, self.values.shape[-1]), value_states.to(self.values.dtype))
        self.pos.scatter_(2, target, new_pos.expand(batch, heads, q_len))
        self.evict.scatter_(2, target, False)
        self._apply_decisions(start, q_len)
        self.length = start + q_len
        self.query_pos = new_pos[:, 0, :]  # [B, q]
        self.peak_slots_held = max(self.peak_slots_held, int((self.pos >= 0).sum()))
        return self.keys, self.values

    def _apply_decisions(self, start: torch.Tensor, q_len: int) -> None:
        """Mark what the pending gate logits decide (:func:`~dms_runtime.eviction.decided_marks`)."""
        if self.pending_logits is None:
            return
        self.evict |= decided_marks(self.pending_logits, self.threshold, self.pos, self.pos >= 0, start, q_len)
        self.pending_logits = None

    # -- attention -----------------------------------------------------------------------------------
    def visibility(self, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """``[B, H, q, slots]``: which slot each new query may attend to; frees slots no future query can see."""
        query = self.query_pos[:, None, :, None]
        pos = self.pos[:, :, None, :]
        gone = expired(self.evict[:, :, None, :], pos, query, self.window)
        prefill = int(self.length.max()) == query.shape[2]
        visible = (pos >= 0) & (pos <= query)
        if attention_mask is not None:
            mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask > -1e4
            batch, heads, q_len, slots = visible.shape
            mask = mask.expand(batch, heads, q_len, mask.shape[-1])
            columns = self.pos.clamp(min=0)[:, :, None, :].expand(-1, -1, q_len, -1)
            visible &= mask.gather(3, columns.clamp(max=mask.shape[-1] - 1))
            if prefill:  # count the left padding once
                self.padding = (~mask[:, 0, -1, :]).sum(-1)
        # Visibility only shrinks for later queries: what the newest query cannot see is gone for good.
        self.pos.masked_fill_(~(visible & ~gone)[:, :, -1, :] & (self.pos >= 0), -1)
        if self.dense_prefill and prefill:
            return visible  # the prompt attends densely; evictions apply from the first generated token on
        return visible & ~gone

    # -- Cache API plumbing --------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return int(self.length.max()) if self.is_initialized and self.length.numel() else 0

    def get_mask_sizes(self, query: torch.Tensor | int) -> tuple[int, int]:
        return self.get_seq_length() + query_length(query), 0

    def get_max_length(self) -> int:  # newer transformers 5.x (5.17 has it)
        return -1

    get_max_cache_shape = get_max_length  # the pinned transformers (< 5.3)

    def held_tokens(self) -> torch.Tensor:
        """Tokens held per row and head: ``[B, H]``."""
        return (self.pos >= 0).sum(-1)

    def _select(self, fn) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "pos", "evict", "length", "padding"):
                setattr(self, name, fn(getattr(self, name)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a DMS cache cannot be cropped: evicted tokens are gone")


class DMSCache(Cache):
    """The transformers Cache for DMS inference; pass it as ``past_key_values`` to ``generate`` or ``forward``."""

    def __init__(self, num_layers: int, window: int = 16, threshold: float = 0.0, dense_prefill: bool = False):
        super().__init__(layers=[DMSLayer(window, threshold, dense_prefill) for _ in range(num_layers)])
        self.window = window

    @classmethod
    def for_model(cls, model, window: int = 16, threshold: float = 0.0, dense_prefill: bool = False) -> "DMSCache":
        return cls(model.config.num_hidden_layers, window, threshold, dense_prefill)

    def set_gate_logits(self, layer_idx: int, logits: torch.Tensor) -> None:
        self.layers[layer_idx].pending_logits = logits

    def visibility(self, layer_idx: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return self.layers[layer_idx].visibility(attention_mask)

    def _head_token_bytes(self, layer: DMSLayer) -> int:
        return (layer.keys.shape[-1] + layer.values.shape[-1]) * layer.keys.element_size()

    def bytes_held(self) -> int:
        """Bytes of K and V in occupied slots, all layers: what the cache really needs now."""
        return sum(int(l.held_tokens().sum()) * self._head_token_bytes(l) for l in self.layers if l.is_initialized)

    def bytes_allocated(self) -> int:
        return sum(l.keys.nbytes + l.values.nbytes for l in self.layers if l.is_initialized)

    def peak_bytes_held(self) -> int:
        """Upper bound of the largest ``bytes_held`` so far (per-layer peaks added up)."""
        return sum(l.peak_slots_held * self._head_token_bytes(l) for l in self.layers if l.is_initialized)

    def realized_compression(self) -> torch.Tensor:
        """Per row: tokens processed / tokens held, averaged over every layer's KV heads."""
        ratios = []
        for layer in self.layers:
            if layer.is_initialized:
                processed = (layer.length - layer.padding).clamp(min=1)[:, None].float()
                ratios.append(processed / layer.held_tokens().clamp(min=1).float())
        return torch.cat(ratios, dim=1).mean(dim=1)
