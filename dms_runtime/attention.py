"""DMS attention, registered with transformers' attention interface under the name ``"dms"``.

Model code is untouched: the attention modules call this function through ``ALL_ATTENTION_FUNCTIONS``
and find their gate logits (set by a pre-hook, see :mod:`dms_runtime.attach`) on ``module.dms``.

* Training (``module.dms.mode == "train"``): full-sequence attention where, for queries more than ``w``
  positions after key ``j``, the score of ``j`` gets ``log(1 - alpha_j)``. ``alpha_j`` is a hard decision
  from the noisy, temperature-scaled gate in the forward pass with a straight-through gradient. On the CPU
  it runs through the fused kernel of :mod:`dms_runtime.evicting_attention`.
* Inference (``"infer"``): attention over the slots of a :class:`~dms_runtime.cache.DMSCache`, with the
  visibility mask the cache computes (occupied, causal, padding, and delayed eviction); a cache that reads its
  own storage (the engine's :class:`~dms_runtime.paged_cache.PagedDMSCache`, whose ``attend`` reads the KV pool)
  computes the attention itself.
* Probe (``"probe"``): the vanilla model's attention, its probabilities also written out so that it can report, per
  KV head and key, the most attention the key receives from any query more than ``w`` positions later
  (:func:`far_attention`): what a key is still needed for once it has left the window. Retrofit uses it
  to warm-start the gates.
* Evict (``"evict"``): the training attention under an eviction the caller sets (``alpha``: 1 for the keys hidden
  from queries more than ``w`` positions later), the gates idle: what losing those keys costs the model
  (:meth:`~dms_runtime.attach.DMSHandle.evicting`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dms_runtime.evicting_attention import evicting_attention

NEG = -1e9


@dataclass
class LayerState:
    """What one attention module needs from DMS during a forward pass."""

    mode: str = "off"  # "train" | "infer" | "probe" | "evict" | "off"
    window: int = 16
    temperature: float = 0.1
    noise: bool = True  # training: logistic noise on the gates; off gives deterministic decisions
    logits: torch.Tensor | None = None  # [B, T, decisions]: logit at t decides about token t-1
    alpha: torch.Tensor | None = None  # training: [B, decisions, T] straight-through eviction decisions; evict: given
    cache: object | None = None
    far_attention: torch.Tensor | None = None  # probe: [B, kv_heads, T], see far_attention()
    extras: dict = field(default_factory=dict)


def shifted_decisions(logits: torch.Tensor) -> torch.Tensor:
    """Per-key decision logits ``[B, decisions, T]``: key j gets the logit computed at position j+1.

    The last key has no decision yet: it gets a very negative logit (kept)."""
    decision = torch.cat([logits[:, 1:], torch.full_like(logits[:, :1], NEG)], dim=1)
    return decision.transpose(1, 2)


def straight_through_alpha(decision_logits: torch.Tensor, temperature: float, noise: bool = True) -> torch.Tensor:
    """Hard 0/1 eviction decisions in the forward pass; the gradient of the noisy relaxed sigmoid."""
    if noise:
        uniform = torch.rand_like(decision_logits).clamp(1e-6, 1 - 1e-6)
        decision_logits = decision_logits + torch.log(uniform) - torch.log1p(-uniform)  # logistic noise
    soft = torch.sigmoid(decision_logits / temperature)
    hard = (soft > 0.5).to(soft.dtype)
    return hard + soft - soft.detach()


def eviction_bias(alpha: torch.Tensor, q_len: int, window: int) -> torch.Tensor:
    """Additive score bias ``[B, decisions, q, k]``: ``log(1 - alpha_j)`` where ``i - j > window``, else 0.

    Forward: 0 or a large negative (hard); backward: the gradient of ``log(1 - soft)``."""
    k_len = alpha.shape[-1]
    soft_log = torch.log1p(-alpha.clamp(max=1 - 1e-6))
    hard_log = torch.where(alpha.detach() > 0.5, torch.full_like(alpha, NEG), torch.zeros_like(alpha))
    per_key = hard_log + soft_log - soft_log.detach()
    query_pos = torch.arange(k_len - q_len, k_len, device=alpha.device)[:, None]
    beyond = (query_pos - torch.arange(k_len, device=alpha.device)[None, :]) > window
    return per_key[:, :, None, :] * beyond


def _expand_groups(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, kv_heads, ...] -> [B, kv_heads * groups, ...] (query heads of a KV group are adjacent)."""
    return tensor.repeat_interleave(groups, dim=1) if groups > 1 else tensor


def _base_mask(attention_mask: torch.Tensor | None, q_len: int, k_len: int, device) -> torch.Tensor:
    """Boolean ``[B|1, 1, q, k]`` mask: the one transformers built, or causal."""
    if attention_mask is None:
        query_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
        return (torch.arange(k_len, device=device)[None, :] <= query_pos)[None, None]
    if attention_mask.dtype != torch.bool:
        return attention_mask > NEG / 2
    return attention_mask


def dms_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    if zeroed := getattr(module, "zeroed_query_heads", None):  # a query channel repurposed as a gate stays zero
        query = query.clone()  # after RoPE too (dms_runtime.nvidia_layout)
        query[:, zeroed, :, -1] = 0
    state: LayerState | None = getattr(module, "dms", None)
    if state is None or state.mode == "off":
        allowed = _base_mask(attention_mask, query.shape[2], key.shape[2], query.device)
        return grouped_sdpa(query, key, value, allowed, scaling), None
    if state.mode == "train":
        return _train_attention(module, state, query, key, value, attention_mask, scaling)
    if state.mode == "probe":
        return _probe_attention(module, state, query, key, value, attention_mask, scaling)
    if state.mode == "evict":
        return _given_eviction_attention(state, query, key, value, attention_mask, scaling)
    attend = getattr(state.cache, "attend", None)  # the engine's PagedDMSCache reads its pool itself
    if attend is not None:
        return attend(module.layer_idx, query, key, value, scaling), None
    visible = state.cache.visibility(module.layer_idx, attention_mask)  # [B, kv_heads, q, slots]
    return grouped_sdpa(query, key, value, visible, scaling), None


def grouped_sdpa(query, key, value, visible: torch.Tensor, scaling) -> torch.Tensor:
    """Attention ``[B, q, Hq, D]`` of ``query [B, Hq, q, D]`` over ``key/value [B, Hkv, k, D]`` with a per-KV-head
    mask (boolean, or float: added to the scores).

    The query heads of a KV group are folded into that group's query axis, so keys and values are never
    repeated per query head (the mask is repeated when q > 1)."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    folded = query.reshape(batch, kv_heads, groups * q_len, dim)
    mask = visible if visible.shape[1] == kv_heads else visible.expand(-1, kv_heads, -1, -1)
    if q_len > 1 and groups > 1:
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], kv_heads, groups * q_len, -1)
    out = F.scaled_dot_product_attention(folded, key.to(query.dtype), value.to(query.dtype), attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous()


def _train_attention(module, state: LayerState, query, key, value, attention_mask, scaling):
    q_len, k_len = query.shape[2], key.shape[2]
    if q_len != k_len:
        raise ValueError("DMS training attention needs the whole sequence at once (no cache)")
    state.alpha = straight_through_alpha(shifted_decisions(state.logits.float()), state.temperature, state.noise)
    return _given_eviction_attention(state, query, key, value, attention_mask, scaling)


def _given_eviction_attention(state: LayerState, query, key, value, attention_mask, scaling):
    """The training attention under ``state.alpha`` (``[B, decisions | 1, T]``): the gates' decisions in training,
    the caller's in evict mode."""
    allowed = _base_mask(attention_mask, query.shape[2], key.shape[2], query.device)
    attend = evicting_attention if query.device.type == "cpu" else _bias_mask_attention
    return attend(query, key, value, state.alpha, allowed, state.window, scaling), None


def _bias_mask_attention(query, key, value, alpha: torch.Tensor, allowed: torch.Tensor, window: int, scaling) -> torch.Tensor:
    """Training attention with the eviction bias handed to SDPA as a float mask, whose backward then also
    differentiates the mask (the gates' straight-through gradient): 1.5x faster than the attention written out,
    and what CUDA runs. The CPU's fused kernel (:mod:`dms_runtime.evicting_attention`) is faster still
    (``research/bench_training.py``)."""
    bias = eviction_bias(alpha, query.shape[2], window)  # [B, decisions, q, k]; spread over all KV heads below
    return grouped_sdpa(query, key, value, bias.to(query.dtype).masked_fill(~allowed, float("-inf")), scaling)


def _attention_probs(query, key, allowed: torch.Tensor, scaling, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probabilities ``[B, heads, q, k]`` written out in float32; ``bias`` ``[B, kv_heads, q, k]`` is
    added per KV head."""
    groups = query.shape[1] // key.shape[1]
    scores = torch.matmul(query.float(), _expand_groups(key, groups).float().transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
    if bias is not None:
        scores = scores + _expand_groups(bias, groups)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


def _explicit_attention(query, key, value, allowed: torch.Tensor, scaling, bias: torch.Tensor | None = None):
    """Attention written out (float32), the reference the fused paths are tested against: returns the output
    ``[B, q, heads, D]`` and the probabilities ``[B, heads, q, k]``."""
    probs = _attention_probs(query, key, allowed, scaling, bias)
    out = torch.matmul(probs, _expand_groups(value, query.shape[1] // key.shape[1]).float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), probs


def far_attention(probs: torch.Tensor, kv_heads: int, window: int) -> torch.Tensor:
    """``[B, kv_heads, k]``: per key, the largest weight any query head of its KV group gives it from a query
    more than ``window`` positions later (0 for keys no such query exists for)."""
    batch, heads, q_len, k_len = probs.shape
    grouped = probs.reshape(batch, kv_heads, heads // kv_heads, q_len, k_len).amax(2)
    query_pos = torch.arange(k_len - q_len, k_len, device=probs.device)[:, None]
    beyond = (query_pos - torch.arange(k_len, device=probs.device)[None, :]) > window
    return (grouped * beyond).amax(2)


def _probe_attention(module, state: LayerState, query, key, value, attention_mask, scaling):
    """The vanilla output through SDPA; the probabilities written out only for :func:`far_attention`."""
    allowed = _base_mask(attention_mask, query.shape[2], key.shape[2], query.device)
    state.far_attention = far_attention(_attention_probs(query, key, allowed, scaling), key.shape[1], state.window).detach()
    return grouped_sdpa(query, key, value, allowed, scaling), None


AttentionInterface.register("dms", dms_attention)
AttentionMaskInterface.register("dms", sdpa_mask)
