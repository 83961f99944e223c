"""The chain task: thinkpool's reference reasoning workload (see shared TASKS.md)."""

from tasks.chain import (
    MAX_VARIABLES,
    Assignment,
    Problem,
    ProblemError,
    generate_problem,
    generate_suite,
    parse_problem,
    solve,
)

__all__ = [
    "MAX_VARIABLES",
    "Assignment",
    "Problem",
    "ProblemError",
    "generate_problem",
    "generate_suite",
    "parse_problem",
    "solve",
]
