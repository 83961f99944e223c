"""Decode attention over the KV pool: each (row, KV head) is its own sequence of pool slots.

What is read. K and V live in :class:`~dms_runtime.kv_pool.KVPool`'s tensors as they are: ``keys`` and ``values``
``[num_slots, head_dim]``, one slot = one token of one layer and one KV head, shared by all layers. A decode step
passes, per layer:

* ``q`` ``[rows, q_heads, head_dim]``: one new query per row; query head ``h`` reads KV head
  ``h // (q_heads // kv_heads)`` (the query heads of a GQA group are adjacent, as in transformers);
* ``table`` ``[rows, kv_heads, width]`` (int32; any strides): the pool slots the (row, KV head) holds, packed at the
  front of its line, in any order;
* ``lengths`` ``[rows, kv_heads]`` (int32): how many of them there are. Entries at or past a head's length are never
  loaded, so the table's tail may hold anything, and a head is never padded to the longest one; pool slots that no
  table names (free slots, garbage, NaN) are never read either. Rows may name the same slots (a shared prompt).

Visibility: the caller compacts, there is no per-entry "visible until". In a decode step the one query is at
position ``t = length``, and an entry marked for eviction at position ``p`` stays visible while ``t - p <= window``.
:class:`~dms_runtime.paged_cache.PagedLayer` already releases every entry with ``t - p > window`` before the step's
attention (at most one per head per decode step, the token that just left its window), so what a head holds is exactly
what the query sees. A per-entry bound would cost 4 more bytes per entry read and a compare, and would only matter for
several queries at once (prefill, which goes through SDPA). What the caller must keep is the table packed: a released
entry's place is filled by the head's last entry (attention is order-free over keys; RoPE is already in K).

The Triton kernel (:func:`decode_attention_triton`) runs one program per (row, KV head, split). A program loads its
GQA group's query heads once, walks its share of the head's entries in blocks of ``block`` slots (the tail masked),
gathers each slot's K and V row (``head_dim`` contiguous elements: a whole 128-byte sector or more for head_dim >= 64
in 16-bit), and keeps an online softmax in fp32. Long heads are split (split-K): each split writes its partial max,
sum and accumulator and a small combine kernel merges them; with one split the first kernel writes the output
itself. The number of splits comes from the longest length (``max_length``, or the table's width when the caller
gives none: a host-side bound, so choosing it never waits on the device) and the number of (row, KV head) sequences,
so that a few long threads still give every SM several programs. Splits past a head's length end at once.

:func:`decode_attention_reference` is the same computation in plain torch: the oracle of the tests and the CPU path.
Triton is imported only when the kernel is first used: the module imports without it.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import Any

import torch
from torch.nn import functional as F

LOG2E = 1.4426950408889634
BLOCK = 32  # slots per inner step of a program
MIN_SPLIT_BLOCKS = 4  # a split walks at least this many blocks (fewer and the partials' traffic stops being small)
MAX_SPLITS = 128
INTERPRETER_PROGRAMS = 8  # the program count splits aim at under TRITON_INTERPRET (no SMs to fill there)


def _check(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor) -> int:
    """The GQA group size, after checking the shapes agree."""
    if q.dim() != 3 or k_pool.dim() != 2 or v_pool.shape != k_pool.shape or table.dim() != 3:
        raise ValueError("expected q [rows, q_heads, D], k_pool/v_pool [slots, D], table [rows, kv_heads, width]")
    rows, q_heads, dim = q.shape
    kv_heads = table.shape[1]
    if k_pool.shape[1] != dim or table.shape[0] != rows or tuple(lengths.shape) != (rows, kv_heads):
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, pool {tuple(k_pool.shape)}, table {tuple(table.shape)}, lengths {tuple(lengths.shape)}")
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads do not split into groups over {kv_heads} KV heads")
    if table.dtype.is_floating_point or lengths.dtype.is_floating_point:
        raise TypeError("table and lengths must be integer tensors (int32)")
    return q_heads // kv_heads


def decode_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                               lengths: torch.Tensor, scale: float, max_length: int | None = None) -> torch.Tensor:
    """``[rows, q_heads, D]`` in ``q``'s dtype: softmax attention of each query head over its KV head's first
    ``lengths`` table entries, in fp32; a head with no entries gives zeros.

    Gathers ``[rows, kv_heads, longest, D]``: only up to the longest length (``max_length``, a bound known on the
    host, spares reading it), and through a safe index, so neither slots past a head's length nor what they contain
    (NaN included) reaches the result."""
    groups = _check(q, k_pool, v_pool, table, lengths)
    rows, q_heads, dim = q.shape
    kv_heads = table.shape[1]
    longest = _longest(lengths, table, max_length)
    if rows == 0 or longest == 0:
        return torch.zeros_like(q)
    lengths = lengths.to(device=table.device, dtype=torch.long)
    valid = torch.arange(longest, device=table.device) < lengths[..., None]  # [rows, kv_heads, longest]
    index = torch.where(valid, table[..., :longest].long(), 0).flatten()
    keys = k_pool.index_select(0, index).view(rows, kv_heads, longest, dim).float()
    values = v_pool.index_select(0, index).view(rows, kv_heads, longest, dim).float()
    keep = valid[..., None]
    keys, values = torch.where(keep, keys, 0.0), torch.where(keep, values, 0.0)  # slot 0 may hold NaN
    folded = q.float().reshape(rows, kv_heads, groups, dim)
    scores = torch.einsum("rhgd,rhkd->rhgk", folded, keys) * scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty head: all -inf, softmax NaN -> 0
    out = torch.einsum("rhgk,rhkd->rhgd", probs, values)
    return out.reshape(rows, q_heads, dim).to(q.dtype)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _longest(lengths: torch.Tensor, table: torch.Tensor, max_length: int | None) -> int:
    if max_length is not None:
        return min(int(max_length), table.shape[2])
    return int(lengths.max()) if lengths.numel() else 0


def decode_attention_sdpa(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                          lengths: torch.Tensor, scale: float, max_length: int | None = None) -> torch.Tensor:
    """:func:`decode_attention_reference` through PyTorch's fused SDPA: the engine's path on the CPU, 1.3-2.4x faster
    than the reference there at the shipped model's shapes (the reference writes scores and probabilities out).

    Gathers each line up to the longest length (``max_length``, if known on the host) and masks what lies past its own
    length; the GQA group's query heads share their KV head's keys, which are never repeated. Slots past a length are
    read (through a safe index) and masked, so they must hold finite values: the pool's do (zeros, or K/V of earlier
    tokens). A head with no entries gives zeros."""
    groups = _check(q, k_pool, v_pool, table, lengths)
    rows, q_heads, dim = q.shape
    kv_heads = table.shape[1]
    longest = _longest(lengths, table, max_length)
    if rows == 0 or longest == 0:
        return torch.zeros_like(q)
    valid = torch.arange(longest, device=table.device) < lengths.unsqueeze(-1)  # [rows, kv_heads, longest]
    index = torch.where(valid, table[..., :longest], 0).view(-1)
    keys = k_pool.index_select(0, index).view(rows, kv_heads, longest, dim)
    values = v_pool.index_select(0, index).view(rows, kv_heads, longest, dim)
    # An empty head would mask everything (SDPA gives NaN there): it attends to its first entry, then gets zeros.
    empty = (lengths == 0).unsqueeze(-1)
    valid[..., :1] |= empty
    out = F.scaled_dot_product_attention(q.reshape(rows, kv_heads, groups, dim).to(k_pool.dtype), keys, values,
                                         attn_mask=valid.unsqueeze(2), scale=scale)
    return out.masked_fill(empty.unsqueeze(-1), 0.0).view(rows, q_heads, dim).to(q.dtype)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                     lengths: torch.Tensor, scale: float, *, max_length: int | None = None,
                     use_triton: bool | None = None) -> torch.Tensor:
    """The kernel where it can run, the reference otherwise.

    ``max_length``: a host-side bound on ``lengths`` (none: the table's width for the kernel, the lengths' maximum,
    read from the device, for the reference). ``use_triton=None``: Triton on CUDA tensors when it is installed.
    ``True``: Triton always (on the CPU only under ``TRITON_INTERPRET=1``, Triton's interpreter: slow, for tests).
    ``False``: the reference."""
    if use_triton is None:
        use_triton = q.is_cuda and triton_available()
    if not use_triton:
        return decode_attention_reference(q, k_pool, v_pool, table, lengths, scale, max_length)
    if not q.is_cuda and not _interpreting():
        raise RuntimeError("the Triton decode kernel needs CUDA tensors, or TRITON_INTERPRET=1 for the CPU")
    return decode_attention_triton(q, k_pool, v_pool, table, lengths, scale, max_length=max_length)


def choose_split(sequences: int, max_length: int, block: int, programs: int) -> tuple[int, int]:
    """``(split_size, splits)``: entries per split (a multiple of ``block``) and how many splits each of
    ``sequences`` (row, KV head) sequences gets, so that about ``programs`` programs run when the sequences alone are
    fewer; never under ``MIN_SPLIT_BLOCKS`` blocks a split, nor more than ``MAX_SPLITS`` splits."""
    blocks = max(1, math.ceil(max_length / block))
    wanted = math.ceil(programs / max(sequences, 1))
    splits = max(1, min(wanted, MAX_SPLITS, math.ceil(blocks / MIN_SPLIT_BLOCKS)))
    split_size = math.ceil(blocks / splits) * block
    return split_size, max(1, math.ceil(max(max_length, 1) / split_size))


def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS


def decode_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                            lengths: torch.Tensor, scale: float, *, max_length: int | None = None,
                            split_size: int | None = None, block: int = BLOCK, use_dot: bool | None = None,
                            num_warps: int = 4) -> torch.Tensor:
    """:func:`decode_attention_reference`, as a Triton kernel with split-K.

    ``max_length``: a host-side bound on ``lengths`` that sets the number of splits (default: the table's width, so
    no device sync). ``split_size``: entries per split, overriding the choice (tests use it to place split
    boundaries). ``use_dot``: the query-key and probability-value products through ``tl.dot`` with the group padded to
    16 rows (tensor cores) instead of a broadcast multiply and sum; by default on for GQA groups of 2 or more."""
    groups = _check(q, k_pool, v_pool, table, lengths)
    rows, q_heads, dim = q.shape
    kv_heads = table.shape[1]
    out = torch.empty((rows, q_heads, dim), dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    if k_pool.stride(1) != 1 or v_pool.stride(1) != 1 or q.stride(2) != 1:
        raise ValueError("q, k_pool and v_pool need contiguous rows (stride 1 over head_dim)")
    bound = table.shape[2] if max_length is None else min(int(max_length), table.shape[2])
    if split_size is None:
        split_size, splits = choose_split(rows * kv_heads, bound, block, _target_programs(q.device))
    else:
        splits = max(1, math.ceil(max(bound, 1) / split_size))
    if use_dot is None:
        use_dot = groups >= 2
    group_pad = triton_next_pow2(groups)
    if use_dot:
        group_pad = max(group_pad, 16)
        if block < 16 or triton_next_pow2(dim) < 16:
            raise ValueError("tl.dot needs blocks and head_dim of at least 16")
    dim_pad = triton_next_pow2(dim)
    partial_kernel, combine_kernel = _kernels(_interpreting())
    direct = splits == 1
    if direct:
        part_max = part_sum = part_acc = out  # unused by the kernel when it writes the output itself
    else:
        part_max = torch.empty((rows * q_heads, splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((rows * q_heads, splits, dim), dtype=torch.float32, device=q.device)
    partial_kernel[(rows * kv_heads, splits)](
        q, k_pool, v_pool, table, lengths, out, part_max, part_sum, part_acc,
        float(scale) * LOG2E, kv_heads, split_size, dim, splits,
        q.stride(0), q.stride(1), k_pool.stride(0), v_pool.stride(0),
        table.stride(0), table.stride(1), table.stride(2), lengths.stride(0), lengths.stride(1),
        out.stride(0), out.stride(1),
        GROUPS=groups, GROUP_PAD=group_pad, DIM_PAD=dim_pad, BLOCK=block, USE_DOT=bool(use_dot),
        FP32_INPUT=k_pool.dtype == torch.float32, DIRECT=direct, num_warps=num_warps,
    )
    if not direct:
        combine_kernel[(rows * q_heads,)](
            part_max, part_sum, part_acc, out, q_heads, dim, splits, out.stride(0), out.stride(1),
            SPLIT_PAD=triton_next_pow2(splits), DIM_PAD=dim_pad, num_warps=num_warps,
        )
    return out


def triton_next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def interpreted_triton() -> bool:
    """Whether triton was imported under ``TRITON_INTERPRET=1``: its language's own jitted helpers (``tl.sum``,
    ``tl.zeros``) were then made interpreted, which an interpreted kernel needs (and a compiled one cannot use)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


@lru_cache(maxsize=2)
def _kernels(interpret: bool) -> tuple[Any, Any]:
    """The two jitted kernels, built on first use (``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates, so a
    build is kept per setting)."""
    import triton
    import triton.language as tl

    if interpret != interpreted_triton():
        raise RuntimeError("TRITON_INTERPRET must be set (or unset) before triton is first imported, and stay so")

    @triton.jit
    def partial_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, lengths_ptr, out_ptr, max_ptr, sum_ptr, acc_ptr,
        qk_scale, kv_heads, split_size, dim, splits,
        stride_qr, stride_qh, stride_k, stride_v,
        stride_tr, stride_th, stride_te, stride_lr, stride_lh,
        stride_or, stride_oh,
        GROUPS: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK: tl.constexpr,
        USE_DOT: tl.constexpr, FP32_INPUT: tl.constexpr, DIRECT: tl.constexpr,
    ):
        seq = tl.program_id(0)
        split = tl.program_id(1)
        row = seq // kv_heads
        head = seq % kv_heads
        length = tl.load(lengths_ptr + row * stride_lr + head * stride_lh).to(tl.int32)
        start = split * split_size
        end = tl.minimum(start + split_size, length)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        g_ok = g < GROUPS
        d_ok = d < dim
        q_heads = head * GROUPS + g
        q_ptrs = q_ptr + row.to(tl.int64) * stride_qr + q_heads[:, None] * stride_qh + d[None, :]
        query = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if USE_DOT:
            query = query.to(k_ptr.dtype.element_ty)  # tl.dot wants both operands in the pool's dtype
        else:
            query = query.to(tl.float32)

        running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        table_row = table_ptr + row.to(tl.int64) * stride_tr + head * stride_th
        for offset in range(start, end, BLOCK):
            e = offset + tl.arange(0, BLOCK)
            e_ok = e < end
            slots = tl.load(table_row + e * stride_te, mask=e_ok, other=0).to(tl.int64)
            kv_ok = e_ok[:, None] & d_ok[None, :]
            keys = tl.load(k_ptr + slots[:, None] * stride_k + d[None, :], mask=kv_ok, other=0.0)
            values = tl.load(v_ptr + slots[:, None] * stride_v + d[None, :], mask=kv_ok, other=0.0)
            if USE_DOT:
                if FP32_INPUT:
                    scores = tl.dot(query, tl.trans(keys), input_precision="ieee")
                else:
                    scores = tl.dot(query, tl.trans(keys))
            else:
                scores = tl.sum(query[:, None, :] * keys.to(tl.float32)[None, :, :], axis=2)
            scores = tl.where(e_ok[None, :], scores * qk_scale, float("-inf"))  # [GROUP_PAD, BLOCK], log2 units
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # finite: the block has a valid entry
            rescale = tl.exp2(running_max - new_max)
            probs = tl.exp2(scores - new_max[:, None])
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            if USE_DOT:
                if FP32_INPUT:
                    update = tl.dot(probs, values, input_precision="ieee")
                else:
                    update = tl.dot(probs.to(values.dtype), values)
            else:
                update = tl.sum(probs[:, :, None] * values.to(tl.float32)[None, :, :], axis=1)
            acc = acc * rescale[:, None] + update
            running_max = new_max

        if DIRECT:
            result = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]  # an empty head: acc is 0
            out_ptrs = out_ptr + row.to(tl.int64) * stride_or + q_heads[:, None] * stride_oh + d[None, :]
            tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        else:
            part = (row.to(tl.int64) * (kv_heads * GROUPS) + q_heads) * splits + split  # [GROUP_PAD]
            tl.store(max_ptr + part, running_max, mask=g_ok)
            tl.store(sum_ptr + part, running_sum, mask=g_ok)
            tl.store(acc_ptr + part[:, None] * dim + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def combine_kernel(
        max_ptr, sum_ptr, acc_ptr, out_ptr, q_heads, dim, splits, stride_or, stride_oh,
        SPLIT_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    ):
        line = tl.program_id(0)  # row * q_heads + query head
        row = line // q_heads
        qh = line % q_heads
        base = line.to(tl.int64) * splits
        s = tl.arange(0, SPLIT_PAD)
        maxima = tl.load(max_ptr + base + s, mask=s < splits, other=float("-inf"))
        top = tl.max(maxima, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: weights exp2(-inf) = 0
        d = tl.arange(0, DIM_PAD)
        d_ok = d < dim
        total = tl.zeros([DIM_PAD], tl.float32)
        norm = tl.zeros([DIM_PAD], tl.float32)  # the softmax sum, broadcast over head_dim
        for i in range(0, splits):
            weight = tl.exp2(tl.load(max_ptr + base + i) - top)
            norm += weight * tl.load(sum_ptr + base + i)
            total += weight * tl.load(acc_ptr + (base + i) * dim + d, mask=d_ok, other=0.0)
        result = total / tl.where(norm > 0, norm, 1.0)
        out_ptrs = out_ptr + row.to(tl.int64) * stride_or + qh * stride_oh + d
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=d_ok)

    return partial_kernel, combine_kernel
