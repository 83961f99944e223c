"""DMS's delayed-eviction rule, once, for every cache that stores tokens (``DMSCache``, ``PagedDMSCache``).

Two facts make the rule: the gate logit computed at position t decides the fate of token t-1 (so a pass
over positions ``start .. start+q-1`` decides tokens ``start-1 .. start+q-2``), and a token marked for
eviction stays visible for ``window`` more positions, then is gone for good.
"""

from __future__ import annotations

import torch


def decided_marks(logits: torch.Tensor, threshold: float, pos: torch.Tensor, occupied: torch.Tensor,
                  start: torch.Tensor, q_len: int) -> torch.Tensor:
    """``[rows, heads, entries]``: the entries this pass's gate ``logits`` (``[rows, q, decisions]``, one decision
    per head, or one per layer that every head follows) mark for eviction; ``start`` is each row's first position."""
    marks = (logits > threshold).transpose(1, 2).expand(-1, pos.shape[1], -1)  # [rows, heads, q]
    if q_len == 1:  # decoding: only token start-1 is decided
        return occupied & (pos == (start - 1)[:, None, None]) & marks
    relative = pos - (start - 1)[:, None, None]
    in_range = occupied & (relative >= 0) & (relative < q_len)
    return in_range & marks.gather(2, relative.clamp(0, q_len - 1))


def expired(evict: torch.Tensor, pos: torch.Tensor, query_pos: torch.Tensor, window: torch.Tensor | int) -> torch.Tensor:
    """Which marked entries a query at ``query_pos`` can no longer see (shapes broadcast): more than ``window`` back."""
    return evict & (query_pos - pos > window)
