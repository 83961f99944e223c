"""Problem files: JSON Lines of ``{"id", "prompt", "answer"}`` (extra keys such as ``k`` are kept).

A row may name its task family (``"task": "math"``, and the regex family's ``"answer_pattern"``); rows that name
none are of the file's default family (a batch: the model's). Chain rows are checked against the reference
solver; rows of other families are checked by their family, and their ``answer`` is optional (no score then).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable

from tasks.chain import ProblemError, parse_problem
from tasks.families import TaskFamily, get_family


class ProblemFileError(ValueError):
    """A problem file that cannot be used; the message names the file, line and field."""


def read_problems(path: str | Path, limit: int | None = None, task: str = "chain", prompts_only: bool = False) -> list[dict]:
    """Read and validate a problem file; a chain row's ``answer`` is checked against the reference solver.
    ``task`` is the family of rows that name none (a row's own ``task`` is kept as it is). ``prompts_only``: for
    what reads no answers (a KV measurement), a row needs only its ``prompt``: one without an ``id`` is named by
    its line, and an ``answer``, when a row has one, is still checked."""
    path = Path(path)
    if not path.is_file():
        raise ProblemFileError(f"problem file not found: {path}")
    records: list[dict] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ProblemFileError(f"{where}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise ProblemFileError(f"{where}: each line must be a JSON object")
            if prompts_only:
                record.setdefault("id", f"line-{number}")
            row_task = record.get("task", task)
            if not isinstance(row_task, str):
                raise ProblemFileError(f"{where}: field 'task' must be a string")
            if row_task == "chain":
                _check_chain_row(record, where, need_answer=not prompts_only)
            else:
                _check_row(record, row_task, where)
            records.append(record)
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise ProblemFileError(f"{path}: no problems in file")
    return records


def _check_chain_row(record: dict, where: str, need_answer: bool = True) -> None:
    for field in ("id", "prompt", "answer") if need_answer or "answer" in record else ("id", "prompt"):
        if not isinstance(record.get(field), str):
            raise ProblemFileError(f"{where}: field '{field}' must be a string")
    try:
        problem = parse_problem(record["prompt"])
    except ProblemError as error:
        raise ProblemFileError(f"{where}: field 'prompt': {error}") from None
    if "answer" in record and record["answer"].lstrip("0") != problem.answer.lstrip("0"):
        raise ProblemFileError(
            f"{where}: field 'answer' is {record['answer']!r} but the problem evaluates to {problem.answer!r}"
        )
    record.setdefault("k", problem.k)


def _check_row(record: dict, task: str, where: str) -> None:
    """A row of a free-text family: its family exists and accepts the prompt; an answer, if any, is a string."""
    for field in ("id", "prompt"):
        if not isinstance(record.get(field), str):
            raise ProblemFileError(f"{where}: field '{field}' must be a string")
    if "answer" in record and not isinstance(record["answer"], str):
        raise ProblemFileError(f"{where}: field 'answer' must be a string")
    try:
        get_family(task, answer_pattern=record.get("answer_pattern")).validate(record["prompt"])
    except ValueError as error:
        field, _, message = str(error).partition(": ")
        raise ProblemFileError(f"{where}: field '{field}': {message}") from None


def row_family(record: dict, default_task: str = "chain") -> TaskFamily:
    """The task family of one problem row: its own ``task`` (and ``answer_pattern``), else ``default_task``."""
    return get_family(record.get("task", default_task), answer_pattern=record.get("answer_pattern"))


def read_jsonl(path: str | Path) -> list[dict]:
    """Every non-blank line of a JSON Lines file (results, not problems: nothing is validated)."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(path: str | Path, records: Iterable[dict]) -> None:
    with Path(path).open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def problem_seed(seed: int, problem_id: str) -> int:
    """The seed of one problem in a run seeded ``seed``: from its id, not its position, so a resumed run, a
    subset or a reordered file gives each problem the threads a full run would have."""
    digest = hashlib.sha256(f"{seed}:{problem_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (2**62)
