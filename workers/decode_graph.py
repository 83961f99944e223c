"""The engine's decode step replayed as a CUDA graph (``Engine(..., cuda_graphs=True)``; CUDA only).

A decode step launches thousands of small kernels (the model's, the gates', the cache's bookkeeping, the sampler's);
on a large model the host can spend longer launching them than the device spends running them. The step's device
work has static shapes while the batch keeps its shape: the same rows, tables of the same width, and every update
in place (the cache, the pool and the batch rebind no tensor in a decode step), with no read of the device inside
(``tests/test_paged_cache.py`` holds it to that). So it can be captured once and replayed, the host then doing only
the step's one read and its own bookkeeping.

The rules: the first decode step at a new shape runs eagerly (it compiles kernels and creates workspaces); the next
one at the same shape is captured, then replayed; later ones at that shape are replayed. A shape is every tensor the
step touches (address and size) and the host facts the capture bakes in (which filters the sampler runs, whether any
row evicts, how many alternatives rows rank). Rows joining or leaving, a table growing or being trimmed, all change
it. The decode attention is bounded by the table's width rather than the widest line, since a captured launch cannot
follow the lines as they grow. If a capture fails, the host's books are put back, the step runs eagerly, and graphs
stay off for the engine (``failure`` says why). Whether it pays has to be measured on the GPU (``thinkpool bench
gpu`` runs the engine with and without).
"""

from __future__ import annotations

import torch

LINE_STATE = ("table", "pos", "evict", "count", "length", "window", "owner")
ROW_STATE = ("next_input", "adapter", "seed", "drawn", "top_k", "temperature", "top_p", "min_p")


def decode_shape(engine) -> tuple:
    """Everything a captured decode step of ``engine`` (a :class:`~workers.engine.Engine`) depends on: each state
    tensor's address and size, and the host facts."""
    state = engine.row_state
    parts: list = [len(engine.rows), state.any_gated(), state.filters(), engine.top_logprobs_wanted(engine.rows)]
    for layer in engine.cache.layers:
        parts += [(getattr(layer, name).data_ptr(), tuple(getattr(layer, name).shape)) for name in LINE_STATE]
    parts += [(getattr(state, name).data_ptr(), tuple(getattr(state, name).shape)) for name in ROW_STATE]
    return tuple(parts)


class DecodeGraph:
    """The decode graph of one :class:`~workers.engine.Engine` (which calls :meth:`step` from its own step)."""

    def __init__(self, engine):
        self.engine = engine
        self.graph: torch.cuda.CUDAGraph | None = None
        self.packed: torch.Tensor | None = None  # the graph's output: what the step's one read reads
        self.shape: tuple | None = None  # of the captured graph
        self.seen: tuple | None = None  # of the last eager step
        self.failure: str | None = None
        self.captures = self.replays = 0
        engine.cache.static_bounds = True

    def step(self) -> torch.Tensor | None:
        """Run this decode step's device work from a graph and return what it packed, or None: run it eagerly."""
        if self.failure is not None:
            return None
        cache = self.engine.cache
        if any(layer.widest + 1 > layer.width for layer in cache.layers):
            return None  # the eager step grows the table
        shape = decode_shape(self.engine)
        if self.graph is not None and shape == self.shape:
            cache.host_step()
            self.graph.replay()
            self.replays += 1
            return self.packed
        if shape != self.seen:
            self.seen, self.graph, self.packed = shape, None, None
            return None
        return self._capture(shape)

    def _capture(self, shape: tuple) -> torch.Tensor | None:
        engine, cache = self.engine, self.engine.cache
        bounds = [(layer.widest, layer.longest) for layer in cache.layers]
        self.graph = self.packed = None
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                packed = engine._sample(engine._decode_logits(), slice(None), engine.top_logprobs_wanted(engine.rows))
        except Exception as error:  # noqa: BLE001: any failure leaves the engine on its eager path
            for layer, (widest, longest) in zip(cache.layers, bounds):  # nothing ran on the device: undo the host's
                layer.widest, layer.longest, layer.pending_logits = widest, longest, None
            engine.pool.observe(engine.pool.used)
            self.failure = f"{type(error).__name__}: {error}"[:500]
            return None
        self.graph, self.packed, self.shape = graph, packed, shape
        self.captures += 1
        graph.replay()
        return packed
