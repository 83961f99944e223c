"""Training runs in bf16 only where the hardware computes in bf16 (training/precision.py)."""

import torch

from training.precision import autocast, cpu_has_native_bf16, uses_bf16


def test_cpu_autocast_follows_native_bf16_support():
    layer = torch.nn.Linear(8, 8)
    with autocast("cpu"):
        out = layer(torch.randn(2, 8))
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert out.dtype == expected
    assert uses_bf16("cpu") == cpu_has_native_bf16()


def test_cuda_always_uses_bf16_and_other_devices_never():
    assert uses_bf16("cuda")
    assert uses_bf16(torch.device("cuda", 0))
    assert not uses_bf16("meta")
