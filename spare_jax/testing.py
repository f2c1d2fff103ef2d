"""Fault injection for tests and demos, kept out of the step path.

``python -m spare_jax.launch --kill=STEP:PROCESS`` sets ``SPARE_JAX_KILLS``
(``PROCESS=STEP,...``) in the workers. `fault_hook_from_env` turns this
worker's entry into the hook the trainer calls
at the start of each step, inside the step's membership scope: at that step
the worker notes the time in the launcher's directory, tells the launcher (a
``kill_point`` event) and SIGKILLs itself, in the middle of the step, the way
a node dies (under SLURM too, where the launcher cannot reach a task's pid).
Faults that need no cooperation (signals to pids, damage on disk) are sent
from outside, by the tests themselves.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import jax

from spare_jax import runlog
from spare_jax.multihost import ENV

__all__ = ["fault_hook_from_env"]


def fault_hook_from_env() -> Callable[[int], None] | None:
    """The hook that kills this worker at its kill step, or None when none is asked for."""
    value = os.environ.get(ENV["kills"])
    if not value:
        return None
    cues = dict(item.split("=") for item in value.split(",") if item)
    me = str(jax.process_index())
    if me not in cues:
        return None
    at = int(cues[me])

    def hook(step: int) -> None:
        if step != at:
            return
        launch_dir = os.environ.get(ENV["launch_dir"])
        if launch_dir:  # the survivors measure detection from this time
            path = os.path.join(launch_dir, f"killed-{jax.process_index()}")
            with open(path, "w", encoding="utf-8") as f:
                f.write(f"{time.time()}\n")
        runlog.emit("kill_point", step=step)
        os.kill(os.getpid(), signal.SIGKILL)

    return hook
