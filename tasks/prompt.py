"""The one place where a problem text becomes model input (and a completion becomes a training target)."""

PROMPT_SUFFIX = "\n"


def format_prompt(problem_text: str) -> str:
    """Model input for a problem: its text and a newline, after which the model starts thinking."""
    return problem_text + PROMPT_SUFFIX
