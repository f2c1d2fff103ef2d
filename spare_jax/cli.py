"""Command-line plumbing shared by the experiment binaries.

`run(main)` is `absl.app.run` with one rule for bad input: a single line on
stderr and exit status 2, whether a flag fails to parse, a validator rejects
it, an ml_collections config file or `--config.x` override is bad, or `main`
raises `app.UsageError`. `--help` exits 0.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from absl import app, flags

__all__ = ["USAGE_EXIT", "fail", "int_list", "one_line", "run"]

USAGE_EXIT = 2


def fail(message: str) -> None:
    """Print `message` as one line and exit with the usage status."""
    prog = os.path.basename(sys.argv[0]) if sys.argv else "spare_jax"
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.exit(USAGE_EXIT)


def int_list(name: str, values: list[str], low: int = 1) -> list[int]:
    """Parse a `flags.DEFINE_list` of integers, each >= `low`, or raise `app.UsageError`."""
    try:
        out = [int(v) for v in values]
    except ValueError:
        raise app.UsageError(
            f"--{name} must be a comma-separated list of integers, got {','.join(values)!r}"
        ) from None
    if not out or min(out) < low:
        raise app.UsageError(f"--{name} values must be >= {low}, got {out}")
    return out


def one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else type(error).__name__
    return f"{lines[0]} {lines[-1]}"


_HELP = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def _parse(argv: list[str]) -> list[str]:
    """absl parsing where every bad flag, config file or override exits 2 on one line."""
    try:
        return flags.FLAGS(argv)
    except SystemExit:  # absl exits 1 after printing --help; asking for help is no error
        if any(a.split("=")[0] in _HELP for a in argv):
            sys.exit(0)
        raise
    except flags.Error as error:
        fail(one_line(error))
    except (AttributeError, KeyError) as error:  # --config.x=... naming no field
        fail(f"bad --config override: no config field {str(error).strip(chr(34))}")
    except Exception as error:  # a config file that fails to load
        fail(one_line(error))
    raise AssertionError("unreachable: fail() exits")


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
