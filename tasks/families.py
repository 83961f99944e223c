"""Task families: how a problem becomes model input, when a thread stops, what its answer is, and when two
answers are the same.

* ``chain``: thinkpool's own task (``tasks/chain.py``): the raw input of :func:`tasks.prompt.format_prompt`,
  a thread stops at the first non-digit after ``#``, answers are numbers.
* ``math``: a free-text problem for a reasoning model (Qwen3, DeepSeek-R1 distills): the model's chat template
  with thinking on, the answer is the last ``\\boxed{...}``, compared after LaTeX and numeric normalisation.
* ``regex``: a free-text problem whose answer is what the caller's pattern captures (the last match wins).

Any family can carry a verifier, ``(problem, answer) -> bool | float``, for best-of-N
(:func:`policies.voting.verified_vote`). A model directory names its default family in ``thinkpool.json``
(:func:`default_family`). Nothing above this module needs to know a family's format.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from policies.extraction import extract_boxed, extract_chain_answer, math_answer_key
from policies.voting import Verifier
from tasks.chain import ProblemError, parse_problem
from tasks.prompt import format_prompt

MODEL_SETTINGS = "thinkpool.json"  # beside config.json: {"task": "math"} declares a model's default family
MAX_PROMPT_CHARS = 20_000
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_DIGITS = "0123456789"
_CHAIN_STOP = re.compile(r"#[0-9]*[^0-9]")  # the marker, its digits, then anything else


class TaskFamily(Protocol):
    """What the engine, the controller and the surfaces ask of a task (see the module docstring)."""

    name: str
    stop_strings: tuple[str, ...]
    verifier: Verifier | None

    def format_input(self, problem_text: str, tokenizer: Any | None = None) -> str: ...

    def encode(self, problem_text: str, tokenizer: Any) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]], tokenizer: Any) -> list[int]: ...

    def should_stop(self, text: str) -> bool: ...

    def extract(self, text: str) -> str | None: ...

    def key(self, answer: str) -> str: ...

    def same(self, a: str | None, b: str | None) -> bool: ...

    def validate(self, prompt: object) -> str: ...

    def difficulty(self, prompt: str) -> float | None:
        """A difficulty read off the prompt (the chain task's k), or None: the controller then reads one from the
        task's first greedy thread (``policies/planner.py``)."""
        ...


def has_chat_template(tokenizer: Any | None) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def _require_text(prompt: object, limit: int) -> str:
    if not isinstance(prompt, str):
        raise ValueError(f"prompt: must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError("prompt: must not be empty")
    if len(prompt) > limit:
        raise ValueError(f"prompt: {len(prompt)} characters, over the limit of {limit}")
    if "\x00" in prompt:
        raise ValueError("prompt: must not contain NUL characters")
    return prompt


def _last_user_message(messages: list[dict[str, str]]) -> str:
    users = [m["content"] for m in messages if m.get("role") == "user"]
    if not users:
        raise ValueError("messages: a chat needs a user message")
    return users[-1]


@dataclass(frozen=True)
class ChainFamily:
    """Today's chain task, unchanged: its input, its ``#`` stop rule, its numeric answers."""

    name: str = "chain"
    stop_strings: tuple[str, ...] = ()
    verifier: Verifier | None = None

    def format_input(self, problem_text: str, tokenizer: Any | None = None) -> str:
        """Exactly :func:`tasks.prompt.format_prompt` (the chain models were trained on it; no chat template)."""
        return format_prompt(problem_text)

    def encode(self, problem_text: str, tokenizer: Any) -> list[int]:
        return tokenizer(self.format_input(problem_text))["input_ids"]

    def encode_chat(self, messages: list[dict[str, str]], tokenizer: Any) -> list[int]:
        """A chain model has no chat: its input is the last user message, as a problem."""
        return self.encode(_last_user_message(messages), tokenizer)

    def should_stop(self, text: str) -> bool:
        """After ``#`` and its digits, the first other character ends the thread (``workers/thread.py``'s rule);
        so does a caller's stop string."""
        return _CHAIN_STOP.search(text) is not None or any(stop in text for stop in self.stop_strings)

    def extract(self, text: str) -> str | None:
        return extract_chain_answer(text)

    def key(self, answer: str) -> str:
        stripped = answer.strip()
        return str(int(stripped)) if stripped.isdigit() else stripped

    def same(self, a: str | None, b: str | None) -> bool:
        return a is not None and b is not None and self.key(a) == self.key(b)

    def validate(self, prompt: object) -> str:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: must be a string, got {type(prompt).__name__}")
        try:
            parse_problem(prompt)
        except ProblemError as error:
            raise ValueError(f"prompt: {error}") from error
        return prompt

    def difficulty(self, prompt: str) -> float | None:
        """k, the problem's number of assignments."""
        try:
            return float(parse_problem(prompt.strip()).k)
        except ProblemError:
            return None


@dataclass(frozen=True)
class _FreeText:
    """Shared by free-text families: the model's chat template where it has one, else ``raw_template``.

    ``thinking`` is passed to the template as ``enable_thinking`` (Qwen3's switch; templates without it ignore
    it); ``None`` passes nothing. ``instruction`` is appended to the problem (after a blank line)."""

    thinking: bool | None = True
    instruction: str = ""
    system: str | None = None
    raw_template: str = "{problem}\n"
    stop_strings: tuple[str, ...] = ()
    max_prompt_chars: int = MAX_PROMPT_CHARS
    verifier: Verifier | None = None

    def format_input(self, problem_text: str, tokenizer: Any | None = None) -> str:
        content = f"{problem_text}\n\n{self.instruction}" if self.instruction else problem_text
        if not has_chat_template(tokenizer):
            return self.raw_template.format(problem=content)
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": content})
        options = {} if self.thinking is None else {"enable_thinking": self.thinking}
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **options)

    def encode(self, problem_text: str, tokenizer: Any) -> list[int]:
        """Token ids of the input; a chat template writes its own special tokens, so none are added."""
        text = self.format_input(problem_text, tokenizer)
        return tokenizer(text, add_special_tokens=not has_chat_template(tokenizer))["input_ids"]

    def format_chat(self, messages: list[dict[str, str]], tokenizer: Any | None = None) -> str:
        """A chat (OpenAI's ``messages``) as model input: the messages through the model's chat template as they
        are (no instruction or system message added), thinking as this family says; without a template, their
        contents one after another."""
        if not has_chat_template(tokenizer):
            return self.raw_template.format(problem="\n\n".join(m["content"] for m in messages))
        options = {} if self.thinking is None else {"enable_thinking": self.thinking}
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **options)
        except Exception as error:  # the template's own checks (roles that must alternate, ...) raise anything
            raise ValueError(f"messages: the model's chat template refused them ({error})") from error

    def encode_chat(self, messages: list[dict[str, str]], tokenizer: Any) -> list[int]:
        text = self.format_chat(messages, tokenizer)
        return tokenizer(text, add_special_tokens=not has_chat_template(tokenizer))["input_ids"]

    def should_stop(self, text: str) -> bool:
        """Any stop string in the generated text (EOS ends a thread anyway)."""
        return any(stop in text for stop in self.stop_strings)

    def same(self, a: str | None, b: str | None) -> bool:
        return a is not None and b is not None and self.key(a) == self.key(b)  # type: ignore[attr-defined]

    def validate(self, prompt: object) -> str:
        return _require_text(prompt, self.max_prompt_chars)

    def difficulty(self, prompt: str) -> float | None:
        return None  # nothing in free text says how hard it is: the first greedy thread will


@dataclass(frozen=True)
class MathFamily(_FreeText):
    """Free-text math for reasoning models: the answer is the last complete ``\\boxed{}``; ``1/2``, ``0.5`` and
    ``\\dfrac12`` are one answer (:func:`policies.extraction.math_answer_key`)."""

    name: str = "math"
    instruction: str = MATH_INSTRUCTION

    def extract(self, text: str) -> str | None:
        return extract_boxed(text)

    def key(self, answer: str) -> str:
        return math_answer_key(answer)


@dataclass(frozen=True)
class RegexFamily(_FreeText):
    """The answer is the first capture group (or the whole match) of the last match of ``answer_pattern``."""

    name: str = "regex"
    answer_pattern: str = ""
    ignore_case: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.answer_pattern, str) or not self.answer_pattern:
            raise ValueError("answer_pattern: the regex task needs a pattern for the answer")
        try:
            compiled = re.compile(self.answer_pattern, re.IGNORECASE if self.ignore_case else 0)
        except re.error as error:
            raise ValueError(f"answer_pattern: not a regular expression ({error})") from error
        object.__setattr__(self, "_compiled", compiled)

    def extract(self, text: str) -> str | None:
        last = None
        for last in self._compiled.finditer(text):  # type: ignore[attr-defined]
            pass
        if last is None:
            return None
        answer = (last.group(1) if self._compiled.groups else last.group(0)) or ""  # type: ignore[attr-defined]
        return answer.strip() or None

    def key(self, answer: str) -> str:
        stripped = " ".join(answer.split())
        return stripped.casefold() if self.ignore_case else stripped


FAMILIES = ("chain", "math", "regex")


def get_family(name: str, *, answer_pattern: str | None = None, verifier: Verifier | None = None,
               thinking: bool | None = None, stop_strings: tuple[str, ...] | list[str] | None = None) -> TaskFamily:
    """The family called ``name`` (``answer_pattern`` is the regex family's; ``thinking`` overrides a free-text
    family's default; ``stop_strings`` replace its stop strings); raises ValueError naming ``task`` for an unknown
    name. Everything but the verifier is plain data, so a worker rebuilds the same family from the same arguments."""
    if name == "chain":
        family: TaskFamily = ChainFamily()
    elif name == "math":
        family = MathFamily()
    elif name == "regex":
        family = RegexFamily(answer_pattern=answer_pattern or "")
    else:
        raise ValueError(f"task: unknown task family {name!r}; known: {', '.join(FAMILIES)}")
    if answer_pattern is not None and name != "regex":
        raise ValueError(f"answer_pattern: only the regex task takes an answer pattern, not {name!r}")
    changes: dict[str, Any] = {}
    if verifier is not None:
        if not callable(verifier):
            raise ValueError("verifier: must be a callable (problem, answer) -> bool | float")
        changes["verifier"] = verifier
    if thinking is not None and name != "chain":
        changes["thinking"] = thinking
    if stop_strings:  # the chain task stops after its answer anyway; a caller's stop strings may end it sooner
        if not all(isinstance(s, str) and s for s in stop_strings):
            raise ValueError("stop_strings: must be non-empty strings")
        changes["stop_strings"] = tuple(stop_strings)
    return dataclasses.replace(family, **changes) if changes else family  # type: ignore[type-var]


def default_family(model_dir: str | Path) -> str:
    """The task family a model directory declares in ``thinkpool.json`` (``{"task": "math"}``); undeclared, a
    model with the chain task's character-level tokenizer is ``chain`` and any other ``math``."""
    model_dir = Path(model_dir)
    settings_path = model_dir / MODEL_SETTINGS
    if settings_path.is_file():
        try:
            settings = json.loads(settings_path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{settings_path}: not valid JSON ({error})") from error
        task = settings.get("task") if isinstance(settings, dict) else None
        if task is not None:
            if task not in FAMILIES:
                raise ValueError(f"task: {settings_path} declares unknown task family {task!r}; "
                                 f"known: {', '.join(FAMILIES)}")
            return task
    return "chain" if _has_chain_tokenizer(model_dir) else "math"


def _has_chain_tokenizer(model_dir: Path) -> bool:
    """Whether ``tokenizer.json`` is a word-level vocabulary of single characters holding the chain alphabet
    (``tasks/chain_tokenizer.py``), read without loading the tokenizer."""
    try:
        model = json.loads((model_dir / "tokenizer.json").read_text()).get("model", {})
    except (OSError, json.JSONDecodeError):
        return False
    vocab = model.get("vocab") or {}
    return model.get("type") == "WordLevel" and set("#;?=+-*" + _DIGITS) <= set(vocab) and len(vocab) < 256
