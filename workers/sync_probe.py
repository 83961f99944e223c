"""Counting what makes the host wait for the device, on any device (the CPU included).

``torch.cuda.set_sync_debug_mode`` reports synchronisations only on CUDA. :class:`SyncProbe` sees every operation
torch dispatches while it is active and records those whose result the host must wait for: a tensor read as a Python
number or bool (``item``, ``bool(t)``, ``int(t)``), data-dependent shapes (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``, ``repeat_interleave`` without its output size), and copies from a device to the host.
On the CPU nothing waits, but the same operations would on a GPU, so a test on the CPU can hold code to "no reads in
the layer loop". A read the caller means to make (the engine's one read per step) goes through
:func:`read_to_host`, which the probe counts apart.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_ALWAYS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.is_nonzero.default,
           aten.equal.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default}
# Python-level reads: seen here as well, since a CPU tensor's (under inference mode) may not be dispatched at all
_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
_active: list["SyncProbe"] = []
_inside = [False]  # in a patched read: the operations it dispatches are that read, counted once


def _is_mask(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in (torch.bool, torch.uint8)


def _syncs(func, args, kwargs) -> bool:
    if func in _ALWAYS:
        return True
    packet = func.overloadpacket
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        return any(_is_mask(index) for index in (args[1] if len(args) > 1 else ()) if index is not None)
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):  # repeats as a tensor
        size_at = 1 if func is aten.repeat_interleave.Tensor else 3
        return kwargs.get("output_size") is None and (len(args) <= size_at or args[size_at] is None)
    if packet is aten._to_copy:
        source, device = args[0], kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu" and source.device.type != "cpu"
    if packet is aten.copy_:
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


class SyncProbe(TorchDispatchMode):
    """``with SyncProbe() as probe: ...``; then ``probe.syncs`` (how many), ``probe.ops`` (which) and ``probe.reads``
    (the intended reads, through :func:`read_to_host`)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.reads = 0

    @property
    def syncs(self) -> int:
        return sum(self.ops.values())

    def __enter__(self):
        if not _active:
            self._originals = {name: getattr(torch.Tensor, name) for name in _READS}
            for name, original in self._originals.items():
                setattr(torch.Tensor, name, _counted(name, original))
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active.remove(self)
        if not _active:
            for name, original in self._originals.items():
                setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _inside[0] and _syncs(func, args, kwargs):
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)


def _counted(name: str, original):
    def read(self, *args, **kwargs):
        if _inside[0] or not _active:
            return original(self, *args, **kwargs)
        for probe in _active:
            probe.ops[name] += 1
        _inside[0] = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _inside[0] = False
    return read


def read_to_host(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``: a read of the device that the caller intends (counted as a read, not as a sync)."""
    if not _active:
        return tensor.tolist()
    for probe in _active:
        probe.reads += 1
    _inside[0] = True
    try:
        return tensor.tolist()
    finally:
        _inside[0] = False
