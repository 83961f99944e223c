"""Run configs in YAML that may start from another one: ``base: retrofit_chain.yaml`` (relative to the file).

A variant then holds only what it changes, so the recipe it shares with its base is written once. Sections
(mappings) merge key by key; any other value replaces the base's.
"""

from __future__ import annotations

from pathlib import Path

import yaml


class ConfigFileError(ValueError):
    """A config file that cannot be read: missing, not a mapping, or a ``base`` chain that loops."""


def load_yaml_config(path: str | Path) -> dict:
    """The config at ``path`` with its ``base`` chain resolved (the file's own values win)."""
    return _load(Path(path), ())


def _load(path: Path, chain: tuple[Path, ...]) -> dict:
    resolved = path.resolve()
    if resolved in chain:
        raise ConfigFileError(f"{path}: 'base' chain loops ({' -> '.join(p.name for p in (*chain, resolved))})")
    if not path.is_file():
        where = f" (the 'base' of {chain[-1]})" if chain else ""
        raise ConfigFileError(f"{path}: file not found{where}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: a config is a mapping of settings, not {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    return merged(_load(path.parent / str(base), (*chain, resolved)), data)


def merged(base: dict, override: dict) -> dict:
    """``override`` over ``base``, merging nested mappings rather than replacing them."""
    result = dict(base)
    for key, value in override.items():
        result[key] = merged(result[key], value) if isinstance(value, dict) and isinstance(result.get(key), dict) else value
    return result
