"""Trained DMS gates as a kvpress press: ``pipe(context, question=..., press=DMSGatePress.from_adapter(model, path))``.

kvpress's own ``DMSPress`` thresholds the scores of a training-free scorer; this press brings the trained
evictors instead, with DMS's exact semantics: the decision about token j is made at position j+1, and a
token marked for eviction stays visible to queries at most ``window`` positions after it. It subclasses
``DMSPress`` so kvpress's pipeline applies it both to the context and while decoding (``decoding=True``).

Like every kvpress decoding press it masks evicted keys (kvpress's attention patch) rather than freeing
them, and the context is prefilled densely; thinkpool's own :class:`~dms_runtime.cache.DMSCache` frees the
memory (``DMSCache(..., dense_prefill=True)`` reproduces this press token for token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from kvpress import DMSPress
from kvpress.presses.base_press import is_prefilling
from torch import nn

from dms_runtime.adapters import read_adapter_metadata
from dms_runtime.config import DMSConfig
from dms_runtime.gates import build_gates


@dataclass
class DMSGatePress(DMSPress):
    """kvpress press driven by trained DMS gates (one ``EvictionGate`` per layer)."""

    press: object = None  # DMSPress wraps a scorer; the trained gates take its place
    gates: nn.ModuleList | None = None
    threshold: float = 0.0
    sliding_window_size: int = 16
    decoding: bool = True
    marks: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def from_adapter(cls, model, path: str | Path, threshold: float | None = None) -> "DMSGatePress":
        """The press for a thinkpool adapter file (checked against ``model`` when it is loaded with ``load_adapter``)."""
        from safetensors.torch import load_file

        metadata = read_adapter_metadata(path)
        config = DMSConfig(**metadata["dms_config"])
        if config.parametrization != "adapter":
            raise ValueError("the kvpress press supports adapter gates (query-neuron gates change the model itself)")
        gates = build_gates(model, config)
        gates.load_state_dict(load_file(str(path)))
        return cls(gates=gates, threshold=config.threshold if threshold is None else threshold,
                   sliding_window_size=config.window)

    def post_init_from_model(self, model):
        if self.gates is None:
            raise ValueError("DMSGatePress needs trained gates: use DMSGatePress.from_adapter(model, path)")
        self.gates.to(next(model.parameters()).device)

    @property
    def compression_ratio(self) -> float:
        """Fraction of the cache masked so far, over layers (kvpress convention: 0 = nothing removed)."""
        if not self.compression_ratios:
            return 0.0
        return sum(self.compression_ratios.values()) / len(self.compression_ratios)

    @compression_ratio.setter
    def compression_ratio(self, value):
        raise AttributeError("the compression of trained gates follows from their decisions; it cannot be set")

    @torch.no_grad()
    def forward_hook(self, module: nn.Module, input, kwargs: dict, output):
        hidden = kwargs["hidden_states"]
        cache_position = kwargs["cache_position"]
        layer, q_len = module.layer_idx, hidden.shape[1]
        if is_prefilling(cache_position, q_len):
            self.marks.pop(layer, None)
        logits = self.gates[layer](hidden)  # logit at position t decides about token t-1
        keys = kwargs["past_key_values"].layers[layer].keys
        batch, heads, length, _ = keys.shape
        new_marks = (logits > self.threshold).transpose(1, 2).expand(batch, heads, q_len)
        previous = self.marks.get(layer, torch.zeros(batch, heads, 0, dtype=torch.bool, device=keys.device))
        # New tokens s..s+q-1 bring decisions about s-1..s+q-2; the newest token is undecided.
        marks = torch.cat([previous, torch.zeros(batch, heads, q_len, dtype=torch.bool, device=keys.device)], dim=-1)
        start = length - q_len
        decided = slice(max(start - 1, 0), length - 1)
        marks[..., decided] |= new_marks[..., 1:] if start == 0 else new_marks
        self.marks[layer] = marks
        # The next query is at position `length`: a marked token j is gone once length - j > window.
        expired = marks & (length - torch.arange(length, device=keys.device) > self.sliding_window_size)
        module.masked_key_indices = list(torch.where(expired)) if expired.any() else None
        self.compression_ratios[layer] = expired.float().mean().item()
        return output
