"""Command-line plumbing shared by the experiment and benchmark binaries.

`run(main)` is `absl.app.run` with one rule for bad input: a single line on
stderr and exit status 2, whether a flag fails to parse, a validator rejects
it, an ml_collections config file or `--config.x` override is bad, or `main`
raises `app.UsageError`. `--help` and `-h` print the help and exit 0; Ctrl-C
prints one line and exits 130, keeping whatever was written so far.

Outputs: `output_dir` creates and checks an output directory before any work
is done, and `replace_file` writes each file through a temporary file in the
same directory, so a file is either complete or absent, and a symlink in its
place is replaced, never followed out of the directory.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import IO, Any

from absl import app, flags
from ml_collections import config_flags

__all__ = [
    "INTERRUPTED_EXIT",
    "USAGE_EXIT",
    "config_file_flag",
    "config_value",
    "fail",
    "int_list",
    "one_line",
    "output_dir",
    "output_file",
    "replace_file",
    "run",
]

USAGE_EXIT = 2
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports a Ctrl-C


def _prog() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv else "spare_jax"


def fail(message: str) -> None:
    """Print `message` as one line and exit with the usage status."""
    sys.stderr.write(f"{_prog()}: error: {message}\n")
    sys.exit(USAGE_EXIT)


def int_list(
    name: str, values: list[str], low: int = 1, high: int | None = None, why: str = ""
) -> list[int]:
    """Parse a `flags.DEFINE_list` of integers in [low, high], or raise `app.UsageError`.

    Args:
        name: the flag's name, for the message.
        values: the flag's value (strings).
        low: smallest value allowed.
        high: largest value allowed (None: no limit).
        why: the reason for `high`, appended to its message.
    """
    try:
        out = [int(v) for v in values]
    except ValueError:
        raise app.UsageError(
            f"--{name} must be a comma-separated list of integers, got {','.join(values)!r}"
        ) from None
    if not out:
        raise app.UsageError(f"--{name} must list at least one value")
    if min(out) < low:
        raise app.UsageError(f"--{name} values must be >= {low}, got {out}")
    if high is not None and max(out) > high:
        reason = f" ({why})" if why else ""
        raise app.UsageError(f"--{name} values must be <= {high:,}{reason}, got {out}")
    return out


def one_line(error: BaseException) -> str:
    """The first and last non-empty lines of an error's message, on one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else type(error).__name__
    return f"{lines[0]} {lines[-1]}"


def config_file_flag(name: str, default: str, help_string: str) -> Any:
    """`config_flags.DEFINE_config_file` (locked) whose bad `--name.x=` override exits 2.

    ml_collections resolves `--name.x=...` overrides of the default file while
    defining the flag, i.e. at import, before `run` can catch anything.
    """
    try:
        return config_flags.DEFINE_config_file(name, default, help_string, lock_config=True)
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        fail(f"bad --{name} override: no config field {str(error).strip(chr(34))}")


def config_value(holder: Any) -> Any:
    """The config a `config_file_flag` holds, or `app.UsageError` if its file did not load.

    ml_collections defers a missing file's error: the flag's value is then a
    placeholder whose first attribute access raises OSError.
    """
    try:
        config = holder.value
        getattr(config, "to_dict", None)
    except OSError as error:
        raise app.UsageError(f"cannot load --{holder.name}: {one_line(error)}") from None
    return config


def output_dir(flag: str, path: str) -> str:
    """Create the output directory `path` (flag `--flag`) if needed and check it is writable.

    Call it before any work, so a bad location costs nothing.

    Returns:
        `path`.

    Raises:
        app.UsageError: the path is empty, names something that is not a
            directory, or cannot be created or written.
    """
    if not path or not path.strip():
        raise app.UsageError(f"--{flag} must not be empty")
    if os.path.exists(path) and not os.path.isdir(path):
        raise app.UsageError(f"--{flag}={path} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
        os.close(fd)
        os.remove(probe)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise app.UsageError(f"cannot write to --{flag}={path}: {reason}") from None
    return path


def output_file(flag: str, path: str) -> str:
    """Check before any work that the output file `path` (flag `--flag`) can be written.

    An empty path means no file and is returned as is.

    Raises:
        app.UsageError: the path names a directory, its directory does not
            exist, or either is not writable.
    """
    if not path:
        return path
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise app.UsageError(f"--{flag}={path} is a directory; give a file name")
    if not os.path.isdir(directory):
        raise app.UsageError(f"cannot write --{flag}={path}: no directory {directory}")
    if not os.access(directory, os.W_OK | os.X_OK) or (
        os.path.exists(path) and not os.access(path, os.W_OK)
    ):
        raise app.UsageError(f"cannot write --{flag}={path}: permission denied")
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def replace_file(path: str, mode: str = "w", **kwargs: Any) -> Iterator[IO[Any]]:
    """Open a temporary file next to `path`; on success it atomically replaces `path`.

    `os.replace` replaces a symlink at `path` itself rather than the file it
    points to, so nothing outside the directory is ever written. On error (or
    Ctrl-C) the temporary file is removed and `path` is left as it was.

    Args:
        path: the file to write.
        mode: "w" (text) or "wb" (binary).
        **kwargs: passed to `open` (e.g. `newline=""` for csv).
    """
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.")
    try:
        with open(fd, mode, **kwargs) as f:
            yield f
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


_HELP = ("--help", "-?", "--helpshort", "--helpfull")


def _parse(argv: list[str]) -> list[str]:
    """absl parsing where every bad flag, config file or override exits 2 on one line."""
    cut = argv.index("--") if "--" in argv else len(argv)  # after "--": another program's
    argv = [argv[0], *("--help" if a == "-h" else a for a in argv[1:cut]), *argv[cut:]]
    try:
        return flags.FLAGS(argv)
    except SystemExit:  # absl exits 1 after printing --help; asking for help is no error
        if any(a.split("=")[0] in _HELP for a in argv[1:]):
            sys.exit(0)
        raise
    except flags.Error as error:
        fail(one_line(error))
    except (AttributeError, KeyError) as error:  # --config.x=... naming no field
        fail(f"bad --config override: no config field {str(error).strip(chr(34))}")
    # A config file is Python run while parsing: whatever it raises is bad input.
    except Exception as error:  # noqa: BLE001
        fail(one_line(error))
    raise AssertionError("unreachable: fail() exits")


def run(main: Callable[[list[str]], None], *, allow_args: bool = False) -> None:
    """Run an absl `main`: bad input exits 2 on one line; Ctrl-C exits 130 on one line.

    ``allow_args``: positional arguments (those after ``--``) reach ``main``.
    """

    def guarded(argv: list[str]) -> None:
        if len(argv) > 1 and not allow_args:
            fail(f"unexpected arguments: {' '.join(argv[1:])}")
        try:
            main(argv)
        except app.UsageError as error:
            fail(str(error))
        except BrokenPipeError:  # output piped into `head` and the like
            sys.stderr.close()
            os._exit(0)

    try:
        app.run(guarded, flags_parser=_parse)
    except KeyboardInterrupt:
        sys.stdout.flush()
        sys.stderr.write(f"{_prog()}: interrupted\n")
        sys.exit(INTERRUPTED_EXIT)
