"""A fixed KV pool: K and V storage preallocated once, handed out one slot at a time.

A slot holds one token's key and value for one layer and one KV head: the unit DMS evicts, so a slot
freed by eviction is reused by the next token of any thread, layer or head. Slots are reference-counted
because the threads of one task share their prompt's slots. The pool never grows: asking for more
slots than are free raises :class:`PoolExhausted` (the engine's admission control and preemption exist
so that this never happens), and ``high_water`` records the most slots ever in use at once.

Every slot also carries its owner (a small integer the engine gives each task), and the pool keeps each
owner's slots in use and its high-water mark on the device: a request's own KV peak, counted where memory
is handed out, at no cost to the step.
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
        self.keys = torch.zeros(self.capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(self.capacity, head_dim, dtype=dtype, device=device)
        self.refs = torch.zeros(self.capacity, dtype=torch.int32, device=device)
        # Free slots as a stack (top = the end): allocation pops, release pushes; no scan of the pool.
        self._free = torch.arange(self.capacity - 1, -1, -1, dtype=torch.long, device=device)
        self._top = self.capacity
        self.used = 0
        self.high_water = 0
        self.owner = torch.zeros(self.capacity, dtype=torch.long, device=device)
        self.owner_used = torch.zeros(MAX_OWNERS, dtype=torch.long, device=device)
        self.owner_peak = torch.zeros(MAX_OWNERS, dtype=torch.long, device=device)

    @property
    def budget_bytes(self) -> int:
        return self.capacity * self.slot_bytes

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def used_bytes(self) -> int:
        return self.used * self.slot_bytes

    @property
    def high_water_bytes(self) -> int:
        return self.high_water * self.slot_bytes

    def allocate(self, count: int, owners: torch.Tensor | None = None) -> torch.Tensor:
        """``count`` free slots, each now referenced once; ``owners`` (one per slot, default 0) says whose."""
        if count > self.free:
            raise PoolExhausted(f"needed {count} KV slots, {self.free} of {self.capacity} free")
        self._top -= count
        slots = self._free[self._top : self._top + count].flip(0)
        self.refs[slots] = 1
        self.used += count
        self.high_water = max(self.high_water, self.used)
        owners = torch.zeros(count, dtype=torch.long, device=slots.device) if owners is None else owners.to(slots.device)
        self.owner[slots] = owners
        self.owner_used.index_add_(0, owners, torch.ones_like(owners))
        torch.maximum(self.owner_peak, self.owner_used, out=self.owner_peak)
        return slots

    def retain(self, slots: torch.Tensor, times: int = 1) -> None:
        """Add ``times`` references to each of ``slots`` (a shared prompt gets one per extra thread)."""
        if slots.numel() and times:
            self.refs.index_add_(0, slots, torch.full_like(slots, times, dtype=torch.int32))

    def release(self, slots: torch.Tensor) -> None:
        """Drop one reference per entry of ``slots``; a slot with none left is free at once."""
        if not slots.numel():
            return
        self.refs.index_add_(0, slots, torch.full_like(slots, -1, dtype=torch.int32))
        touched = slots.unique()
        if bool((self.refs[touched] < 0).any()):
            raise RuntimeError("KV slot released more often than it was referenced")
        freed = touched[self.refs[touched] == 0]
        self.owner_used.index_add_(0, self.owner[freed], torch.full_like(freed, -1))
        self._free[self._top : self._top + len(freed)] = freed
        self._top += len(freed)
        self.used -= len(freed)

    def owner_peak_bytes(self, owner: int) -> int:
        """The most bytes ``owner``'s slots held at once since :meth:`reset_owner`."""
        return int(self.owner_peak[owner]) * self.slot_bytes

    def reset_owner(self, owner: int) -> None:
        """Start ``owner``'s counts afresh (a recycled owner id; its slots must all be free)."""
        self.owner_used[owner] = 0
        self.owner_peak[owner] = 0

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys[slots] = keys.to(self.keys.dtype)
        self.values[slots] = values.to(self.values.dtype)
