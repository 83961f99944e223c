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


def read_problems_or_exit(args, parser) -> list[dict]:
    """``--problems`` (first ``--limit``), or a one-line usage error naming the field."""
    from tasks.jsonl import ProblemFileError, read_problems

    try:
        return read_problems(args.problems, args.limit)
    except ProblemFileError as error:
        parser.error(f"argument --problems: {error}")


def check_adapters(ratios, model_dir, parser, option: str) -> None:
    """Exit with a usage error naming ``option`` if a ratio above 1 has no adapter beside the model."""
    from workers.worker import available_ratios

    missing = [cr for cr in ratios if cr != 1 and cr not in available_ratios(model_dir)]
    if missing:
        parser.error(f"argument {option}: no DMS adapter for {missing[0]:g}x beside {model_dir}")
