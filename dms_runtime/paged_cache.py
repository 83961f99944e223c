"""The engine's KV cache: per-row slot tables over a shared :class:`~dms_runtime.kv_pool.KVPool`.

Each row (a thread, or a prompt being prefilled) has, per layer and KV head, a table of the pool slots
holding its tokens, their positions and their eviction marks: the DMS cache of
:mod:`dms_runtime.cache`, with the K/V storage moved into the pool. So heads keep different numbers of
tokens, an evicted token's slot goes back to the pool at once (it is released before the step's new
tokens are allocated), and the threads of one problem reference the same prompt slots (reference counts
in the pool). Rows join (:meth:`PagedDMSCache.extend`) and leave (:meth:`PagedDMSCache.remove_rows`)
between steps: continuous batching. Rows whose gates never fire keep everything: the vanilla model.

Attention reads the gathered ``[rows, heads, table, head_dim]`` view of the pool, a step's workspace, not
cache memory: what the cache holds is the pool's slots in use.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from dms_runtime.cache import query_length
from dms_runtime.eviction import decided_marks, expired
from dms_runtime.kv_pool import KVPool

GROWTH = 32  # table columns added when a row's head has no free entry (amortises reallocation)


class PagedLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False

    def __init__(self, pool: KVPool, num_heads: int):
        super().__init__()
        self.pool = pool
        device = pool.keys.device
        self.table = torch.full((0, num_heads, 0), -1, dtype=torch.long, device=device)  # pool slot, -1 = empty
        self.pos = torch.full((0, num_heads, 0), -1, dtype=torch.long, device=device)
        self.evict = torch.zeros((0, num_heads, 0), dtype=torch.bool, device=device)
        self.length = torch.zeros(0, dtype=torch.long, device=device)  # tokens processed per row
        self.window = torch.zeros(0, dtype=torch.long, device=device)
        self.owner = torch.zeros(0, dtype=torch.long, device=device)  # per row: the task its new slots belong to
        self.zero_windows = 0  # rows with window 0: a token can expire in the step that decides it
        self.pending_logits: torch.Tensor | None = None
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    # -- rows ----------------------------------------------------------------------------------------
    def add_rows(self, windows: torch.Tensor, owners: torch.Tensor) -> None:
        count, heads = len(windows), self.table.shape[1]
        self.table = torch.cat([self.table, self.table.new_full((count, heads, self.table.shape[2]), -1)])
        self.pos = torch.cat([self.pos, self.pos.new_full((count, heads, self.pos.shape[2]), -1)])
        self.evict = torch.cat([self.evict, self.evict.new_zeros((count, heads, self.evict.shape[2]))])
        self.length = torch.cat([self.length, self.length.new_zeros(count)])
        self.owner = torch.cat([self.owner, owners.to(self.owner)])
        self._set_windows(torch.cat([self.window, windows.to(self.window)]))

    def extend(self, other: "PagedLayer", repeat: int, keep_source: bool = False) -> None:
        """Append ``other``'s rows ``repeat`` times each; the copies share (and reference) its slots. Unless
        ``keep_source``, the first copy takes over ``other``'s own reference (``other`` is then spent)."""
        width = max(self.table.shape[2], other.table.shape[2])
        self.pool.retain(other.table[other.table >= 0], repeat if keep_source else repeat - 1)
        for name, fill in (("table", -1), ("pos", -1), ("evict", False)):
            mine, theirs = _widen(getattr(self, name), width, fill), _widen(getattr(other, name), width, fill)
            setattr(self, name, torch.cat([mine, theirs.repeat_interleave(repeat, dim=0)]))
        self.length = torch.cat([self.length, other.length.repeat_interleave(repeat)])
        self.owner = torch.cat([self.owner, other.owner.repeat_interleave(repeat)])
        self._set_windows(torch.cat([self.window, other.window.repeat_interleave(repeat)]))

    def remove_rows(self, rows: list[int]) -> None:
        """Release the slots of ``rows`` and drop them; the other rows keep their order."""
        if not rows:
            return
        drop = torch.zeros(self.table.shape[0], dtype=torch.bool, device=self.table.device)
        drop[rows] = True
        gone = self.table[drop]
        self.pool.release(gone[gone >= 0])
        for name in ("table", "pos", "evict", "length", "owner"):
            setattr(self, name, getattr(self, name)[~drop])
        self._set_windows(self.window[~drop])
        self._trim()

    def _set_windows(self, windows: torch.Tensor) -> None:
        """Every row's window, and (kept beside it, so a decode step need not look) how many are 0."""
        self.window = windows
        self.zero_windows = int((windows == 0).sum())

    def _trim(self) -> None:
        """Drop the table columns past the last one in use: a long thread that left must not keep every
        later step gathering and masking its width."""
        live = (self.table >= 0).any(dim=1).any(dim=0)  # [columns]
        width = int(live.nonzero().max()) + 1 if bool(live.any()) else 0
        if width < self.table.shape[2]:
            self.table, self.pos, self.evict = self.table[:, :, :width], self.pos[:, :, :width], self.evict[:, :, :width]

    # -- the forward pass ----------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        rows, heads, q_len, dim = key_states.shape
        start = self.length
        if self.zero_windows:  # token start-1, decided now, may expire before the new tokens arrive
            self._apply_marks(start, q_len)
        self._release((self.table >= 0) & expired(self.evict, self.pos, start[:, None, None], self.window[:, None, None]))
        free = self.table < 0
        shortfall = q_len - int(free.sum(-1).min()) if free.numel() else q_len
        if shortfall > 0:
            width = self.table.shape[2] + max(shortfall, GROWTH)
            self.table, self.pos, self.evict = _widen(self.table, width, -1), _widen(self.pos, width, -1), _widen(self.evict, width, False)
            free = self.table < 0
        if q_len == 1:  # decoding: the first free entry of every head
            target = free.to(torch.uint8).argmax(-1, keepdim=True)
        else:
            columns = self.table.shape[2]
            order = torch.where(free, 0, columns) + torch.arange(columns, device=free.device)
            target = order.topk(q_len, dim=-1, largest=False).indices  # [rows, heads, q]: the lowest free entries
        owners = self.owner[:, None].expand(rows, heads * q_len).flatten()
        slots = self.pool.allocate(rows * heads * q_len, owners).view(rows, heads, q_len)
        self.pool.write(slots.flatten(), key_states.reshape(-1, dim), value_states.reshape(-1, value_states.shape[-1]))
        new_pos = start[:, None, None] + torch.arange(q_len, device=start.device)
        self.table.scatter_(2, target, slots)
        self.pos.scatter_(2, target, new_pos.expand(rows, heads, q_len))
        self.evict.scatter_(2, target, False)
        self._apply_marks(start, q_len)  # decides the new tokens but the last
        self.pending_logits = None
        self.query_pos = new_pos[:, 0, :]
        self.length = start + q_len
        index = self.table.clamp(min=0)
        shape = (*index.shape, dim)
        return self.pool.keys.index_select(0, index.flatten()).view(shape), self.pool.values.index_select(0, index.flatten()).view(shape)

    def _apply_marks(self, start: torch.Tensor, q_len: int) -> None:
        """Mark what this pass's gate logits decide (:func:`~dms_runtime.eviction.decided_marks`)."""
        if self.pending_logits is None:
            return
        if not bool((self.pending_logits > 0).any()):  # nothing marked (vanilla rows, or a quiet step)
            return
        self.evict |= decided_marks(self.pending_logits, 0.0, self.pos, self.table >= 0, start, q_len)

    def visibility(self) -> torch.Tensor:
        """``[rows, heads, q, table]``: which entries each new query sees; releases what none will see again."""
        query = self.query_pos[:, None, :, None]
        pos = self.pos[:, :, None, :]
        occupied = (self.table >= 0)[:, :, None, :]
        gone = expired(self.evict[:, :, None, :], pos, query, self.window[:, None, None, None])
        visible = occupied & (pos <= query) & ~gone
        self._release(occupied[:, :, 0] & gone[:, :, -1])
        return visible

    def _release(self, entries: torch.Tensor) -> None:
        if bool(entries.any()):
            self.pool.release(self.table[entries])
            self.table[entries] = -1

    # -- Cache API plumbing --------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return int(self.length.max()) if self.length.numel() else 0

    def get_mask_sizes(self, query: torch.Tensor | int) -> tuple[int, int]:
        return self.get_seq_length() + query_length(query), 0

    def get_max_length(self) -> int:  # newer transformers 5.x (5.17 has it)
        return -1

    get_max_cache_shape = get_max_length  # the pinned transformers (< 5.3)


def _widen(tensor: torch.Tensor, width: int, fill) -> torch.Tensor:
    if tensor.shape[2] >= width:
        return tensor
    pad = tensor.new_full((tensor.shape[0], tensor.shape[1], width - tensor.shape[2]), fill)
    return torch.cat([tensor, pad], dim=2)


class PagedDMSCache(Cache):
    """Rows of slot tables over one pool; pass as ``past_key_values`` with the engine's gate bank attached."""

    def __init__(self, pool: KVPool, num_layers: int, num_kv_heads: int):
        super().__init__(layers=[PagedLayer(pool, num_kv_heads) for _ in range(num_layers)])
        self.pool = pool

    @property
    def rows(self) -> int:
        return self.layers[0].table.shape[0]

    def add_rows(self, windows: list[int], owners: list[int] | None = None) -> None:
        """Empty rows (to prefill into); ``windows`` is each row's DMS window, ``owners`` the pool owner (task)
        that its slots are counted for (default 0)."""
        tensor = torch.tensor(windows, dtype=torch.long)
        owner = torch.tensor(owners if owners is not None else [0] * len(windows), dtype=torch.long)
        for layer in self.layers:
            layer.add_rows(tensor, owner)

    def extend(self, other: "PagedDMSCache", repeat: int = 1, keep_source: bool = False) -> None:
        """Take over ``other``'s rows, each repeated ``repeat`` times: ``other`` must not be used afterwards, unless
        ``keep_source`` (then it keeps its own reference to every slot: a task's held prompt)."""
        for mine, theirs in zip(self.layers, other.layers):
            mine.extend(theirs, repeat, keep_source)

    def remove_rows(self, rows: list[int]) -> None:
        for layer in self.layers:
            layer.remove_rows(rows)

    def set_gate_logits(self, layer_idx: int, logits: torch.Tensor) -> None:
        self.layers[layer_idx].pending_logits = logits

    def visibility(self, layer_idx: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.layers[layer_idx].visibility()

    def lengths(self) -> torch.Tensor:
        return self.layers[0].length

    def held_slots(self) -> torch.Tensor:
        """Per row: table entries in use summed over layers and heads (shared prompt slots count per row)."""
        return sum((layer.table >= 0).sum(dim=(1, 2)) for layer in self.layers)

    def memory_compression(self) -> torch.Tensor:
        """Per row: tokens processed x layers x KV heads / table entries held (what the row's memory shrank by)."""
        processed = self.layers[0].length.clamp(min=1).float() * len(self.layers) * self.layers[0].table.shape[1]
        return processed / self.held_slots().clamp(min=1).float()

    def kept_fractions(self, rows: list[int], prompt_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For ``rows``: of the tokens past the window, the fraction still held, all layers and heads pooled: among
        the first ``prompt_lengths`` tokens (the prompt) and among the rest (what the row generated). These are what
        an adapter's KV growth (:mod:`dms_runtime.kv_growth`) is measured from; rows with none past the window get 1."""
        prompt = prompt_lengths.to(self.layers[0].length.device)
        held = {"prompt": 0, "generated": 0}
        seen = {"prompt": 0, "generated": 0}
        for layer in self.layers:
            table, pos = layer.table[rows], layer.pos[rows]
            past = layer.length[rows] - layer.window[rows] - 1  # positions before this are past the window
            in_prompt = pos < prompt[:, None, None]
            old = (table >= 0) & (pos < past[:, None, None])
            held["prompt"] = held["prompt"] + (old & in_prompt).sum(dim=(1, 2))
            held["generated"] = held["generated"] + (old & ~in_prompt).sum(dim=(1, 2))
            seen["prompt"] = seen["prompt"] + table.shape[1] * torch.minimum(prompt, past).clamp(min=0)
            seen["generated"] = seen["generated"] + table.shape[1] * (past - prompt).clamp(min=0)
        return tuple(torch.where(seen[part] > 0, held[part] / seen[part].clamp(min=1), 1.0) for part in ("prompt", "generated"))

    def generated_kept_curve(self, rows: list[int], prompt_lengths: torch.Tensor, points: tuple[int, ...]) -> torch.Tensor:
        """For ``rows`` and each point ``p``: of the row's first ``p`` generated tokens, the fraction still held
        (layers and heads pooled); NaN where fewer than ``p`` of them have left the window.

        A token's fate is final once it leaves the window (marked tokens are gone, the others stay), so this is
        also what the row held of its own tokens back when it was ``p`` tokens past its window: the growth curve
        that a reservation at a short token limit reads (:mod:`dms_runtime.kv_growth`)."""
        prompt = prompt_lengths.to(self.layers[0].length.device)
        limits = torch.tensor(points, device=prompt.device)
        held = torch.zeros((len(rows), len(points)), device=prompt.device)
        for layer in self.layers:
            own = torch.where(layer.table[rows] >= 0, layer.pos[rows] - prompt[:, None, None], -1)[..., None]
            held = held + ((own >= 0) & (own < limits)).sum(dim=(1, 2)).float()
        first = self.layers[0]
        past = (first.length[rows] - first.window[rows] - 1 - prompt).clamp(min=0)
        seen = limits.float() * len(self.layers) * first.table.shape[1]
        return torch.where(past[:, None] >= limits, held / seen, torch.nan)

    def realized_compression(self) -> torch.Tensor:
        """Per row: tokens processed / tokens held, averaged over every layer's KV heads."""
        ratios = [layer.length[:, None].clamp(min=1).float() / (layer.table >= 0).sum(-1).clamp(min=1).float() for layer in self.layers]
        return torch.cat(ratios, dim=1).mean(dim=1)
