"""One layer of the engine's KV cache: per (row, KV head), a packed line of pool slots.

A line holds the pool slots of the tokens that head keeps, packed at the front of ``table [rows, heads, width]``
(int32), with ``count [rows, heads]`` of them; ``pos`` (int32) and ``evict`` (bool) beside each entry say
which token it is and whether it is marked for eviction. Entries at or past a line's count are never read (their
``evict`` is always False, their slot a stale but valid index). Lines keep different numbers of tokens: the decode
attention reads each one's own count (:mod:`dms_runtime.decode_attention`), nothing is padded to the longest.

**A decode step** (one new token per row) changes every line by the same static-shape operations, on the device and
without reading it back: the gate logit of the new position marks the line's last entry (always the previous token,
which nothing had decided yet); the one entry that may just have left its window (marked, at position
``length - window - 1``) is released to the pool and the line's last entry moves into its place; the new token is
appended at ``count``. So at most one entry per line moves, what a line holds is exactly what the new query sees,
and an evicted slot is back in the pool before the step's new slots are taken.

**A prefill chunk** (several tokens of one row) decides and releases the same way for the token before it, appends
its tokens, marks those its logits decide, and keeps the mask of what each of its queries sees (delayed eviction
inside the chunk) with the gathered K/V for SDPA; then it releases what its last query no longer sees and compacts
each line in order.

The host keeps two bounds: ``widest`` (no line holds more; the table has at least that many columns, and the
decode attention reads up to it) and ``longest`` (no row has processed more tokens; what transformers' mask sizes
read). A step adds its tokens to both; the engine replaces ``widest`` by the true value it reads once per step.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from dms_runtime.cache import query_length
from dms_runtime.eviction import decided_marks, expired
from dms_runtime.kv_pool import KVPool

GROWTH = 32  # table columns added at a time (amortises reallocation); a table more than twice this wide past its
# widest line is trimmed


class PagedLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False

    def __init__(self, pool: KVPool, num_heads: int):
        super().__init__()
        self.pool = pool
        device = pool.keys.device
        self.table = torch.zeros((0, num_heads, 0), dtype=torch.int32, device=device)
        self.pos = torch.zeros((0, num_heads, 0), dtype=torch.int32, device=device)
        self.evict = torch.zeros((0, num_heads, 0), dtype=torch.bool, device=device)
        self.count = torch.zeros((0, num_heads), dtype=torch.long, device=device)
        self.length = torch.zeros(0, dtype=torch.long, device=device)  # tokens processed per row
        self.window = torch.zeros(0, dtype=torch.long, device=device)
        self.owner = torch.zeros(0, dtype=torch.long, device=device)  # per row: the task its new slots belong to
        self.widest = 0  # host: no line holds more entries
        self.longest = 0  # host: no row has processed more tokens
        self.evicting = True  # host: whether any row may mark tokens (False: every row is vanilla, nothing to decide)
        self.pending_logits: torch.Tensor | None = None
        self.chunk_mask: torch.Tensor | None = None  # prefill: [rows, heads, q, width], what each query sees
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    @property
    def width(self) -> int:
        return self.table.shape[2]

    def occupied(self) -> torch.Tensor:
        """``[rows, heads, width]``: the entries within each line's count."""
        return torch.arange(self.width, device=self.count.device) < self.count[..., None]

    # -- rows (between steps) ------------------------------------------------------------------------------------
    def add_rows(self, windows: torch.Tensor, owners: torch.Tensor) -> None:
        count, heads = len(windows), self.table.shape[1]
        for name in ("table", "pos", "evict"):
            mine = getattr(self, name)
            setattr(self, name, torch.cat([mine, mine.new_zeros((count, heads, self.width))]))
        self.count = torch.cat([self.count, self.count.new_zeros((count, heads))])
        self.length = torch.cat([self.length, self.length.new_zeros(count)])
        self.owner = torch.cat([self.owner, owners.to(self.owner)])
        self.window = torch.cat([self.window, windows.to(self.window)])

    def extend(self, other: "PagedLayer", repeat: int, keep_source: bool = False) -> None:
        """Append ``other``'s rows ``repeat`` times each; the copies share (and reference) its slots. Unless
        ``keep_source``, the first copy takes over ``other``'s own reference (``other`` is then spent)."""
        self.pool.retain(other.table, repeat if keep_source else repeat - 1, other.occupied())
        width = max(self.width, other.width)
        for name in ("table", "pos", "evict"):
            mine, theirs = _widen(getattr(self, name), width), _widen(getattr(other, name), width)
            setattr(self, name, torch.cat([mine, _repeat(theirs, repeat)]))
        for name in ("count", "length", "owner", "window"):
            setattr(self, name, torch.cat([getattr(self, name), _repeat(getattr(other, name), repeat)]))
        self.widest, self.longest = max(self.widest, other.widest), max(self.longest, other.longest)

    def remove_rows(self, rows: list[int]) -> None:
        """Release the slots of ``rows`` and drop them; the other rows keep their order."""
        if not rows:
            return
        leaving = set(rows)
        gone = torch.tensor(sorted(leaving), dtype=torch.long, device=self.count.device)
        self.pool.release(self.table.index_select(0, gone), self.occupied().index_select(0, gone))
        kept = [row for row in range(len(self.count)) if row not in leaving]
        index = torch.tensor(kept, dtype=torch.long, device=self.count.device)
        for name in ("table", "pos", "evict", "count", "length", "owner", "window"):
            setattr(self, name, getattr(self, name).index_select(0, index))
        if not kept:
            self.observe_widest(0)
            self.longest = 0

    def observe_widest(self, widest: int) -> None:
        """The longest line now holds ``widest`` entries (read by the caller); a table far wider is trimmed."""
        self.widest = int(widest)
        if self.width > self.widest + 2 * GROWTH or (self.widest == 0 and len(self.count) == 0):
            keep = self.widest + GROWTH if self.widest else 0
            self.table, self.pos, self.evict = (t[:, :, :keep].clone() for t in (self.table, self.pos, self.evict))

    # -- the forward pass ----------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Store one pass's tokens (``[rows, heads, q, dim]``). Decoding (``q == 1``) returns the inputs unchanged:
        attention reads the pool through the table. A prefill chunk returns the gathered K/V it attends to."""
        rows, heads, q_len, dim = key_states.shape
        if self.widest + q_len > self.width:
            self._grow(self.widest + q_len + GROWTH)
        start = self.length
        logits, self.pending_logits = self.pending_logits, None
        if self.evicting and logits is not None and self.longest > 0:  # (a fresh row has no token to decide yet)
            self._settle(logits[:, 0], start)
        owners = self.owner[:, None].expand(rows, heads * q_len).reshape(-1)
        slots = self.pool.allocate(rows * heads * q_len, owners)
        self.pool.write(slots, key_states.reshape(-1, dim), value_states.reshape(-1, value_states.shape[-1]))
        self._append(slots.view(rows, heads, q_len), start, q_len)
        self.host_step(q_len)
        if q_len == 1:
            self.length += 1  # in place: a decode step rebinds no tensor (what a captured CUDA graph needs)
            return key_states, value_states
        if self.evicting and logits is not None:
            # the logits at positions start+1 .. decide tokens start ..
            self.evict |= decided_marks(logits[:, 1:], 0.0, self.pos, self.occupied(), start + 1, q_len - 1)
        self.length = start + q_len
        return self._close_chunk(start, q_len, dim)

    def host_step(self, q_len: int) -> None:
        """What a pass of ``q_len`` tokens changes on the host (also what a replayed decode graph must add)."""
        self.widest += q_len
        self.longest += q_len

    def _grow(self, width: int) -> None:
        self.table, self.pos, self.evict = (_widen(t, width) for t in (self.table, self.pos, self.evict))

    def _settle(self, logits: torch.Tensor, query: torch.Tensor) -> None:
        """Before a pass whose first query is at ``query`` (per row): mark each line's last entry (the previous token,
        undecided until now) where ``logits [rows, decisions]`` (one per head, or one for the layer) cross the
        threshold; then release the entry of each line that this query is the first not to see (marked, ``window + 1``
        back: at most one per line) and move the line's last entry into its place. Every row has processed a token,
        so every line holds its last one."""
        last = (self.count - 1).clamp(min=0).unsqueeze(-1)
        self.evict.scatter_(2, last, (logits > 0).expand(-1, self.table.shape[1]).unsqueeze(-1))
        hit = self.evict & (self.pos == (query - self.window - 1).view(-1, 1, 1))
        found, where = hit.max(-1, keepdim=True)  # [rows, heads, 1]
        self.pool.release(self.table.gather(2, where), found)
        into = torch.where(found, where, last)  # where nothing was released, the last entry moves onto itself
        for line in (self.table, self.pos):
            line.scatter_(2, into, line.gather(2, last))
        moved = self.evict.gather(2, last)
        self.evict.scatter_(2, into, moved)
        self.evict.scatter_(2, last, moved & ~found)  # the line's end, left behind, is past the count now
        self.count -= found.squeeze(-1).long()

    def _append(self, slots: torch.Tensor, start: torch.Tensor, q_len: int) -> None:
        """Place ``slots [rows, heads, q]`` (positions ``start ..``) at the end of every line."""
        rows, heads = slots.shape[:2]
        at = self.count.unsqueeze(-1)
        positions = start.view(-1, 1, 1)
        if q_len > 1:
            offsets = torch.arange(q_len, device=slots.device)
            at, positions = at + offsets, positions + offsets
        self.table.scatter_(2, at, slots.to(torch.int32))
        self.pos.scatter_(2, at, positions.to(torch.int32).expand(rows, heads, q_len))
        self.count += q_len

    def _close_chunk(self, start: torch.Tensor, q_len: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill chunk's view (its mask, the K/V it attends to), then release what its last query no longer sees
        and pack each line again, in order."""
        occupied = self.occupied()
        query = (start[:, None] + torch.arange(q_len, device=start.device))[:, None, :, None]  # [rows, 1, q, 1]
        pos = self.pos[:, :, None, :]
        gone = expired(self.evict[:, :, None, :], pos, query, self.window[:, None, None, None])
        self.chunk_mask = occupied[:, :, None, :] & (pos <= query) & ~gone
        index = self.table.long().flatten()
        shape = (*self.table.shape, dim)
        keys = self.pool.keys.index_select(0, index).view(shape)
        values = self.pool.values.index_select(0, index).view(shape)
        leaving = occupied & gone[:, :, -1]
        self.pool.release(self.table, leaving)
        order = torch.sort((~(occupied & ~leaving)).to(torch.uint8), dim=-1, stable=True).indices
        self.table, self.pos, self.evict = (t.gather(2, order) for t in (self.table, self.pos, self.evict))
        self.count = (occupied & ~leaving).sum(-1)
        self.evict &= self.occupied()
        return keys, values

    # -- Cache API plumbing --------------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.longest

    def get_mask_sizes(self, query: torch.Tensor | int) -> tuple[int, int]:
        return self.longest + query_length(query), 0

    def get_max_length(self) -> int:  # newer transformers 5.x (5.17 has it)
        return -1

    get_max_cache_shape = get_max_length  # the pinned transformers (< 5.3)


def _repeat(tensor: torch.Tensor, times: int) -> torch.Tensor:
    """Each row ``times`` times in a row (the output size given: nothing to read from the device)."""
    return tensor.repeat_interleave(times, dim=0, output_size=len(tensor) * times)


def _widen(tensor: torch.Tensor, width: int) -> torch.Tensor:
    if tensor.shape[2] >= width:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((tensor.shape[0], tensor.shape[1], width - tensor.shape[2]))], dim=2)
