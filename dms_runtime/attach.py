"""Attaching eviction gates to a Hugging Face model with hooks (no model code is copied or forked).

``attach_dms(model, gates, config)`` registers, per decoder layer, a forward pre-hook on the attention
module that computes the gate logits from the attention input, and switches the model to the ``"dms"``
attention function. For the ``query_neuron`` parametrization a forward hook also zeroes the repurposed
query channels. The returned handle switches modes (``train`` / ``infer`` / ``off``) and detaches cleanly.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from dms_runtime import attention  # noqa: F401  (registers the "dms" attention function)
from dms_runtime.attention import LayerState
from dms_runtime.cache import DMSCache
from dms_runtime.config import DMSConfig


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer (Llama, Qwen2/3 and their relatives)."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise TypeError(f"{type(model).__name__} is not a decoder-only model with model.layers[i].self_attn")
    return [layer.self_attn for layer in layers]


class DMSHandle:
    """Gates attached to a model. ``mode`` is ``"infer"`` after attaching."""

    def __init__(self, model: nn.Module, gates: nn.ModuleList, config: DMSConfig):
        self.model, self.gates, self.config = model, gates, config
        self.modules = attention_modules(model)
        if any(hasattr(module, "dms") for module in self.modules):
            raise RuntimeError("this model already has DMS gates attached: detach them first")
        if len(self.modules) != len(gates):
            raise ValueError(f"{len(gates)} gates for a model with {len(self.modules)} layers")
        parameter = next(model.parameters())
        gates.to(device=parameter.device)
        self._previous_attention = model.config._attn_implementation
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        for layer, gate in zip(getattr(model, "model", model).layers, gates):
            if getattr(gate, "reads_layer_input", False):
                self._hooks.append(layer.input_layernorm.register_forward_pre_hook(_hand_over(gate, layer.self_attn)))
        for module, gate in zip(self.modules, gates):
            module.dms = LayerState(mode="infer", window=config.window)
            self._hooks.append(module.register_forward_pre_hook(self._make_pre_hook(gate), with_kwargs=True))
            if gate.query_channels:
                zero_hook = self._make_zero_hook(module, gate.query_channels)
                self._hooks.append(module.q_proj.register_forward_hook(zero_hook))
        model.set_attn_implementation("dms")

    @staticmethod
    def _make_pre_hook(gate):
        def pre_hook(module, args, kwargs):
            state: LayerState = module.dms
            # kvpress wraps every registered attention function and masks the keys listed here; a press
            # used earlier on this model may have left some behind.
            module.masked_key_indices = None
            if state.mode in ("off", "evict"):
                return None
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            if state.mode == "probe":  # the model runs without gradients; its gates learn on the side
                with torch.enable_grad():
                    state.logits = gate(hidden.detach())
            else:
                state.logits = gate(hidden)
            if state.mode == "infer":
                cache = kwargs.get("past_key_values", kwargs.get("cache"))  # "cache" in transformers after 5.17
                if not hasattr(cache, "set_gate_logits"):  # DMSCache, or the engine's PagedDMSCache
                    raise TypeError("DMS inference needs past_key_values=DMSCache(...) (see DMSCache.for_model)")
                cache.set_gate_logits(module.layer_idx, state.logits)
                state.cache = cache
            return None

        return pre_hook

    @staticmethod
    def _make_zero_hook(attention_module: nn.Module, channels: list[int]):
        def zero_hook(module, args, output):
            if attention_module.dms.mode == "off":  # the vanilla model (e.g. the frozen teacher) keeps its channel
                return None
            output = output.clone()
            output[..., channels] = 0
            return output

        return zero_hook

    def set_mode(self, mode: str) -> None:
        if mode not in ("train", "infer", "probe", "evict", "off"):
            raise ValueError(f"mode must be train, infer, probe, evict or off, got {mode!r}")
        for module in self.modules:
            module.dms.mode = mode
            module.dms.logits = module.dms.alpha = module.dms.cache = module.dms.far_attention = None

    @contextmanager
    def mode(self, mode: str) -> Iterator["DMSHandle"]:
        previous = self.modules[0].dms.mode
        self.set_mode(mode)
        try:
            yield self
        finally:
            self.set_mode(previous)

    @contextmanager
    def evicting(self, evicted: torch.Tensor) -> Iterator["DMSHandle"]:
        """Forward passes inside hide the keys ``evicted`` marks (``[B, T]`` bool, every layer and KV head alike)
        from every query more than the window later, as a trained gate's eviction would, with the gates idle."""
        with self.mode("evict"):
            for module in self.modules:
                module.dms.alpha = evicted[:, None, :].float()
            yield self

    def alphas(self) -> list[torch.Tensor]:
        """Training: each layer's straight-through eviction decisions ``[B, decisions, T]`` of the last forward."""
        return [module.dms.alpha for module in self.modules]

    def far_attentions(self) -> list[torch.Tensor]:
        """Probe: each layer's ``[B, kv_heads, T]`` far attention (see :func:`~dms_runtime.attention.far_attention`)."""
        return [module.dms.far_attention for module in self.modules]

    def new_cache(self, dense_prefill: bool = False) -> DMSCache:
        return DMSCache(len(self.modules), self.config.window, self.config.threshold, dense_prefill)

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for module in self.modules:
            del module.dms
        self.model.set_attn_implementation(self._previous_attention)


def _hand_over(gate: nn.Module, attention: nn.Module):
    """A pre-hook on a layer's input norm giving ``gate`` the layer's input (only while its gates run, so no hidden
    state is kept otherwise); the gate takes it when the attention module's pre-hook calls it."""
    def pre_hook(module, args):
        state = getattr(attention, "dms", None)
        gate.layer_input = args[0] if state is not None and state.mode != "off" else None

    return pre_hook


def attach_dms(model: nn.Module, gates: nn.ModuleList, config: DMSConfig) -> DMSHandle:
    return DMSHandle(model, gates, config)
