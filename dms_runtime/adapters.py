"""DMS adapter files: the gate weights of one compression ratio, saved beside their base model.

``<model>/dms-8x.safetensors`` holds the gates; its header metadata (mirrored in ``dms-8x.json`` for people)
records the base model's fingerprint, the target ratio, the window and the parametrization. Loading checks
the fingerprint, so an adapter cannot silently be applied to a model it was not trained for.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from dms_runtime.attach import DMSHandle, attach_dms
from dms_runtime.config import DMSConfig
from dms_runtime.gates import build_gates


class AdapterError(ValueError):
    """An adapter that is missing, malformed, or made for another base model."""


_RUNTIME_KEYS = {"dtype", "torch_dtype", "_name_or_path", "transformers_version", "use_cache", "_attn_implementation_autoset"}


def model_fingerprint(model: nn.Module, gates: nn.Module | None = None) -> str:
    """A short hash of a model's architecture and weights: names, shapes and sampled values.

    Values are compared at bf16 precision, so the same weights loaded in fp32 on a CPU or in bf16 on a GPU
    have the same fingerprint, while any retraining changes it. ``gates``: weights stored in the model's own
    checkpoint that transformers leaves out of the model (an NVIDIA directory's separate gates), hashed too; gates
    without weights of their own leave the fingerprint as the model's."""
    config = {k: v for k, v in model.config.to_diff_dict().items() if k not in _RUNTIME_KEYS}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    state = dict(model.state_dict())
    if gates is not None:
        state.update({f"dms_gates.{name}": tensor for name, tensor in gates.state_dict().items()})
    for name, tensor in sorted(state.items()):
        flat = tensor.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 256)][:256].to(torch.bfloat16).float().cpu().numpy()
        digest.update(f"{name}:{tuple(tensor.shape)}".encode())
        digest.update(sample.tobytes())
    return digest.hexdigest()[:16]


def adapter_path(model_dir: str | Path, cr: float) -> Path:
    return Path(model_dir) / f"dms-{cr:g}x.safetensors"


def save_adapter(path: str | Path, gates: nn.ModuleList, config: DMSConfig, base: nn.Module, target_cr: float, extra: dict | None = None) -> Path:
    path = Path(path)
    metadata = {
        "format": "thinkpool-dms-adapter/1",
        "base_fingerprint": model_fingerprint(base),
        "base_architecture": type(base).__name__,
        "target_cr": f"{target_cr:g}",
        "dms_config": json.dumps(config.as_dict()),
        **{k: json.dumps(v) for k, v in (extra or {}).items()},
    }
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in gates.state_dict().items()}
    _write(path, tensors, metadata)
    return path


def set_threshold(path: str | Path, threshold: float, extra: dict | None = None) -> None:
    """Rewrite an adapter's decision threshold (and ``extra`` metadata) in place; the gate weights are unchanged."""
    settings = json.loads(_raw_metadata(Path(path))["dms_config"])
    update_metadata(path, {"dms_config": settings | {"threshold": float(threshold)}} | (extra or {}))


def update_metadata(path: str | Path, entries: dict) -> None:
    """Add or replace metadata ``entries`` of an adapter in place; the gate weights are unchanged."""
    path = Path(path)
    metadata = _raw_metadata(path)
    metadata.update({k: json.dumps(v) for k, v in entries.items()})
    _write(path, load_file(str(path)), metadata)


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The adapter file, and its metadata mirrored as JSON beside it for people."""
    save_file(tensors, str(path), metadata=metadata)
    path.with_suffix(".json").write_text(json.dumps({k: _loads(v) for k, v in metadata.items()}, indent=2) + "\n")


def _loads(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _raw_metadata(path: Path) -> dict[str, str]:
    """The adapter's header metadata as stored (JSON strings); refuses a file that is not an adapter."""
    if not path.is_file():
        raise AdapterError(f"no DMS adapter at {path}")
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if metadata.get("format") != "thinkpool-dms-adapter/1":
        raise AdapterError(f"{path} is not a thinkpool DMS adapter")
    return dict(metadata)


def read_adapter_metadata(path: str | Path) -> dict:
    return {k: _loads(v) for k, v in _raw_metadata(Path(path)).items()}


def load_gates(model: nn.Module, path: str | Path, threshold: float | None = None, check_base: bool = True) -> tuple[nn.ModuleList, DMSConfig]:
    """The gates saved at ``path`` (not attached) and their settings; refuses an adapter made for another base model."""
    metadata = read_adapter_metadata(path)
    if check_base:
        fingerprint = model_fingerprint(model)
        if metadata["base_fingerprint"] != fingerprint:
            raise AdapterError(
                f"{path} was trained for base model {metadata['base_fingerprint']} "
                f"({metadata['base_architecture']}), not for this one ({fingerprint})"
            )
    settings = dict(metadata["dms_config"])
    if threshold is not None:
        settings["threshold"] = threshold
    config = DMSConfig(**settings)
    gates = build_gates(model, config)
    gates.load_state_dict(load_file(str(path)))
    gates.to(next(model.parameters()).device)
    return gates, config


def load_adapter(model: nn.Module, path: str | Path, threshold: float | None = None, check_base: bool = True) -> DMSHandle:
    """Attach the gates saved at ``path`` to ``model`` (see :func:`load_gates`)."""
    gates, config = load_gates(model, path, threshold, check_base)
    return attach_dms(model, gates, config)
