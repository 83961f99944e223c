"""Loading a base model and its tokenizer from a local directory (never from a hub), and its KV geometry."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_MODEL = REPO_ROOT / "checkpoints" / "chain-qwen3"


class ModelLoadError(ValueError):
    """A model path that cannot be loaded; the message says which path and why."""


def default_model_path() -> Path:
    """The model served by default: ``$THINKPOOL_MODEL`` or the checkpoint shipped in the repository."""
    return Path(os.environ.get("THINKPOOL_MODEL", SHIPPED_MODEL))


def load_model(
    path: str | Path | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    path = Path(path) if path is not None else default_model_path()
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no model at {path}: expected a Hugging Face checkpoint directory with config.json")
    hf_logging.disable_progress_bar()  # a per-tensor bar for a 2.6M-parameter model is only noise
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).to(device)
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
