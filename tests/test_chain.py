"""The chain task: generator, parser, reference solver and the CoT the model is trained on."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.chain import ProblemError, apply, generate_problem, generate_suite, parse_problem, solve
from tasks.chain import Assignment
from tasks.cot import REVERSED_MINUS, derived_line, is_valid_cot, render_cot, statement_of


def independent_solve(text: str) -> int:
    """A second, deliberately naive interpreter of the problem text."""
    env: dict[str, int] = {}
    *statements, query = text.split(";")
    for statement in statements:
        name, expr = statement.split("=")
        if expr.isdigit():
            env[name] = int(expr)
        else:
            y, op, z = expr[0], expr[1], expr[2]
            env[name] = eval(f"({env[y]}{op}{env[z]}) % 100")
    return env[query[1:]]


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 10**9), k=st.integers(1, 20))
def test_generated_problems_follow_the_format(seed, k):
    problem = generate_problem(random.Random(seed), k)
    text = problem.text
    assert parse_problem(text) == problem
    assert problem.k == k and 2 <= problem.m <= 6
    assert problem.answer == str(independent_solve(text))
    assert 0 <= int(problem.answer) <= 99 and problem.answer == str(int(problem.answer))
    assert " " not in text and text.endswith(f";?{problem.query}")


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 10**9), k=st.integers(1, 24), any_order=st.booleans(), reversed_minus=st.booleans())
def test_cot_facts_compute_every_register(seed, k, any_order, reversed_minus):
    problem = generate_problem(random.Random(seed), k)
    lines = render_cot(problem, random.Random(seed + 1) if any_order else None, reversed_minus).split("\n")
    values = problem.values
    assert lines[-1] == f"#{problem.answer}"
    assert is_valid_cot("\n".join(lines), problem)
    for index, line in enumerate(lines[:-1]):
        if "|" in line:
            header, operands, work = line.split("|")
            y, op, z = header[2], header[3], header[4]
            assert operands == f"{y}:{values[y]:02d}{op}{z}:{values[z]:02d}"
            if op == REVERSED_MINUS:  # z - y: its facts are those of the canonical z-y line
                assert reversed_minus and work == derived_line(Assignment(header[0], y=z, op="-", z=y),
                                                               values).split("|")[2]
            facts = work.split(",")
            for fact in facts:
                x, op, y, result = fact[0], fact[1], fact[2], fact[4:]
                expected = int(x) + int(y) if op == "+" else int(x) * int(y) if op == "*" else None
                if expected is not None:
                    assert int(result) == expected
                else:
                    assert result == f"{int(int(x) < int(y))}{(int(x) - int(y)) % 10}"
            register = lines[index + 1]
            assert int(register[2:]) == int(facts[-1][-1]) * 10 + int(facts[0][-1]) == values[register[0]]


def test_the_documented_example():
    assert solve("a=7;b=42;c=a+b;d=c*a;e=d-b;?e") == "1"
    assert apply("-", 3, 7) == 96 and apply("*", 42, 37) == 54


@pytest.mark.parametrize(
    "text, message",
    [
        ("a=1;b=2;c=a+x;?c", "unknown variable 'x'"),
        ("a=1;b=2;c=a/b;?c", "unknown operator '/'"),
        ("a=1;c=2;d=a+c;?d", "expected 'b=...'"),
        ("a=1;b=02;c=a+b;?c", "without leading zeros"),
        ("a=1;b=200;c=a+b;?c", "without leading zeros"),
        ("a=1;b=2;c=a+b", "must end with ';?<last variable>'"),
        ("a=1;b=2;c=a+b;?a", "must name the last variable 'c'"),
        ("a=1;b=2;?b", "at least one derived assignment"),
        ("a=1;b=a+a;c=b*b;?c", "number of inputs m=1"),
        ("a=1;b=2;c=a+b;d=4;e=c+d;?e", "inputs must come before derived"),
        ("a=1; b=2;c=a+b;?c", "must not contain spaces"),
        ("", "empty"),
    ],
)
def test_malformed_problems_are_rejected_with_the_reason(text, message):
    with pytest.raises(ProblemError, match=message.replace("?", r"\?").replace("+", r"\+").replace("*", r"\*")):
        parse_problem(text)


def test_suite_is_seeded_and_spans_the_difficulty_range():
    first, again = generate_suite(40, 1, 20, seed=5), generate_suite(40, 1, 20, seed=5)
    assert first == again and first != generate_suite(40, 1, 20, seed=6)
    assert sorted({r["k"] for r in first}) == list(range(1, 21))
    assert all(parse_problem(r["prompt"]).k == r["k"] and solve(r["prompt"]) == r["answer"] for r in first)


def test_reach_draws_first_operands_from_far_back():
    rng = random.Random(3)
    for _ in range(200):
        problem = generate_problem(rng, 18, reach=8)
        for index, a in enumerate(problem.assignments):
            if not a.is_input:
                distance = index - (ord(a.y) - ord("a"))
                assert distance >= min(8, index)


def test_any_order_cot_swaps_only_commutative_operands_and_keeps_the_answer():
    problem = parse_problem("a=7;b=42;c=a+b;d=c*a;e=d-b;f=c*c;?f")
    plain = render_cot(problem).split("\n")
    variants = [text.split("\n") for text in {render_cot(problem, random.Random(seed)) for seed in range(40)}]
    assert len(variants) == 4  # c and d each in two orders; e (-) and f (equal operands) in one
    assert {lines[2] for lines in variants} == {"c=a+b|a:07+b:42|7+2=09,0+4=04,4+0=04", "c=b+a|b:42+a:07|2+7=09,4+0=04,4+0=04"}
    assert {lines[4] for lines in variants} == {"d=c*a|c:49*a:07|9*7=63,4*7=28,9*0=00,6+8=14,4+0=04",
                                                "d=a*c|a:07*c:49|7*9=63,0*9=00,7*4=28,6+0=06,6+8=14"}
    for lines in variants:  # registers, the - line, the equal-operand line and the answer never change
        assert [lines[i] for i in (3, 5, 6, 7, 8, 9, 10)] == [plain[i] for i in (3, 5, 6, 7, 8, 9, 10)]
    assert plain[-1] == "#1"


def test_reversed_minus_reads_a_subtraction_from_the_right_with_the_same_facts():
    """``reversed_minus``: a ``-`` line of two different operands may be written ``e=b~d`` for ``e=d-b``; its facts
    still compute d-b, so its register is the canonical line's. Both forms are valid chains of thought."""
    problem = parse_problem("a=7;b=42;c=a+b;d=c*a;e=d-b;f=c-c;?f")
    variants = {text for text in (render_cot(problem, random.Random(seed), reversed_minus=True) for seed in range(40))}
    e_lines = {text.split("\n")[6] for text in variants}
    assert e_lines == {"e=d-b|d:43-b:42|3-2=01,4-4=00,0-0=00", "e=b~d|b:42~d:43|3-2=01,4-4=00,0-0=00"}
    assert {text.split("\n")[8] for text in variants} == {"f=c-c|c:49-c:49|9-9=00,4-4=00,0-0=00"}  # equal operands
    assert all(is_valid_cot(text, problem) for text in variants)
    assert not any("~" in render_cot(problem, random.Random(seed)) for seed in range(40))  # off by default
    reversed_text = next(text for text in variants if "e=b~d" in text)
    assert not is_valid_cot(reversed_text.replace("e=b~d|b:42~d:43", "e=b-d|b:42-d:43"), problem)  # b-d: not e
    assert (statement_of("e=b~d"), statement_of("c=b+a")) == ("e=d-b", "c=b+a")  # the statement a header reads


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10**9), k=st.integers(1, 20))
def test_only_needed_statements_can_change_the_answer(seed, k):
    """``Problem.needed`` is what the query reaches through operands (checked by a naive recursive walk), and
    rewriting any statement outside it leaves the answer as it was."""
    problem = generate_problem(random.Random(seed), k)
    statements = {a.var: a for a in problem.assignments}

    def reach(var: str) -> set[str]:
        a = statements[var]
        return {var} if a.is_input else {var} | reach(a.y) | reach(a.z)

    assert problem.needed == reach(problem.query)
    for index, a in enumerate(problem.assignments):
        if a.is_input or a.var in problem.needed:
            continue
        for op in "+-*":
            texts = problem.text.split(";")
            texts[index] = f"{a.var}={a.y}{op}{a.z}"
            assert parse_problem(";".join(texts)).answer == problem.answer
