"""The environment a launcher hands its workers: one name per setting, shared by both sides.

`spare_jax.launch` (and a SLURM step through `experiments/launch.py`) sets
these; `spare_jax.multihost.initialize_job` and `spare_jax.rejoin` read them.
"""

from __future__ import annotations

__all__ = ["ENV"]

ENV = {
    "coordinator": "SPARE_JAX_COORDINATOR",  # host:port of the coordination service
    "process_id": "SPARE_JAX_PROCESS_ID",
    "num_processes": "SPARE_JAX_NUM_PROCESSES",
    "devices": "SPARE_JAX_DEVICES_PER_PROCESS",  # CPU devices to simulate in each worker
    "heartbeat_s": "SPARE_JAX_HEARTBEAT_S",
    "collective_timeout_s": "SPARE_JAX_COLLECTIVE_TIMEOUT_S",
    "launch_dir": "SPARE_JAX_LAUNCH_DIR",  # the launcher's files (worker logs, kill times)
    "exit_with_parent": "SPARE_JAX_EXIT_WITH_PARENT",
    "relaunched_at": "SPARE_JAX_RELAUNCHED_AT",  # wall time the interrupted job ended
    "kills": "SPARE_JAX_KILLS",  # the fault injector's cues, PROCESS=STEP,... (testing)
    "replacement": "SPARE_JAX_REPLACEMENT",  # set: this process replaces a dead one (re-join)
    "started_at": "SPARE_JAX_STARTED_AT",  # wall time the launcher started this process
    "spare": "SPARE_JAX_SPARE",  # set: a warm spare, which waits on stdin for a dead worker's place
}
