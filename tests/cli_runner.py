"""Running ``thinkpool`` in the test's process, as a user would on the command line."""

from __future__ import annotations


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """``thinkpool ARGS``: its exit code (argparse's 2 included), standard output and standard error."""
    from orchestrator.cli import main

    try:
        code = main(list(args))
    except SystemExit as exit:
        code = exit.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err
