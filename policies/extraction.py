"""Answer extraction: from a thread's output text to the answer it commits to (or none)."""

from __future__ import annotations

import re
from fractions import Fraction

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
_BOX = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])(\s*)")


def extract_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}`` (braces nested to any depth), ``None`` when there is none.

    A box cut off before its closing brace (a thread stopped at its token limit) does not count: the last
    complete box before it does. ``\\boxed 5`` (no braces) is read as ``5``."""
    found = None
    for match in _BOX.finditer(text):
        start = match.end()
        if text[start : start + 1] == "{":
            content = _braced(text, start)
            if content is not None:
                found = content
        elif match.group(1) and (bare := re.match(r"[^\s$]+", text[start:])):
            found = bare.group(0)
    if found is None:
        return None
    return found.strip() or None


def _braced(text: str, start: int) -> str | None:
    """The text inside the brace group opening at ``text[start]``; ``None`` if it never closes."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "{" and text[index - 1 : index] != "\\":
            depth += 1
        elif text[index] == "}" and text[index - 1 : index] != "\\":
            depth -= 1
            if depth == 0:
                return text[start + 1 : index]
    return None


def extract_math_answer(text: str) -> str | None:
    """Math-style outputs: the content of the last ``\\boxed{...}``, else the last number in the text."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


# -- comparing math answers -------------------------------------------------------------------------------
_SPACING = re.compile(r"\\[!,;: ]|~")
_DELIMITERS = re.compile(
    r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big|displaystyle)(?![a-zA-Z])|\\?\$|\\\(|\\\)|\\\[|\\\]")
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm|operatorname)\s*\{([^{}]*)\}")
_UNIT_AFTER_NUMBER = re.compile(r"([\d}.])\s*\\(?:text|mbox|mathrm)\s*\{[^{}]*\}")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?|°")
_SHORT_FRAC = re.compile(r"\\frac\s*([0-9a-zA-Z])\s*([0-9a-zA-Z])")  # \frac12 -> \frac{1}{2}
_HALF_SHORT_FRAC = re.compile(r"\\frac\s*([0-9a-zA-Z])\s*(?=\{)")  # \frac1{2} -> \frac{1}{2}
_SHORT_SQRT = re.compile(r"\\sqrt\s*([0-9a-zA-Z])")  # \sqrt3 -> \sqrt{3}
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_ASSIGNMENT = re.compile(r"^[a-zA-Z](?:_\{?\w+\}?)?=(?!=)")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?")
_FRACTION = re.compile(r"(-?)\\frac\{([-+]?[\d.]+)\}\{([-+]?[\d.]+)\}")
_SLASH = re.compile(r"([-+]?[\d.]+)/([-+]?[\d.]+)")


def normalize_math_answer(answer: str) -> str:
    """A LaTeX answer in one canonical spelling: no ``$``, ``\\left``/``\\right``, thin spaces, spaces, units in
    ``\\text{}`` after a number, degree signs, ``%``, a trailing period, thousands commas; ``\\dfrac``/``\\tfrac``
    are ``\\frac`` with braced arguments; ``x = 5`` is ``5``."""
    s = answer.strip()
    s = _SPACING.sub("", s)
    s = _DELIMITERS.sub("", s)
    s = _UNIT_AFTER_NUMBER.sub(r"\1", s)
    s = _TEXT.sub(r"\1", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _SHORT_FRAC.sub(r"\\frac{\1}{\2}", s)
    s = _HALF_SHORT_FRAC.sub(r"\\frac{\1}", s)
    s = _SHORT_SQRT.sub(r"\\sqrt{\1}", s)
    s = "".join(s.split())
    s = s.rstrip(".")
    s = _ASSIGNMENT.sub("", s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


def math_value(answer: str) -> Fraction | None:
    """The exact rational value of a normalised answer written as a number, ``a/b`` or ``\\frac{a}{b}``; else None."""
    try:
        if _PLAIN_NUMBER.fullmatch(answer):
            return Fraction(answer)
        if match := _FRACTION.fullmatch(answer):
            value = Fraction(match[2]) / Fraction(match[3])
            return -value if match[1] else value
        if match := _SLASH.fullmatch(answer):
            return Fraction(match[1]) / Fraction(match[2])
    except (ValueError, ZeroDivisionError):
        return None
    return None


def math_answer_key(answer: str) -> str:
    """What equal math answers share: a number's exact value (``1/2`` for ``0.5``, ``\\dfrac12`` and ``1/2``), else
    the normalised text. Voting groups answers by it."""
    s = normalize_math_answer(answer)
    value = math_value(s)
    if value is None:
        return s
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def math_answers_match(predicted: str | None, expected: str | None) -> bool:
    """Math answers compare after normalisation, by exact value where both are numbers; no answer is always wrong."""
    if predicted is None or expected is None:
        return False
    return math_answer_key(predicted) == math_answer_key(expected)


EXTRACTORS = {"chain": extract_chain_answer, "math": extract_math_answer}


def get_extractor(family: str):
    """The answer extractor of a task family (``chain`` or ``math``)."""
    if family not in EXTRACTORS:
        raise ValueError(f"unknown task family {family!r}; expected one of {', '.join(EXTRACTORS)}")
    return EXTRACTORS[family]
