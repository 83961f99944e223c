"""What several commands share: loading a model or a problem file or exiting with a message, checking
requested ratios against the adapters."""

from __future__ import annotations



def load_model_or_exit(args, parser):
    from dms_runtime.loading import ModelLoadError, default_model_path, load_model

    path = args.model or default_model_path()
    try:
        model, tokenizer = load_model(path)
    except ModelLoadError as error:
        parser.error(f"argument --model: {error}")
    return model, tokenizer, str(path)


def read_problems_or_exit(args, parser, task: str = "chain", need_answers: bool = False, limit: int | None = None,
                          prompts_only: bool = False) -> list[dict]:
    """``--problems`` (first ``limit``, default ``--limit``; rows that name no ``task`` are of ``task``, the model's
    family), or a one-line usage error naming the field; ``need_answers``: every row must have its answer (scoring
    needs it); ``prompts_only``: rows need no id or answer (see :func:`tasks.jsonl.read_problems`)."""
    from tasks.jsonl import ProblemFileError, read_problems

    try:
        problems = read_problems(args.problems, limit if limit is not None else getattr(args, "limit", None), task=task,
                                 prompts_only=prompts_only)
    except ProblemFileError as error:
        parser.error(f"argument --problems: {error}")
    missing = [p["id"] for p in problems if need_answers and not isinstance(p.get("answer"), str)]
    if missing:
        parser.error(f"argument --problems: {len(missing)} rows have no 'answer' to score against (first: {missing[0]})")
    return problems


def check_adapters(ratios, model_dir, parser, option: str) -> None:
    """Exit with a usage error naming ``option`` if a ratio above 1 has no adapter beside the model."""
    from workers.worker import available_ratios

    missing = [cr for cr in ratios if cr != 1 and cr not in available_ratios(model_dir)]
    if missing:
        parser.error(f"argument {option}: no DMS adapter for {missing[0]:g}x beside {model_dir}")
