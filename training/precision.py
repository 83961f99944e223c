"""Mixed precision for training: bf16 autocast where the hardware computes in bf16, none where it would emulate it.

On a CUDA GPU, and on CPUs with native bf16 (AVX-512 BF16 or AMX), bf16 autocast speeds a training step up
(about 2.5x on an AVX-512 BF16 CPU). On a CPU without it (AVX2 only), oneDNN emulates bf16 and the same
step ran 13x *slower* than in fp32 (25.2 s against 1.9 s for a forward and backward pass over 6,000 tokens of
the shipped model: ``research/bench_training.py``). Weights and optimizer stay fp32 either way.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: assume emulation
        return False


def uses_bf16(device: str | torch.device) -> bool:
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and cpu_has_native_bf16())


def autocast(device: str | torch.device) -> torch.autocast:
    """``torch.autocast`` in bf16 when :func:`uses_bf16`, a disabled one otherwise."""
    kind = torch.device(device).type
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=uses_bf16(device))
