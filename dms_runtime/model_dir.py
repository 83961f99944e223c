"""What a model directory says about itself, read from its small JSON files and safetensors headers only (no
weights, no tokenizer): its stored dtype, context length, sampling defaults, EOS ids, tokenizer and chat template.

This is what ``thinkpool info`` reports and what a worker serves by: a directory as people have them
(``config.json``, ``generation_config.json``, ``tokenizer_config.json``, sharded safetensors) works as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
HALF_DTYPES = ("float16", "bfloat16")


def _json(path: Path) -> dict[str, Any]:
    """A JSON object file, ``{}`` when it does not exist; ValueError naming the file when it is not JSON."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error
    return data if isinstance(data, dict) else {}


def read_config(model_dir: str | Path) -> dict[str, Any]:
    return _json(Path(model_dir) / "config.json")


def stored_dtype(config: dict[str, Any]) -> str | None:
    """The dtype the weights were saved in (``dtype``, or ``torch_dtype`` in older configs)."""
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) else None


def context_length(config: dict[str, Any]) -> int | None:
    """The longest sequence (prompt and generated tokens) the model's positions were made for."""
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def generation_defaults(model_dir: str | Path) -> dict[str, float]:
    """The sampling settings ``generation_config.json`` declares (only those it has: a model without the file
    keeps thinkpool's configured defaults). ``top_k`` 0 and ``min_p`` 0 mean off."""
    config = _json(Path(model_dir) / "generation_config.json")
    return {key: config[key] for key in SAMPLING_KEYS
            if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool)}


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """Every EOS id the model may end with: ``generation_config.json``'s ``eos_token_id`` (an id or a list; Qwen3
    lists ``<|im_end|>`` and ``<|endoftext|>``), else ``config.json``'s."""
    model_dir = Path(model_dir)
    for config in (_json(model_dir / "generation_config.json"), read_config(model_dir)):
        value = config.get("eos_token_id")
        ids = value if isinstance(value, list) else [value]
        found = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
        if found:
            return found
    return []


def has_tokenizer(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether the tokenizer carries a chat template (in ``tokenizer_config.json`` or a ``chat_template`` file)."""
    model_dir = Path(model_dir)
    if (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file():
        return True
    return bool(_json(model_dir / "tokenizer_config.json").get("chat_template"))


def parameter_count(model_dir: str | Path) -> int | None:
    """Parameters in the safetensors files, from their headers (no tensor is read); None without safetensors."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    files = [f for f in files if not f.name.startswith("dms-")]  # thinkpool's adapters are not the model's
    if not files:
        return None
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                count = 1
                for size in handle.get_slice(name).get_shape():
                    count *= size
                total += count
    return total
