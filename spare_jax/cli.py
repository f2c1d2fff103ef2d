"""Command-line plumbing shared by the experiment binaries.

`run(main)` is `absl.app.run` with one rule for bad input: a single line on
stderr and exit status 2, whether the flag fails to parse, a validator rejects
it, or `main` raises `app.UsageError`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from absl import app, flags

__all__ = ["USAGE_EXIT", "fail", "run"]

USAGE_EXIT = 2


def fail(message: str) -> None:
    """Print `message` as one line and exit with the usage status."""
    prog = os.path.basename(sys.argv[0]) if sys.argv else "spare_jax"
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.exit(USAGE_EXIT)


def _parse(argv: list[str]) -> list[str]:
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        fail(str(error))
        raise  # unreachable: fail() exits


def run(main: Callable[[list[str]], None]) -> None:
    """Run an absl `main`, turning bad input into one line and exit status 2."""

    def guarded(argv: list[str]) -> None:
        if len(argv) > 1:
            fail(f"unexpected arguments: {' '.join(argv[1:])}")
        try:
            main(argv)
        except app.UsageError as error:
            fail(str(error))
        except BrokenPipeError:  # output piped into `head` and the like
            sys.stderr.close()
            os._exit(0)

    app.run(guarded, flags_parser=_parse)
