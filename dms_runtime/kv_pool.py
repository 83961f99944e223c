"""A fixed KV pool: K and V storage preallocated once, handed out one slot at a time.

A slot holds one token's key and value for one layer and one KV head: the unit DMS evicts, so a slot
freed by eviction is reused by the next token of any thread, layer or head. Slots are reference-counted
because the threads of one task share their prompt's slots. The pool never grows: asking for more
slots than are free raises :class:`PoolExhausted` (the engine's admission control and preemption exist
so that this never happens), and ``high_water`` records the most slots ever in use at once.

Everything the pool keeps lives on its device, so handing slots out and taking them back never waits for the
device: the free slots are a stack whose top is a device scalar, a release pushes what it frees with a static-shape
scatter (a slot named twice in one release, as a shared prompt's is, is pushed once), and the counters (slots in use,
the high-water mark, each owner's slots and peak) are device tensors. The host keeps a bound of its own, what was in
use when it last read the counters plus what it has handed out since (:meth:`observe`, :meth:`has_free`), so it
can admit and make room without a read; only a shortfall by that bound reads the device.

Every slot also carries its owner (a small integer the engine gives each task), and the pool keeps each
owner's slots in use and its high-water mark: a request's own KV peak, counted where memory is handed out.
"""

from __future__ import annotations

import torch


class PoolExhausted(RuntimeError):
    """More slots were requested than the pool has free."""


MAX_OWNERS = 4096  # tasks a pool tells apart at once (owner ids are recycled when a task closes)


class KVPool:
    def __init__(self, budget_bytes: int, head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.head_dim = head_dim
        self.slot_bytes = 2 * head_dim * torch.empty((), dtype=dtype).element_size()
        self.capacity = int(budget_bytes) // self.slot_bytes
        if self.capacity < 1:
            raise ValueError(f"kv budget of {budget_bytes} bytes is smaller than one slot ({self.slot_bytes} bytes)")
        if self.capacity >= 2**31:  # the cache's tables hold slots as int32
            raise ValueError(f"kv budget of {budget_bytes} bytes is more than 2**31 slots of {self.slot_bytes} bytes")
        self.keys = torch.zeros(self.capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(self.capacity, head_dim, dtype=dtype, device=device)
        # Per-slot tables have one entry more, ``trash``: masked-out entries of a static-shape update land there.
        self.trash = self.capacity
        self.refs = torch.zeros(self.capacity + 1, dtype=torch.int32, device=device)
        self.owner = torch.zeros(self.capacity + 1, dtype=torch.long, device=device)
        self._claim = torch.zeros(self.capacity + 1, dtype=torch.long, device=device)  # see release()
        # Free slots as a stack (top = the end): allocation pops, release pushes; no scan of the pool.
        self._stack = torch.cat([torch.arange(self.capacity - 1, -1, -1, dtype=torch.long, device=device),
                                 torch.full((1,), self.trash, dtype=torch.long, device=device)])
        self._top = torch.tensor(self.capacity, dtype=torch.long, device=device)
        self._depth = torch.arange(1, self.capacity + 1, dtype=torch.long, device=device)  # allocate() pops top - depth
        self._high = torch.zeros((), dtype=torch.long, device=device)
        self.owner_used = torch.zeros(MAX_OWNERS, dtype=torch.long, device=device)
        self.owner_peak = torch.zeros(MAX_OWNERS, dtype=torch.long, device=device)
        self._known_used = 0  # host: slots in use when the counters were last read
        self._handed_out = 0  # host: slots allocated since

    # -- counters ------------------------------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self.capacity * self.slot_bytes

    @property
    def used(self) -> int:
        """Slots in use now (reads the device)."""
        self.observe(int(self.capacity - self._top))
        return self._known_used

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def used_bytes(self) -> int:
        return self.used * self.slot_bytes

    @property
    def high_water(self) -> int:
        """The most slots in use at once (reads the device); assign to restart it."""
        return int(self._high)

    @high_water.setter
    def high_water(self, value: int) -> None:
        self._high.fill_(int(value))

    @property
    def high_water_bytes(self) -> int:
        return self.high_water * self.slot_bytes

    def used_counter(self) -> torch.Tensor:
        """``[1]``: slots in use, on the device (for a caller that reads it together with other values)."""
        return (self.capacity - self._top).reshape(1)

    def observe(self, used: int) -> None:
        """The host read the counters: ``used`` slots were in use, and nothing was handed out since."""
        self._known_used, self._handed_out = int(used), 0

    def has_free(self, count: int) -> bool:
        """Whether ``count`` slots are free: by the host's bound when that suffices, else by reading the device."""
        if count <= self.capacity - self._known_used - self._handed_out:
            return True
        return count <= self.free

    # -- slots ---------------------------------------------------------------------------------------------------
    def allocate(self, count: int, owners: torch.Tensor | None = None) -> torch.Tensor:
        """``count`` free slots (long), each now referenced once; ``owners`` (one per slot, default 0) says whose."""
        device = self.keys.device
        if count == 0:
            return torch.zeros(0, dtype=torch.long, device=device)
        if not self.has_free(count):
            raise PoolExhausted(f"needed {count} KV slots, {self.free} of {self.capacity} free")
        slots = self._stack[self._top - self._depth[:count]]
        self._top -= count
        torch.maximum(self._high, self.capacity - self._top, out=self._high)
        self.refs.index_fill_(0, slots, 1)
        owners = torch.zeros(count, dtype=torch.long, device=device) if owners is None else owners.to(device)
        self.owner.index_copy_(0, slots, owners)
        self.owner_used.index_add_(0, owners, torch.ones_like(owners))
        torch.maximum(self.owner_peak, self.owner_used, out=self.owner_peak)
        self.handed_out(count)
        return slots

    def handed_out(self, count: int) -> None:
        """``count`` slots were allocated on the device (by :meth:`allocate`, or by a replayed CUDA graph of it)."""
        self._handed_out += count

    def retain(self, slots: torch.Tensor, times: int = 1, mask: torch.Tensor | None = None) -> None:
        """Add ``times`` references to each of ``slots`` where ``mask`` (default: all) holds; a shared prompt gets
        one per extra thread."""
        if not slots.numel() or not times:
            return
        safe, weight = self._masked(slots, mask)
        self.refs.index_add_(0, safe, weight.int() * times)

    def release(self, slots: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Drop one reference per entry of ``slots`` where ``mask`` (default: all) holds; a slot with none left is free
        at once. Static shapes, no read of the device: entries outside ``mask`` may hold anything."""
        if not slots.numel():
            return
        safe, weight = self._masked(slots, mask)
        self.refs.index_add_(0, safe, -weight.int())
        # A slot named by several entries (rows sharing a prompt) is pushed by one of them: each entry writes its index
        # into the slot's claim, one write wins, and only that entry may push it.
        entry = torch.arange(len(safe), device=safe.device)
        self._claim.index_copy_(0, safe, entry)
        freed = weight & (self.refs[safe] == 0) & (self._claim[safe] == entry)
        place = freed.long().cumsum(0)
        self._stack.index_copy_(0, torch.where(freed, self._top + place - 1, self.trash), safe)
        self._top += place[-1]
        self.owner_used.index_add_(0, self.owner[safe], -freed.long())

    def _masked(self, slots: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        slots = slots.reshape(-1).long()
        if mask is None:
            return slots, torch.ones_like(slots, dtype=torch.bool)
        mask = mask.reshape(-1)
        return torch.where(mask, slots, self.trash), mask

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys.index_copy_(0, slots, keys.to(self.keys.dtype))
        self.values.index_copy_(0, slots, values.to(self.values.dtype))

    # -- owners --------------------------------------------------------------------------------------------------
    def owner_peak_bytes(self, owner: int) -> int:
        """The most bytes ``owner``'s slots held at once since :meth:`reset_owner`."""
        return int(self.owner_peak[owner]) * self.slot_bytes

    def reset_owner(self, owner: int) -> None:
        """Start ``owner``'s counts afresh (a recycled owner id; its slots must all be free)."""
        self.owner_used[owner] = 0
        self.owner_peak[owner] = 0

    def check(self) -> None:
        """Raise if the books disagree: a negative reference count, slots in use that are not the referenced ones, or
        a free stack that does not hold exactly the unreferenced slots (for tests; reads the device)."""
        refs = self.refs[: self.capacity]
        if bool((refs < 0).any()):
            raise RuntimeError("KV slot released more often than it was referenced")
        top = int(self._top)
        free = self._stack[:top]
        held = int((refs > 0).sum())
        if held != self.capacity - top or free.unique().numel() != top or bool((refs[free] != 0).any()):
            raise RuntimeError("KV pool's free stack disagrees with its reference counts")
