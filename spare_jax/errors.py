"""What can end a fault-tolerant run, and the exit status each one gives a process.

Every error `spare_jax.fit` raises is a `FitError` with an ``exit_status``: a
launcher (``python -m spare_jax.launch``, SLURM) reads the status, not the
message. Under `spare_jax.initialize`, an uncaught `FitError` prints its
message on one line and exits with its status (no traceback).

    0   the run completed
    2   bad input, or checkpoints exist and none of them restores
    3   too many rollbacks (failures leave no time between interruptions)
    4   the loss became non-finite (the state before that step is saved)
    5   a checkpoint could not be written (a full disk, a failing file system);
        the newest intact checkpoint is kept
    6   the batch differs across processes: the holders of a micro-batch got
        different rows (checked before the step, so nothing wrong is saved)
    75  an interruption after a real process loss: the launcher starts a
        fresh job, which rolls back to the latest checkpoint
    77  this process's group lost another of its processes (a group spanning
        processes): it leaves, and the job goes on without the group
    143 preempted (SIGTERM): the state at the step reached is saved; rerun the
        same command to resume from it
"""

from __future__ import annotations

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_BATCH_MISMATCH",
    "EXIT_GROUP_LOST",
    "EXIT_NON_FINITE",
    "EXIT_PREEMPTED",
    "EXIT_RELAUNCH",
    "EXIT_ROLLBACKS",
    "EXIT_STORAGE",
    "BatchMismatch",
    "FitError",
    "GroupLost",
    "NonFiniteLoss",
    "Preempted",
    "Relaunch",
    "StorageError",
    "TooManyRollbacks",
]

EXIT_BAD_INPUT = 2
EXIT_ROLLBACKS = 3
EXIT_NON_FINITE = 4
EXIT_STORAGE = 5
EXIT_BATCH_MISMATCH = 6
EXIT_RELAUNCH = 75  # EX_TEMPFAIL: try again (a fresh job rolls back)
EXIT_PREEMPTED = 128 + 15  # what a scheduler expects of a job it sent SIGTERM
EXIT_GROUP_LOST = 77  # not a verdict on the run: the job masks the group and goes on


class FitError(RuntimeError):
    """A run that cannot go on; ``exit_status`` is what its process should exit with."""

    exit_status = 1


class NonFiniteLoss(FitError):
    """The loss or gradient became NaN or infinite (the state was kept as before that step)."""

    exit_status = EXIT_NON_FINITE


class TooManyRollbacks(FitError):
    """The run rolled back more often than ``max_rollbacks`` allows."""

    exit_status = EXIT_ROLLBACKS


class Preempted(FitError):
    """A preemption notice (SIGTERM) arrived: the state was saved at the step reached."""

    exit_status = EXIT_PREEMPTED


class Relaunch(FitError):
    """An interruption after a real process loss: only a fresh job can roll back."""

    exit_status = EXIT_RELAUNCH


class GroupLost(FitError):
    """Another process of this process's group died: the group is masked, this process leaves."""

    exit_status = EXIT_GROUP_LOST


class BatchMismatch(FitError):
    """The holders of a micro-batch hold different rows: ``batches(t)`` differs across processes."""

    exit_status = EXIT_BATCH_MISMATCH


class StorageError(FitError):
    """The run's files could not be written (a full disk, a failing file system).

    Attributes:
        disk_full: whether the file system holding them ran out of space.
    """

    exit_status = EXIT_STORAGE

    def __init__(self, message: str, *, disk_full: bool):
        super().__init__(message)
        self.disk_full = disk_full
