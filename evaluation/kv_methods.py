"""The ways a worker can keep threads' KV caches, by name: vanilla, a DMS adapter, or a training-free press."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dms_runtime.adapters import AdapterError, adapter_path, load_adapter
from evaluation.baselines import BASELINES, HeldRatioPress
from evaluation.reference_decode import KVPolicy


@dataclass(frozen=True)
class KVMethod:
    """``kind`` is ``vanilla``, ``dms`` (trained gates at ratio ``ratio``) or a baseline name held to ``ratio``."""

    kind: str
    ratio: float = 1.0

    @property
    def label(self) -> str:
        if self.kind == "vanilla":
            return "vanilla"
        return f"{self.kind}-{self.ratio:g}x"

    @classmethod
    def dms(cls, cr: float) -> "KVMethod":
        return cls("vanilla") if cr == 1 else cls("dms", cr)

    @classmethod
    def baseline(cls, name: str, compression: float) -> "KVMethod":
        if name not in BASELINES:
            raise ValueError(f"unknown press {name!r}; expected one of {', '.join(BASELINES)}")
        return cls(name, compression)


def check_available(method: KVMethod, model_dir: str | Path) -> None:
    """Raise a clear error before any work starts if ``method`` cannot run on this model."""
    if method.kind == "dms" and not adapter_path(model_dir, method.ratio).is_file():
        raise AdapterError(f"no DMS adapter for {method.ratio:g}x at {adapter_path(model_dir, method.ratio)}")


@contextmanager
def kv_policy(method: KVMethod, model, model_dir: str | Path) -> Iterator[KVPolicy]:
    """The decode loop's KV policy for ``method``; DMS gates are attached only inside the block."""
    if method.kind == "vanilla":
        yield KVPolicy()
    elif method.kind == "dms":
        handle = load_adapter(model, adapter_path(model_dir, method.ratio))
        try:
            yield KVPolicy(dms=handle)
        finally:
            handle.detach()
    else:
        yield KVPolicy(press=HeldRatioPress(method=method.kind, compression=method.ratio))
