"""The engine's KV cache: rows of packed slot lines (:mod:`dms_runtime.paged_layer`) over a shared
:class:`~dms_runtime.kv_pool.KVPool`.

Each row (a thread, or a prompt being prefilled) has, per layer and KV head, a line of the pool slots holding its
tokens: the DMS cache of :mod:`dms_runtime.cache`, with the K/V storage moved into the pool. So heads keep different
numbers of tokens, an evicted token's slot goes back to the pool at once (it is released before the step's new tokens
are allocated), and the threads of one problem reference the same prompt slots (reference counts in the pool). Rows
join (:meth:`PagedDMSCache.extend`) and leave (:meth:`PagedDMSCache.remove_rows`) between steps: continuous
batching. Rows whose gates never fire keep everything: the vanilla model.

Attention (:meth:`PagedDMSCache.attend`, called by :func:`~dms_runtime.attention.dms_attention`): a decode step reads
the pool through each line (on a GPU the Triton kernel of :mod:`dms_runtime.decode_attention`: only what each head
holds, no dense workspace and no mask; on the CPU its fused-SDPA path over lines gathered up to the longest); a
prefill chunk runs SDPA over its gathered view with the delayed-eviction mask. What
the cache holds is the pool's slots in use.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from dms_runtime.attention import grouped_sdpa
from dms_runtime.decode_attention import decode_attention, decode_attention_sdpa
from dms_runtime.kv_pool import KVPool
from dms_runtime.paged_layer import PagedLayer


class PagedDMSCache(Cache):
    """Rows of slot lines over one pool; pass as ``past_key_values`` with the engine's gate bank attached."""

    use_triton: bool | None = None  # decode attention: None picks (Triton on CUDA, fused SDPA on the CPU); True forces
    # the kernel (on the CPU under TRITON_INTERPRET=1: the tests' way to run the engine through it)

    def __init__(self, pool: KVPool, num_layers: int, num_kv_heads: int):
        super().__init__(layers=[PagedLayer(pool, num_kv_heads) for _ in range(num_layers)])
        self.pool = pool
        self.static_bounds = False  # the decode kernel bounded by the table's width, not the widest line: what a
        # captured CUDA graph needs (its launches are fixed while lines grow)

    @property
    def rows(self) -> int:
        return len(self.layers[0].count)

    def add_rows(self, windows: list[int], owners: list[int] | None = None) -> None:
        """Empty rows (to prefill into); ``windows`` is each row's DMS window, ``owners`` the pool owner (task)
        that its slots are counted for (default 0)."""
        device = self.pool.keys.device
        tensor = torch.tensor(windows, dtype=torch.long, device=device)
        owner = torch.tensor(owners if owners is not None else [0] * len(windows), dtype=torch.long, device=device)
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

    def set_evicting(self, evicting: bool) -> None:
        """Whether any row of the coming passes may mark tokens (a host fact: the rows' ratios); with none, a pass
        skips deciding and releasing."""
        for layer in self.layers:
            layer.evicting = evicting

    def set_gate_logits(self, layer_idx: int, logits: torch.Tensor) -> None:
        self.layers[layer_idx].pending_logits = logits

    # -- attention -----------------------------------------------------------------------------------------------
    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        """``[rows, q, heads, dim]``: the attention of ``query [rows, heads, q, dim]`` over what each row's heads hold
        (``key``/``value``: what :meth:`PagedLayer.update` returned for this pass)."""
        layer = self.layers[layer_idx]
        rows, heads, q_len, dim = query.shape
        scale = scaling if scaling is not None else dim**-0.5
        if q_len > 1:
            return grouped_sdpa(query, key, value, layer.chunk_mask, scale)
        args = (query[:, :, 0], self.pool.keys, self.pool.values, layer.table, layer.count, scale)
        bound = layer.width if self.static_bounds else min(layer.widest, layer.width)
        if self.use_triton is None and query.device.type == "cpu":
            out = decode_attention_sdpa(*args, max_length=bound)
        else:
            out = decode_attention(*args, max_length=bound, use_triton=self.use_triton)
        return out.view(rows, 1, heads, dim)

    def visibility(self, layer_idx: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """The last prefill chunk's mask ``[rows, heads, q, width]`` (decoding needs none)."""
        return self.layers[layer_idx].chunk_mask

    # -- what the host reads -------------------------------------------------------------------------------------
    def lengths(self) -> torch.Tensor:
        return self.layers[0].length

    def widest_lines(self) -> torch.Tensor:
        """``[layers]`` on the device: each layer's longest line, for the engine to read with a step's tokens."""
        if not self.rows:
            return torch.zeros(len(self.layers), dtype=torch.long, device=self.pool.keys.device)
        return torch.stack([layer.count.amax() for layer in self.layers])

    def host_step(self) -> None:
        """A decode step ran on the device without this object (a replayed CUDA graph): what it changes on the host."""
        for layer in self.layers:
            layer.host_step(1)
        self.pool.handed_out(self.rows * self.layers[0].table.shape[1] * len(self.layers))

    def observe_widest(self, widest: list[int]) -> None:
        for layer, value in zip(self.layers, widest):
            layer.observe_widest(value)

    def held_slots(self) -> torch.Tensor:
        """Per row: entries held summed over layers and heads (shared prompt slots count per row)."""
        return sum(layer.count.sum(dim=1) for layer in self.layers)

    def memory_compression(self) -> torch.Tensor:
        """Per row: tokens processed x layers x KV heads / entries held (what the row's memory shrank by)."""
        first = self.layers[0]
        processed = first.length.clamp(min=1).float() * len(self.layers) * first.count.shape[1]
        return processed / self.held_slots().clamp(min=1).float()

    def realized_compression(self) -> torch.Tensor:
        """Per row: tokens processed / tokens held, averaged over every layer's KV heads."""
        ratios = [layer.length[:, None].clamp(min=1).float() / layer.count.clamp(min=1).float()
                  for layer in self.layers]
        return torch.cat(ratios, dim=1).mean(dim=1)

    def kept_fractions(self, rows: list[int], prompt_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For ``rows``: of the tokens past the window, the fraction still held, all layers and heads pooled: among
        the first ``prompt_lengths`` tokens (the prompt) and among the rest (what the row generated). These are what
        an adapter's KV growth (:mod:`dms_runtime.kv_growth`) is measured from; rows with none past the window get 1."""
        index = torch.tensor(rows, dtype=torch.long, device=self.pool.keys.device)
        prompt = prompt_lengths.to(index.device)
        held = {"prompt": 0, "generated": 0}
        seen = {"prompt": 0, "generated": 0}
        for layer in self.layers:
            pos, occupied = layer.pos.index_select(0, index), layer.occupied().index_select(0, index)
            past = layer.length[index] - layer.window[index] - 1  # positions before this are past the window
            in_prompt = pos < prompt[:, None, None]
            old = occupied & (pos < past[:, None, None])
            held["prompt"] = held["prompt"] + (old & in_prompt).sum(dim=(1, 2))
            held["generated"] = held["generated"] + (old & ~in_prompt).sum(dim=(1, 2))
            heads = pos.shape[1]
            seen["prompt"] = seen["prompt"] + heads * torch.minimum(prompt, past).clamp(min=0)
            seen["generated"] = seen["generated"] + heads * (past - prompt).clamp(min=0)
        return tuple(torch.where(seen[part] > 0, held[part] / seen[part].clamp(min=1), 1.0) for part in ("prompt", "generated"))

    def generated_kept_curve(self, rows: list[int], prompt_lengths: torch.Tensor, points: tuple[int, ...]) -> torch.Tensor:
        """For ``rows`` and each point ``p``: of the row's first ``p`` generated tokens, the fraction still held
        (layers and heads pooled); NaN where fewer than ``p`` of them have left the window.

        A token's fate is final once it leaves the window (marked tokens are gone, the others stay), so this is
        also what the row held of its own tokens back when it was ``p`` tokens past its window: the growth curve
        that a reservation at a short token limit reads (:mod:`dms_runtime.kv_growth`)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.pool.keys.device)
        prompt = prompt_lengths.to(index.device)
        limits = torch.tensor(points, device=index.device)
        held = torch.zeros((len(rows), len(points)), device=index.device)
        for layer in self.layers:
            occupied = layer.occupied().index_select(0, index)
            own = torch.where(occupied, layer.pos.index_select(0, index) - prompt[:, None, None], -1)[..., None]
            held = held + ((own >= 0) & (own < limits)).sum(dim=(1, 2)).float()
        first = self.layers[0]
        past = (first.length[index] - first.window[index] - 1 - prompt).clamp(min=0)
        seen = limits.float() * len(self.layers) * first.count.shape[1]
        return torch.where(past[:, None] >= limits, held / seen, torch.nan)
