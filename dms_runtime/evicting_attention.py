"""DMS training attention on the CPU through PyTorch's fused flash-attention kernel.

In training the forward pass uses *hard* decisions: beyond the window an evicted key is simply masked, a kept one
is not. The gates learn from the straight-through gradient of the soft bias ``log(1 - alpha_j)`` that DMS adds
to the scores of key ``j`` from queries more than ``w`` positions later: the sum of the score gradients
``dS_ij`` over those queries. Handing SDPA the bias as a float mask that requires a gradient keeps it off the
fused kernel, which takes only a fixed mask: one layer's attention 2.2-3.6x slower, the whole training pass
2.85x (``research/bench_training.py``). This module keeps the fused kernel and gets the per-key sum from it:

* an extra head dimension, ``1/scale`` on every query and ``0`` on every key, changes no score, and the kernel's
  key gradient in that dimension is exactly ``sum_i dS_ij`` over all queries;
* the queries inside the window (at most ``w + 1`` per key) are subtracted, recomputed from the kernel's
  log-sum-exp: ``dS_ij = P_ij (dO_i . V_j - dO_i . O_i)``.

The result matches the bias-as-mask path (``tests/test_dms.py``). The kernel is CPU-only; CUDA keeps that path.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def window_band(allowed: torch.Tensor, window: int) -> torch.Tensor:
    """``[B|1, 1, T, w+1]`` from a boolean ``[B|1, 1, T, T]`` mask: entry ``(i, u)`` is ``allowed[i, i - w + u]``
    (False where that key would be before the start)."""
    length = allowed.shape[-1]
    padded = F.pad(allowed, (window, 0), value=False)  # key j sits at column j + w
    columns = torch.arange(length, device=allowed.device)[:, None] + torch.arange(window + 1, device=allowed.device)
    return padded.gather(-1, columns.expand(*padded.shape[:-1], window + 1))


def _window_products(a: torch.Tensor, b: torch.Tensor, window: int, block: int = 64) -> torch.Tensor:
    """``[N, G, T, w+1]``: entry ``(i, u)`` is ``a_i . b_j`` for ``j = i - w + u`` (0 where ``j < 0``), from
    ``a [N, G, T, D]`` and ``b [N, T, D]``. Computed as dense products of blocks of ``block`` queries with their
    ``block + w`` keys: matrix products beat gathering every query's window."""
    rows, groups, length, dim = a.shape
    blocks = -(-length // block)
    padded = blocks * block
    a_blocks = F.pad(a, (0, 0, 0, padded - length)).view(rows, groups, blocks, block, dim).transpose(1, 2)
    b_blocks = F.pad(b, (0, 0, window, padded - length)).unfold(1, block + window, block)  # [N, blocks, D, block + w]
    dense = torch.matmul(a_blocks, b_blocks[:, :, None])  # [N, blocks, G, block, block + w]: key column r + u
    columns = torch.arange(block, device=a.device)[:, None] + torch.arange(window + 1, device=a.device)
    band = dense.gather(-1, columns.expand(*dense.shape[:-1], window + 1))
    return band.transpose(1, 2).reshape(rows, groups, padded, window + 1)[:, :, :length]


def _in_window_score_gradients(query, key, value, out, grad_out, lse, band, window: int, scale: float) -> torch.Tensor:
    """``[N, T]``: per key ``j``, the sum of ``dS_ij`` over the queries ``i = j .. j + w`` of all G query heads
    (``query/out/grad_out [N, G, T, D]``, ``key/value [N, T, D]``, ``lse [N, G, T]``, ``band [N, 1, T, w+1]``)."""
    rows, groups, length, dim = query.shape
    q, grad_o = query.float(), grad_out.float()
    delta = (grad_o * out.float()).sum(-1, keepdim=True)  # dO_i . O_i
    scores = _window_products(q, key.float(), window) * scale
    probs = torch.exp(scores.masked_fill(~band, float("-inf")) - lse.float()[..., None])
    grad_p = _window_products(grad_o, value.float(), window)
    per_query = F.pad((probs * (grad_p - delta)).sum(1), (0, 0, 0, window))  # [rows, T + w (query i), w+1]
    totals = torch.zeros(rows, length, device=query.device)
    for u in range(window + 1):  # key j = i - w + u collects row i = j + w - u
        totals += per_query[:, window - u:window - u + length, u]
    return totals


class _EvictingAttention(torch.autograd.Function):
    """Fused attention of ``query [B*kv, G, T, D]`` (the G query heads of each KV head) over ``key/value
    [B*kv, 1, T, D]`` under a float mask ``[B*kv, 1, T, T]``, whose backward also returns the gradient of
    ``soft_log [B*kv, T]``: the per-key bias that applies, with a zero forward value, from beyond the window."""

    @staticmethod
    def forward(ctx, query, key, value, soft_log, mask, band, window: int, scale: float):
        dim, groups = query.shape[-1], query.shape[1]
        q = F.pad(query, (0, 1), value=1.0 / scale)
        k, v = (F.pad(t, (0, 1)).expand(-1, groups, -1, -1).contiguous() for t in (key, value))
        out, lse = _flash(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, mask, band)
        ctx.window, ctx.scale, ctx.dim = window, scale, dim
        return out[..., :dim]

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, mask, band = ctx.saved_tensors
        dim = ctx.dim
        grad_out = F.pad(grad_out, (0, 1)).contiguous()
        grad_q, grad_k, grad_v = _flash_backward(grad_out, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=ctx.scale)
        grad_soft = None
        if ctx.needs_input_grad[3]:
            every_query = grad_k[..., dim].float().sum(1)  # sum_i dS_ij over the group's queries: the module docstring
            grad_soft = every_query - _in_window_score_gradients(q[..., :dim], k[:, 0, :, :dim], v[:, 0, :, :dim], out[..., :dim],
                                                                 grad_out[..., :dim], lse, band, ctx.window, ctx.scale)
        grad_k, grad_v = (g[..., :dim].sum(1, keepdim=True) for g in (grad_k, grad_v))
        return grad_q[..., :dim], grad_k, grad_v, grad_soft, None, None, None, None


def evicting_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, alpha: torch.Tensor,
                       allowed: torch.Tensor, window: int, scaling: float | None) -> torch.Tensor:
    """DMS training attention: ``query [B, Hq, T, D]``, ``key/value [B, Hkv, T, D]``, straight-through decisions
    ``alpha [B, decisions, T]`` (one per KV head, or one for all), boolean ``allowed [B|1, 1, T, T]``.
    Returns ``[B, T, Hq, D]``, what the bias-as-mask path returns, with the same gradients."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    soft_log = torch.log1p(-alpha.clamp(max=1 - 1e-6)).expand(-1, kv_heads, -1).reshape(batch * kv_heads, length)
    positions = torch.arange(length, device=query.device)
    beyond = (positions[:, None] - positions[None, :]) > window
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    eviction = zero.masked_fill(alpha.detach() > 0.5, float("-inf")).expand(-1, kv_heads, -1)[:, :, None, :]  # hard
    mask = torch.where(beyond, eviction, 0.0).to(query.dtype) + zero.masked_fill(~allowed, float("-inf"))  # [B, kv, T, T]
    band = window_band(allowed, window).expand(batch, kv_heads, -1, -1).reshape(batch * kv_heads, 1, length, window + 1)
    out = _EvictingAttention.apply(
        query.reshape(batch * kv_heads, groups, length, dim),  # the query heads of a KV group are adjacent
        *(t.to(query.dtype).reshape(batch * kv_heads, 1, length, dim) for t in (key, value)),
        soft_log, mask.reshape(batch * kv_heads, 1, length, length), band, window, scaling or dim ** -0.5)
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous()
