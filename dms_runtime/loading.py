"""Loading a base model and its tokenizer from a local directory (never from a hub), and its KV geometry."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from dms_runtime.model_dir import HALF_DTYPES, has_tokenizer, read_config, stored_dtype

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_MODEL = REPO_ROOT / "checkpoints" / "chain-qwen3"


class ModelLoadError(ValueError):
    """A model path that cannot be loaded; the message says which path and why."""


def default_model_path() -> Path:
    """The model served by default: ``$THINKPOOL_MODEL`` or the checkpoint shipped in the repository."""
    return Path(os.environ.get("THINKPOOL_MODEL", SHIPPED_MODEL))


def load_dtype(path: str | Path, device: str) -> torch.dtype:
    """fp32 on the CPU (the small models it serves; its half-precision kernels are slow); on a GPU the dtype the
    weights were stored in, bf16 or fp16 (bf16 for weights stored in fp32 or undeclared: fp32 wastes GPU memory)."""
    if not str(device).startswith("cuda"):
        return torch.float32
    stored = stored_dtype(read_config(path))
    return getattr(torch, stored) if stored in HALF_DTYPES else torch.bfloat16


def check_model_dir(path: str | Path) -> None:
    """Refuse, before anything loads, a directory that cannot be served: no ``config.json``, no tokenizer, or
    NVIDIA DMS settings their code would refuse (``ModelLoadError`` naming the path or the field)."""
    from dms_runtime.nvidia_layout import read_dms_config

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no model at {path}: expected a Hugging Face checkpoint directory with config.json")
    if not has_tokenizer(path):
        raise ModelLoadError(f"no tokenizer in {path}: expected tokenizer.json (or tokenizer.model / vocab.json) "
                             "beside config.json")
    try:
        read_dms_config(path)
    except ValueError as error:
        raise ModelLoadError(f"{path}: {error}") from error


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The directory's own tokenizer (``ModelLoadError`` when it has none or it does not load)."""
    path = Path(path)
    if not has_tokenizer(path):
        raise ModelLoadError(f"no tokenizer in {path}: expected tokenizer.json (or tokenizer.model / vocab.json) "
                             "beside config.json")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"the tokenizer in {path} does not load: {error}") from error


def load_model(
    path: str | Path | None = None, device: str = "cpu", dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of a local directory (one file or sharded safetensors, any stored dtype), in
    ``dtype`` (default :func:`load_dtype`). An NVIDIA DMS directory loads as its plain model: its gate tensors
    are read by :mod:`dms_runtime.nvidia_layout`, so transformers' note that it left them out is silenced."""
    path = Path(path) if path is not None else default_model_path()
    check_model_dir(path)
    hf_logging.disable_progress_bar()  # a per-tensor bar for a 2.6M-parameter model is only noise
    tokenizer = load_tokenizer(path)
    verbosity = hf_logging.get_verbosity()
    if any(key.startswith("dms_") for key in read_config(path)):
        hf_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                     dtype=dtype or load_dtype(path, device)).to(device)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.eval()
    return model, tokenizer


@dataclass(frozen=True)
class KVGeometry:
    """What one token costs in KV memory: K and V for every layer and KV head."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_head_token(self) -> int:
        """One token in one layer's one KV head (the unit DMS frees)."""
        return 2 * self.head_dim * self.dtype_bytes

    def as_dict(self) -> dict:
        return asdict(self) | {"kv_bytes_per_token": self.kv_bytes_per_token}


def kv_geometry(model: PreTrainedModel) -> KVGeometry:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype_bytes = next(model.parameters()).element_size()
    return KVGeometry(config.num_hidden_layers, config.num_key_value_heads, head_dim, dtype_bytes)
