"""Shared fixtures: the shipped model (loaded once) and a small seeded problem file."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def shipped():
    from dms_runtime.loading import load_model

    return load_model()


@pytest.fixture(scope="session")
def easy_file(tmp_path_factory):
    from tasks.chain import generate_suite
    from tasks.jsonl import write_jsonl

    path = tmp_path_factory.mktemp("problems") / "easy.jsonl"
    write_jsonl(path, generate_suite(12, 1, 3, seed=12345))
    return path
