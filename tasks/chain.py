"""Chain problems: parsing with precise errors, the reference solver, and a seeded generator.

A problem is ``a=7;b=42;c=a+b;d=c*a;?d``: ``m`` literal inputs, then ``k`` derived assignments whose
values are ``(y op z) mod 100``. ``k`` is the difficulty.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

MAX_VARIABLES = 26
MIN_INPUTS, MAX_INPUTS = 2, 6
OPERATORS = ("+", "-", "*")

_INPUT = re.compile(r"^([a-z])=(0|[1-9][0-9]?)$")
# A derived statement ``var=y op z`` (also what a chain of thought's work line opens with).
DERIVED = re.compile(r"^([a-z])=([a-z])([+\-*])([a-z])$")


class ProblemError(ValueError):
    """A problem text that does not follow the chain task format; the message says where and why."""


@dataclass(frozen=True)
class Assignment:
    """One ``var=...`` statement: an input (``value`` set) or a derived ``var=y op z``."""

    var: str
    value: int | None = None
    y: str | None = None
    op: str | None = None
    z: str | None = None

    @property
    def is_input(self) -> bool:
        return self.value is not None

    def text(self) -> str:
        if self.is_input:
            return f"{self.var}={self.value}"
        return f"{self.var}={self.y}{self.op}{self.z}"


@dataclass(frozen=True)
class Problem:
    """A parsed chain problem; ``values`` holds every variable's value, in assignment order."""

    assignments: tuple[Assignment, ...]

    @property
    def m(self) -> int:
        return sum(a.is_input for a in self.assignments)

    @property
    def k(self) -> int:
        return len(self.assignments) - self.m

    @property
    def query(self) -> str:
        return self.assignments[-1].var

    @property
    def text(self) -> str:
        return ";".join(a.text() for a in self.assignments) + f";?{self.query}"

    @property
    def values(self) -> dict[str, int]:
        return evaluate(self.assignments)

    @property
    def answer(self) -> str:
        return str(self.values[self.query])

    @property
    def needed(self) -> frozenset[str]:
        """The variables the answer depends on (the query among them): a mistake anywhere else cannot change it."""
        needed = {self.query}
        for a in reversed(self.assignments):
            if a.var in needed and not a.is_input:
                needed |= {a.y, a.z}  # type: ignore[arg-type]
        return frozenset(needed)


def apply(op: str, y: int, z: int) -> int:
    """The chain task's arithmetic: results live in 0..99."""
    if op == "+":
        return (y + z) % 100
    if op == "-":
        return (y - z) % 100
    if op == "*":
        return (y * z) % 100
    raise ProblemError(f"unknown operator {op!r}; expected one of + - *")


def evaluate(assignments: tuple[Assignment, ...] | list[Assignment]) -> dict[str, int]:
    values: dict[str, int] = {}
    for a in assignments:
        if a.is_input:
            values[a.var] = a.value  # type: ignore[assignment]
        else:
            values[a.var] = apply(a.op, values[a.y], values[a.z])  # type: ignore[arg-type,index]
    return values


def solve(text: str) -> str:
    """The reference answer of a problem text (validated first)."""
    return parse_problem(text).answer


def parse_problem(text: str) -> Problem:
    """Parse and validate a problem text; raise :class:`ProblemError` naming the first defect."""
    if not isinstance(text, str) or not text:
        raise ProblemError("problem text is empty")
    if text != text.strip() or any(c.isspace() for c in text):
        raise ProblemError("problem text must not contain spaces or newlines")
    parts = text.split(";")
    if len(parts) < 2 or not parts[-1].startswith("?"):
        raise ProblemError("problem text must end with ';?<last variable>'")
    statements, query = parts[:-1], parts[-1][1:]
    if len(statements) > MAX_VARIABLES:
        raise ProblemError(f"too many assignments: {len(statements)} > {MAX_VARIABLES}")
    assignments: list[Assignment] = []
    for index, statement in enumerate(statements):
        assignments.append(_parse_statement(statement, index, assignments))
    m = sum(a.is_input for a in assignments)
    if not MIN_INPUTS <= m <= MAX_INPUTS:
        raise ProblemError(f"number of inputs m={m} must be between {MIN_INPUTS} and {MAX_INPUTS}")
    if m == len(assignments):
        raise ProblemError("at least one derived assignment is required (k >= 1)")
    if query != assignments[-1].var:
        raise ProblemError(f"query '?{query}' must name the last variable '{assignments[-1].var}'")
    return Problem(tuple(assignments))


def _parse_statement(statement: str, index: int, earlier: list[Assignment]) -> Assignment:
    where = f"assignment {index + 1} ({statement!r})"
    expected_var = string.ascii_lowercase[index]
    if not statement or statement[0] != expected_var or statement[1:2] != "=":
        raise ProblemError(f"{where}: expected '{expected_var}=...' (variables are assigned a, b, c... in order)")
    if match := _INPUT.match(statement):
        if earlier and not earlier[-1].is_input:
            raise ProblemError(f"{where}: inputs must come before derived assignments")
        return Assignment(var=match[1], value=int(match[2]))
    if match := DERIVED.match(statement):
        var, y, op, z = match.groups()
        known = {a.var for a in earlier}
        for operand in (y, z):
            if operand not in known:
                raise ProblemError(f"{where}: unknown variable {operand!r} (only earlier variables may be used)")
        return Assignment(var=var, y=y, op=op, z=z)
    body = statement[2:]
    if re.fullmatch(r"[0-9]+", body):
        raise ProblemError(f"{where}: input values are integers 0-99 without leading zeros")
    if re.fullmatch(r"[a-z].[a-z]", body):
        raise ProblemError(f"{where}: unknown operator {body[1]!r}; expected one of + - *")
    raise ProblemError(f"{where}: expected '<var>=<0-99>' or '<var>=<y><op><z>'")


def generate_problem(rng: random.Random, k: int, m: int | None = None, reach: int = 0) -> Problem:
    """A random problem with ``k`` derived assignments, operands drawn uniformly from all earlier variables.

    With ``reach > 0`` the first operand of every derived assignment is drawn from the variables at least
    ``reach`` assignments back (the earliest ones when there are fewer): values needed far later."""
    if m is None:
        m = rng.randint(MIN_INPUTS, min(MAX_INPUTS, MAX_VARIABLES - k))
    if k < 1 or not MIN_INPUTS <= m <= MAX_INPUTS or m + k > MAX_VARIABLES:
        raise ProblemError(f"cannot generate m={m}, k={k}: need k >= 1, 2 <= m <= 6, m + k <= 26")
    names = string.ascii_lowercase
    assignments = [Assignment(var=names[i], value=rng.randint(0, 99)) for i in range(m)]
    for i in range(m, m + k):
        y = names[rng.randrange(max(1, i - reach + 1))] if reach > 0 else names[rng.randrange(i)]
        z = names[rng.randrange(i)]
        assignments.append(Assignment(var=names[i], y=y, op=rng.choice(OPERATORS), z=z))
    return Problem(tuple(assignments))


def generate_suite(n: int, k_min: int, k_max: int, seed: int, reach: int = 0) -> list[dict]:
    """``n`` problems with k spread evenly over ``k_min..k_max``, as JSONL-ready records."""
    if not 1 <= k_min <= k_max <= MAX_VARIABLES - MIN_INPUTS:
        raise ProblemError(f"k range {k_min}..{k_max} must lie within 1..{MAX_VARIABLES - MIN_INPUTS}")
    rng = random.Random(seed)
    records = []
    for i in range(n):
        k = k_min + i % (k_max - k_min + 1)
        problem = generate_problem(rng, k, reach=reach)
        record = {"id": f"chain-{seed}-{i:05d}", "prompt": problem.text, "answer": problem.answer, "k": k}
        records.append(record | ({"reach": reach} if reach else {}))
    return records
