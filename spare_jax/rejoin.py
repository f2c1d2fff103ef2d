"""Hot re-join: a replacement for a dead process joins the running job (CPU and GPU).

What JAX (0.10 to 0.12) offers and what it does not (docs/multihost.md, "Re-join"):

* A replacement that connects with the dead process's id gets a new
  incarnation from the coordination service, and the survivors'
  ``live_devices`` yields its devices again, at the same block on every
  process (its membership check is a barrier over the live processes, the
  newcomer included). Nothing raises: a re-join is not a failure.
* On CPU the collectives (Gloo) rendezvous through keys of the job's
  key-value store named by the participating device ids only, and every
  process caches its communicators by those ids: a clique that ran before
  the death can never include the replacement (``ALREADY_EXISTS`` on its
  side, closed pairs or a hang on the survivors'). Route taken here: every
  survivor resets its backend (``jax.extend.backend.clear_backends``), the
  stale rendezvous keys are deleted between two barriers, and everyone
  builds its devices afresh. The cost is a recompilation on every process
  (a persistent compilation cache makes it a cache hit) and a host round
  trip of the state. On GPU the clique keys carry the incarnations already.
* Only the job's books (step, liveness, interval: a few kB of JSON) go
  through that key-value store. The state moves over the devices, from a
  live group's replica to the newcomers' groups (`spare_jax.broadcast`):
  a peer's copy, so nothing is lost and no step is repeated.

These rely on names inside XLA (``cpu:gloo/``, ``cpu:global_topology/cpu``),
on ``live_devices``'s cache of the last live set and on the job's client, all
reached through `spare_jax.jax_internals` (checked at import);
`tests/test_rejoin.py` holds the key names on every tested JAX.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import jax

from spare_jax import fingerprint, jax_internals
from spare_jax.job_env import ENV

__all__ = [
    "Epoch",
    "announce",
    "done",
    "is_replacement",
    "live_incarnations",
    "prepare_backend",
    "program_scope",
    "receive",
    "reset_backend",
    "send",
    "start_times",
    "started_at",
]

_BARRIER_MS = 120_000
_SLOWEST_BYTES_PER_S = 20e6  # benchmarks/state.py moved 141-158 MB/s on 2 CPU cores


def is_replacement() -> bool:
    """Whether the launcher started this process to replace a dead one of a running job."""
    return bool(os.environ.get(ENV["replacement"]))


def started_at() -> float:
    """When the launcher started this process (wall time; now when it did not say)."""
    try:
        return float(os.environ.get(ENV["started_at"], ""))
    except ValueError:
        return time.time()


def _client() -> Any:
    client = jax_internals.client()
    if client is None:
        raise RuntimeError("hot re-join needs a multi-process job (spare_jax.initialize)")
    return client


def prepare_backend(process_id: int) -> None:
    """Before a replacement's backend starts: let process 0 publish the job's topology again.

    The other processes' backends read the topology the first process 0
    published; a new process 0 writes it, which the store refuses while the
    old key is there.
    """
    if process_id == 0:
        _client().key_value_delete(jax_internals.TOPOLOGY_KEY)


def program_scope() -> str:
    """The scope this process keeps its compiled programs under (`compile_cache.compile_scoped`).

    One per job and process slot, in the coordination service's store: a
    replacement takes the scope of the process it replaces, so it loads the
    programs that process compiled, untraced; every other process starts a
    new one. A relaunch or a rerun has a new service, so new scopes: code
    changed in between is traced again.
    """
    client = _client()
    key = f"spare_jax/programs/{jax.process_index()}"
    if is_replacement():
        try:
            return client.key_value_try_get(key)
        except jax.errors.JaxRuntimeError:  # the process it replaces kept none
            pass
    scope = uuid.uuid4().hex
    client.key_value_set(key, scope, allow_overwrite=True)
    return scope


class Epoch:
    """One change of membership, as every live process saw it at the same block.

    ``live`` is the process -> incarnation map `live_devices` holds after the
    block in which the newcomers appeared: the same on every process, so its
    digest names the barriers and the key-value entries of this re-join.
    ``name`` tells apart two changes over one live set (rebuilt collectives,
    `Admission._rebuild_collectives`, which have no newcomers).
    """

    def __init__(self, live: dict[int, str], joiners: Sequence[int], name: str = ""):
        self.live = dict(sorted(live.items()))
        self.joiners = sorted({int(p) for p in joiners})
        text = json.dumps([sorted(self.live.items()), name]).encode()
        self.tag = hashlib.sha1(text).hexdigest()[:16]

    @property
    def processes(self) -> list[int]:
        return sorted(self.live)

    @property
    def survivors(self) -> list[int]:
        return [p for p in self.processes if p not in self.joiners]

    def key(self, name: str) -> str:
        return f"spare_jax/rejoin/{self.tag}/{name}"


def live_incarnations() -> dict[int, str]:
    """process -> incarnation of the live set `live_devices` holds now."""
    cached = jax_internals.live_devices_cache()
    return {int(d.process_index): str(i) for d, i in cached.items()}


def reset_backend(epoch: Epoch, *, fresh: bool) -> None:
    """Give every live process new CPU collectives that know the newcomers.

    Survivors (``fresh=False``) drop their backend; the newcomers' has run
    no collective yet. Between two barriers over every live process the
    stale rendezvous keys go (and the topology key, which a restarted
    process 0 publishes again). Every ``jax.Array`` and compiled function of
    a survivor is invalid afterwards: the caller holds host copies, and drops
    every program and sharding it kept (one kept keeps the old client alive,
    with its threads and its connections to every peer; `fingerprint`'s
    programs and Orbax's cached shardings go here).
    """
    client = _client()
    me = jax.process_index()
    if not fresh:
        fingerprint.forget()
        jax_internals.forget_orbax_shardings()
        jax_internals.clear_backends()
    procs = epoch.processes
    client.wait_at_barrier(epoch.key("a"), _BARRIER_MS, process_ids=procs)
    if me == min(procs):
        client.key_value_delete(jax_internals.GLOO_KEYS)
    if me == 0 and not fresh:
        client.key_value_delete(jax_internals.TOPOLOGY_KEY)
    client.wait_at_barrier(epoch.key("b"), _BARRIER_MS, process_ids=procs)
    jax_internals.forget_live_devices()  # its cache holds the old backend's devices
    jax.devices()  # the new backend, on every process at once


def send(epoch: Epoch, record: dict[str, Any]) -> None:
    """Publish the job's books for the newcomers of ``epoch`` (the writer, before the reset)."""
    _client().key_value_set(epoch.key("record"), json.dumps(record))


def receive(epoch: Epoch, timeout_s: float = 300.0) -> dict[str, Any]:
    """The books the writer published for ``epoch`` (`done` lets them go)."""
    return json.loads(_client().blocking_key_value_get(epoch.key("record"), int(timeout_s * 1000)))


def announce(epoch: Epoch, ready_at: float, admitted_at: float) -> None:
    """A newcomer says when the launcher started it, when it was ready to join (its
    imports, the connect and the script's setup done) and when the survivors took it in
    (for the re-join's ``join_s``, ``start_s`` and ``admit_s``)."""
    times = {"started": started_at(), "ready": ready_at, "admitted": admitted_at}
    _client().key_value_set(epoch.key(f"started/{jax.process_index()}"), json.dumps(times))


def start_times(epoch: Epoch) -> dict[int, dict[str, float]]:
    """Each newcomer's ``started``, ``ready`` and ``admitted`` wall times (all have announced
    once the state is in place)."""
    client = _client()
    return {
        p: json.loads(client.blocking_key_value_get(epoch.key(f"started/{p}"), _BARRIER_MS))
        for p in epoch.joiners
    }


def done(epoch: Epoch, nbytes: int) -> None:
    """After every live process has its state: the books published for ``epoch`` go.

    Processes outside the transfer wait here while it runs, so the wait
    grows with the bytes moved (at a seventh of the slowest rate measured).
    """
    client = _client()
    wait_ms = _BARRIER_MS + int(nbytes / _SLOWEST_BYTES_PER_S * 1000)
    client.wait_at_barrier(epoch.key("c"), wait_ms, process_ids=epoch.processes)
    if jax.process_index() == min(epoch.survivors):
        client.key_value_delete(epoch.key("record"))
