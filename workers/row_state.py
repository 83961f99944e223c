"""The running batch's per-row state on the device, in the cache's row order.

A decode step needs, per row, the token to feed, the gate bank to use, the sampling parameters and the random
stream's seed and counter. Kept here as device tensors that change only when rows join or leave (one copy to the
device per admission), a step reads none of them from the host and writes only the new tokens and counters, on the
device; the host keeps what it needs to know without reading them (:class:`~workers.sampler.Filters`, whether any
row has a gate).
"""

from __future__ import annotations

import torch

from workers.sampler import Filters, counter_uniforms
from workers.thread import SamplingParams, Thread


class RowState:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.next_input = torch.zeros(0, dtype=torch.long, device=self.device)  # the token each row feeds next
        self.adapter = torch.zeros(0, dtype=torch.long, device=self.device)  # gate bank index (NO_GATE: cr 1)
        self.seed = torch.zeros(0, dtype=torch.long, device=self.device)
        self.drawn = torch.zeros(0, dtype=torch.long, device=self.device)  # draws so far: the next draw's counter
        self.top_k = torch.zeros(0, dtype=torch.long, device=self.device)
        self.temperature = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.top_p = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.min_p = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.params: list[SamplingParams] = []  # host
        self.gated: list[bool] = []  # host: whether each row has a gate
        self._filters: Filters | None = None  # the whole batch's, until rows change

    def __len__(self) -> int:
        return len(self.params)

    def add(self, threads: list[Thread], adapters: list[int], next_input: list[int]) -> None:
        """Rows for ``threads`` at the end (``adapters``: their bank indices), each drawing next at its token count."""
        ints = torch.tensor([[token, adapter, t.params.seed, len(t.tokens), t.params.top_k]
                             for t, adapter, token in zip(threads, adapters, next_input)], dtype=torch.long)
        floats = torch.tensor([[t.params.temperature, t.params.top_p, t.params.min_p] for t in threads])
        ints, floats = ints.to(self.device).reshape(-1, 5), floats.to(self.device).reshape(-1, 3)
        for column, name in enumerate(("next_input", "adapter", "seed", "drawn", "top_k")):
            setattr(self, name, torch.cat([getattr(self, name), ints[:, column]]))
        for column, name in enumerate(("temperature", "top_p", "min_p")):
            setattr(self, name, torch.cat([getattr(self, name), floats[:, column]]))
        self.params += [t.params for t in threads]
        self.gated += [t.cr != 1 for t in threads]
        self._filters = None

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows``, in that order."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for name in ("next_input", "adapter", "seed", "drawn", "top_k", "temperature", "top_p", "min_p"):
            setattr(self, name, getattr(self, name).index_select(0, index))
        self.params = [self.params[row] for row in rows]
        self.gated = [self.gated[row] for row in rows]
        self._filters = None

    def any_gated(self) -> bool:
        return any(self.gated)

    def filters(self, rows: slice = slice(None)) -> Filters:
        """What ``rows`` use of the sampler (the whole batch's is kept until rows change)."""
        whole = rows == slice(None)
        if whole and self._filters is not None:
            return self._filters
        params = self.params[rows]
        filters = Filters.of([p.temperature for p in params], [p.top_p for p in params], [p.top_k for p in params],
                             [p.min_p for p in params])
        if whole:
            self._filters = filters
        return filters

    def sampling(self, rows: slice) -> tuple:
        """The arguments of :func:`~workers.sampler.sample_rows` after the logits, for ``rows``."""
        draws = counter_uniforms(self.seed[rows], self.drawn[rows])
        return (self.temperature[rows], self.top_p[rows], draws, self.top_k[rows], self.min_p[rows],
                self.filters(rows))

    def record(self, tokens: torch.Tensor, rows: slice) -> None:
        """``rows`` drew ``tokens`` (on the device): they feed them next, and their counters move on."""
        self.next_input[rows] = tokens
        self.drawn[rows] += 1
