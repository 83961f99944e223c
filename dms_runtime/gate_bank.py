"""Several DMS adapters on one model at once, chosen per batch row: mixed compression ratios in one batch.

A :class:`GateBank` stands in for one layer's :class:`~dms_runtime.gates.EvictionGate`: it stacks that
layer's gate of every loaded adapter and, for each row, applies the adapter the row's thread asked for.
Row adapter ``-1`` has no gate: its logits never cross the threshold, so the row keeps every token (the
vanilla model, compression 1). Every adapter's logits come from one product with the norm folded into the weights,
and each row then takes its own: no per-row copy of the weights, and the row map stays on the device (the engine
keeps it there with its rows: :meth:`AdapterSet.use_rows`). Only the ``adapter`` parametrization can be mixed this
way: a repurposed query neuron changes the model's own projection for every row.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from dms_runtime.attach import DMSHandle, attach_dms
from dms_runtime.config import NEVER, NO_GATE, DMSConfig
from dms_runtime.gates import EvictionGate
from dms_runtime.kv_growth import KVGrowth



class GateBank(nn.Module):
    def __init__(self, gates: list[EvictionGate], configs: list[DMSConfig], hidden_size: int, num_kv_heads: int):
        super().__init__()
        weights = []
        for gate, config in zip(gates, configs):
            if config.parametrization != "adapter":
                raise ValueError("only adapter-parametrized DMS gates can be mixed per row")
            # A per-layer decision serves every head; the norm's weight is folded into the map.
            weight = gate.weight.detach().float().expand(num_kv_heads, -1)
            weights.append(weight * gate.norm.weight.detach().float())
        # [adapters * kv_heads, hidden]: every adapter's logits come from one product, then each row takes its own
        self.register_buffer("weight", torch.cat(weights) if weights else torch.zeros(0, hidden_size))
        self.register_buffer("scale", torch.tensor([c.logit_scale for c in configs], dtype=torch.float32))
        self.register_buffer("offset", torch.tensor([c.init_offset - c.threshold for c in configs], dtype=torch.float32))
        self.eps = 1e-6
        self.num_kv_heads = num_kv_heads
        self.query_channels: list[int] = []
        self.row_adapter = torch.zeros(0, dtype=torch.long)  # per row, on the model's device (AdapterSet.use_rows)
        self.gated = True  # host: whether any row has a gate

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, q, kv_heads]`` (threshold folded in: evict where > 0)."""
        rows, q_len, _ = hidden.shape
        index = self.row_adapter
        if len(index) != rows:
            raise ValueError(f"gate bank has adapters for {len(index)} rows, the batch has {rows}")
        if not len(self.weight) or not self.gated:
            return hidden.new_full((rows, q_len, self.num_kv_heads), NEVER, dtype=torch.float32)
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        every = nn.functional.linear(x, self.weight).view(rows, q_len, len(self.scale), self.num_kv_heads)
        every = every * self.scale[:, None] + self.offset[:, None]
        pick = index.clamp(min=0)[:, None, None, None].expand(rows, q_len, 1, self.num_kv_heads)
        return every.gather(2, pick)[:, :, 0].masked_fill((index == NO_GATE)[:, None, None], NEVER)


class AdapterSet:
    """The adapters a worker serves, by compression ratio, attached to its model as gate banks, with the KV growth
    measured for each (what its heads keep of a thread; an adapter never measured has none here, and the budget
    model reserves DESIGN's ``1/cr`` for it)."""

    def __init__(self, model: nn.Module, adapters: dict[float, tuple[nn.ModuleList, DMSConfig]],
                 growth: dict[float, KVGrowth] | None = None):
        self.ratios = sorted(adapters)
        self.windows = {cr: adapters[cr][1].window for cr in self.ratios}
        self.growths = {cr: g for cr, g in (growth or {}).items() if cr in self.windows}
        c = model.config
        layers = c.num_hidden_layers
        self.banks = nn.ModuleList(
            GateBank([adapters[cr][0][layer] for cr in self.ratios], [adapters[cr][1] for cr in self.ratios], c.hidden_size, c.num_key_value_heads)
            for layer in range(layers)
        )
        self.handle: DMSHandle = attach_dms(model, self.banks, DMSConfig())

    def index(self, cr: float) -> int:
        """The bank index of ratio ``cr`` (``NO_GATE`` for 1)."""
        if cr == 1:
            return NO_GATE
        if cr not in self.windows:
            raise ValueError(f"no DMS adapter for {cr:g}x on this worker; it has {', '.join(f'{r:g}x' for r in self.ratios) or 'none'}")
        return self.ratios.index(cr)

    def window(self, cr: float) -> int:
        return 0 if cr == 1 else self.windows[cr]

    def set_rows(self, row_ratios: list[float]) -> None:
        """Each row's ratio, from the host (one copy to the device)."""
        device = next(self.handle.model.parameters()).device
        index = torch.tensor([self.index(cr) for cr in row_ratios], dtype=torch.long, device=device)
        self.use_rows(index, any(cr != 1 for cr in row_ratios))

    def use_rows(self, index: torch.Tensor, gated: bool = True) -> None:
        """Each row's bank index (``NO_GATE`` for 1), already on the model's device (the engine keeps it there with
        its rows); ``gated``: whether any row has a gate (a host fact: with none, the banks compute nothing)."""
        for bank in self.banks:
            bank.row_adapter = index
            bank.gated = gated

    def detach(self) -> None:
        self.handle.detach()

    @contextmanager
    def detached(self) -> Iterator[None]:
        """The bare model inside the block (e.g. for Hugging Face ``generate``); the banks come back after."""
        self.handle.detach()
        try:
            yield
        finally:
            self.handle = attach_dms(self.handle.model, self.banks, DMSConfig())
