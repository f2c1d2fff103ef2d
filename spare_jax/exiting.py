"""How a worker of a multi-process job ends: one line for a `FitError`, never a hung exit.

A process whose peers died can wait a long time in JAX's own shutdown (it
leaves the coordination service). `leave` bounds that wait; `install_handlers`
(called by `spare_jax.initialize`) makes an uncaught `errors.FitError` exit
with its status on one line, and bounds the exit of a process that joined a
job.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

import jax

from spare_jax import errors, runlog

__all__ = ["LEAVE_S", "install_handlers", "leave"]

LEAVE_S = 15.0  # the longest a process waits in JAX's shutdown for peers that died


def leave(timeout_s: float = LEAVE_S) -> bool:
    """Leave the job without waiting on dead peers for more than ``timeout_s``; True if left."""
    done = threading.Thread(target=jax.distributed.shutdown, daemon=True)
    done.start()
    done.join(timeout_s)
    return not done.is_alive()


def install_handlers(*, joined: bool) -> None:
    """An uncaught `errors.FitError` exits with its status on one line; the exit never hangs.

    A process whose peers died can wait a long time in JAX's own shutdown:
    at exit it leaves the job with a bound, then ends.
    """
    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, errors.FitError):
            line = f"{os.path.basename(sys.argv[0] or 'python')}: {value}"
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            # The line again in the event: a runtime's stray output (Gloo writes its
            # lines in pieces) can land after it in the log, never inside an event.
            runlog.emit("exit", status=value.exit_status, line=line)
            sys.stdout.flush()
            if joined:
                leave()
            os._exit(value.exit_status)
        previous(kind, value, tb)

    sys.excepthook = hook
    if not joined:
        return
    # Python 3.12 refuses new threads once the interpreter shuts down, when atexit
    # handlers run: the thread that bounds the exit waits from the start instead.
    exiting, left = threading.Event(), threading.Event()

    def bound() -> None:
        exiting.wait()
        if not left.wait(LEAVE_S):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    threading.Thread(target=bound, daemon=True, name="spare-jax-exit").start()

    def bounded_exit() -> None:
        exiting.set()
        jax.distributed.shutdown()
        left.set()

    atexit.register(bounded_exit)  # runs before JAX's own (registered earlier)
