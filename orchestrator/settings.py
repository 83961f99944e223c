"""Typed settings: ``configs/defaults.yaml`` (or ``$THINKPOOL_CONFIG``) plus environment overrides."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from dms_runtime.loading import REPO_ROOT

DEFAULTS_FILE = REPO_ROOT / "configs" / "defaults.yaml"


class SamplingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(1.0, gt=0, le=5)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(1536, ge=1, le=8192)


class GenerationSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    batch_size: int = Field(64, ge=1, le=4096)


class LimitSettings(BaseModel):
    """What the API admits: queued and running work at once (beyond it, 429 with Retry-After), requests per
    minute per API key (0: no limit; a key's own limit in ``THINKPOOL_API_KEYS`` wins), how long a finished job
    is kept, and the request body's size."""

    model_config = ConfigDict(extra="forbid")
    max_samples: int = Field(256, ge=1)
    max_active_jobs: int = Field(256, ge=1)
    requests_per_minute: int = Field(0, ge=0)
    job_ttl_s: float = Field(86400.0, gt=0)
    max_body_bytes: int = Field(64 * 1024, ge=1024)


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sampling: SamplingSettings = SamplingSettings()
    generation: GenerationSettings = GenerationSettings()
    limits: LimitSettings = LimitSettings()


def _apply_env(data: dict, environ: dict[str, str]) -> dict:
    for section, fields in Settings.model_fields.items():
        for key in fields.annotation.model_fields:  # type: ignore[union-attr]
            value = environ.get(f"THINKPOOL_{section}_{key}".upper())
            if value is not None:
                data.setdefault(section, {})[key] = yaml.safe_load(value)
    return data


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    path = Path(os.environ.get("THINKPOOL_CONFIG", DEFAULTS_FILE))
    data = yaml.safe_load(path.read_text()) if path.is_file() else {}
    return Settings.model_validate(_apply_env(data or {}, dict(os.environ)))
