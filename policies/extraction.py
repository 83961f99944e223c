"""Answer extraction: from a thread's output text to the answer it commits to (or none)."""

from __future__ import annotations

import re

_CHAIN_ANSWER = re.compile(r"#\s*(\d+)")


def extract_chain_answer(text: str) -> str | None:
    """The number after the last ``#`` (leading zeros ignored); ``None`` when the output has no answer."""
    marker = text.rfind("#")
    if marker < 0:
        return None
    match = _CHAIN_ANSWER.match(text, marker)
    if match is None:
        return None
    return str(int(match.group(1)))


def answers_match(predicted: str | None, expected: str) -> bool:
    """Chain answers compare as numbers (``"07"`` equals ``"7"``); no answer is always wrong."""
    return predicted is not None and predicted.lstrip("0") == expected.lstrip("0")


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def extract_math_answer(text: str) -> str | None:
    """Math-style outputs: the content of the last ``\\boxed{...}``, else the last number in the text."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip() or None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


EXTRACTORS = {"chain": extract_chain_answer, "math": extract_math_answer}


def get_extractor(family: str):
    """The answer extractor of a task family (``chain`` or ``math``)."""
    if family not in EXTRACTORS:
        raise ValueError(f"unknown task family {family!r}; expected one of {', '.join(EXTRACTORS)}")
    return EXTRACTORS[family]
