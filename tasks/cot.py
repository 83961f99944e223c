"""The chain of thought the shipped model is trained to write.

Every micro-step is a single-digit fact, and every value the model will need later is written once,
on its own line, as a two-digit register ``c=49``. So nearly all tokens are scratch that is dead a few
tokens later, while registers must survive until their last use, possibly hundreds of tokens on:
exactly the structure a learned KV evictor can exploit and a recency window cannot.

For ``a=7;b=42;c=a+b;d=c*a;?d`` the model writes::

    a:07
    b:42
    c=a+b|a:07+b:42|7+2=09,0+4=04,4+0=04
    c:49
    d=c*a|c:49*a:07|9*7=63,4*7=28,9*0=00,6+8=14,4+0=04
    d:43
    #43

Both long-range reads are plain induction (find an earlier occurrence of a two-token key, copy what
followed): a work line starts with ``c=``, which occurs earlier only in the prompt, followed by the
assignment to copy; every value is written after ``<var>:``, and every ``a:`` in the text is followed by
a's value, so any occurrence found gives the right digits.

Each fact ``x?y=CD`` gives two characters: for ``+`` and ``*`` the two-digit result, for ``-`` the
borrow and the digit. The first fact is on the units digits (its tens char is the carry/borrow);
the following ones only pass on their units char, and the last one's units char is the tens digit.
"""

from __future__ import annotations

import dataclasses
import random

from tasks.chain import Assignment, Problem

COMMUTATIVE = ("+", "*")
REVERSED_MINUS = "~"  # ``j~b`` is ``b-j``: a ``-`` read from the right (``reversed_line``)


def _fact(x: int, op: str, y: int) -> str:
    if op == "+":
        result = f"{x + y:02d}"
    elif op == "*":
        result = f"{x * y:02d}"
    else:
        result = f"{int(x < y)}{(x - y) % 10}"
    return f"{x}{op}{y}={result}"


def _facts(op: str, left: int, right: int) -> list[str]:
    """The single-digit facts that compute ``(left op right) mod 100``; the last fact's units char is the tens digit."""
    lt, lu, rt, ru = divmod(left, 10) + divmod(right, 10)
    if op == "*":
        carry = lu * ru // 10
        p, q = lt * ru % 10, lu * rt % 10
        r = (carry + p) % 10
        return [_fact(lu, "*", ru), _fact(lt, "*", ru), _fact(lu, "*", rt), _fact(carry, "+", p), _fact(r, "+", q)]
    if op == "+":
        carry = (lu + ru) // 10
        return [_fact(lu, "+", ru), _fact(lt, "+", rt), _fact((lt + rt) % 10, "+", carry)]
    borrow = int(lu < ru)
    return [_fact(lu, "-", ru), _fact(lt, "-", rt), _fact((lt - rt) % 10, "-", borrow)]


def derived_line(a: Assignment, values: dict[str, int]) -> str:
    left, right = values[a.y], values[a.z]  # type: ignore[index]
    facts = ",".join(_facts(a.op, left, right))  # type: ignore[arg-type]
    return f"{a.var}={a.y}{a.op}{a.z}|{a.y}:{left:02d}{a.op}{a.z}:{right:02d}|{facts}"


def reversed_line(a: Assignment, values: dict[str, int]) -> str:
    """The work line that reads ``a``'s operands from the right: ``r=p+h`` for ``r=h+p`` (its facts take them in
    that order too) and, for a ``-``, ``r=p~h`` for ``r=h-p`` (``~``: the right operand minus the left; its facts
    compute ``h-p`` as the canonical line's do)."""
    if a.op in COMMUTATIVE:
        return derived_line(dataclasses.replace(a, y=a.z, z=a.y), values)
    left, right = values[a.y], values[a.z]  # type: ignore[index]
    facts = ",".join(_facts("-", left, right))
    return f"{a.var}={a.z}{REVERSED_MINUS}{a.y}|{a.z}:{right:02d}{REVERSED_MINUS}{a.y}:{left:02d}|{facts}"


def statement_of(header: str) -> str:
    """The prompt statement a work line's header reads: ``r=h-p`` for ``r=p~h``; any other header as it is."""
    var, _, rest = header.partition("=")
    if REVERSED_MINUS not in rest:
        return header
    right, left = rest.split(REVERSED_MINUS, 1)
    return f"{var}={left}-{right}"


def writes_reversed_minus(model) -> bool:
    """Whether ``model`` was trained to read ``-`` lines from the right too (``thinkpool train`` records it in the
    checkpoint's config); the forms a tool expects of a model's threads depend on it."""
    return bool(getattr(model.config, "reversed_minus", False))


def line_forms(problem: Problem, reversed_minus: bool = True) -> list[list[str]]:
    """Every valid form of each line of the chain of thought, the canonical one first: a line of two different
    operands may also read them from the right (``reversed_line``); ``reversed_minus=False`` leaves ``-`` lines
    their canonical form only (the chain of thought of models trained before that form existed)."""
    values = problem.values
    forms = []
    for a in problem.assignments:
        if not a.is_input:
            line = [derived_line(a, values)]
            if a.y != a.z and (a.op in COMMUTATIVE or reversed_minus):
                line.append(reversed_line(a, values))
            forms.append(line)
        forms.append([f"{a.var}:{values[a.var]:02d}"])
    forms.append([f"#{problem.answer}"])
    return forms


def render_cot(problem: Problem, order_rng: random.Random | None = None, reversed_minus: bool = False) -> str:
    """The complete target completion for a problem, ending with ``#<answer>``.

    With ``order_rng``, each line with two forms (``line_forms``) is written in either at random: a chain of
    thought with many valid paths to one answer, so that sampled threads do not all share the greedy thread's
    weak steps (the error anatomy in docs/chain_model.md). ``reversed_minus``: ``-`` lines have two forms too."""
    lines = []
    for forms in line_forms(problem, reversed_minus):
        swap = len(forms) > 1 and order_rng is not None and order_rng.random() < 0.5
        lines.append(forms[1] if swap else forms[0])
    return "\n".join(lines)


def is_valid_cot(text: str, problem: Problem) -> bool:
    """Whether ``text`` is one of the problem's valid chains of thought (any line in any of its forms)."""
    lines, forms = text.split("\n"), line_forms(problem)
    return len(lines) == len(forms) and all(line in options for line, options in zip(lines, forms))
