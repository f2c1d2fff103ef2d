"""Re-join: a replacement process joins the running job; `Admission`, part of `Trainer`.

The survivors see the newcomer in a step's live-set check, on every process
at once (`Admission._newcomers`); they hand it the state (`_admit`) and grow
the mesh back (`_regrow`); the newcomer takes the state and the job's books
(`_join`). The replacements of a group spanning several processes join
together, at the first check where all of them are live (`domains.whole`).
The transport is `spare_jax.rejoin`. The same backend reset with no
newcomer rebuilds collectives that a stalled peer left closed
(`_rebuild_collectives`).
"""

from __future__ import annotations

import ctypes
import gc
import time
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental.multihost_utils import ProcessFailureError, live_devices
from jax.sharding import Mesh, NamedSharding

from spare_jax import (
    broadcast,
    compile_cache,
    domains,
    errors,
    multihost,
    rejoin,
    runlog,
)

__all__ = ["Admission"]


def _host(x: Any) -> Any:
    """A host copy of an array a backend reset would invalidate (NumPy passes through)."""
    return multihost.host_copy(x) if isinstance(x, jax.Array) else x


COLLECT_STEPS = 8  # steps that each collect until a dropped backend is gone


def release_freed_memory() -> bool:
    """Hand the C allocator's free memory back to the system (glibc's ``malloc_trim``).

    A backend's threads and buffers are freed into the allocator's per-thread
    arenas, which glibc keeps: without this a survivor's resident memory rose
    by 5-9 MB at each re-join (`benchmarks/rejoins.py`). False where the C
    library has no such call (not glibc: nothing to do).
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the symbols already loaded: no search
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


class Admission:
    """Admitting a replacement, and joining as one: mixed into `Trainer`."""

    _dropped: weakref.ref | None = None  # a dropped backend's client, until it is collected
    _chased = 0  # steps that collected since it was dropped

    def _record(self) -> dict[str, Any]:
        """What a newcomer needs beyond the arrays: a checkpoint's record and the job's books."""
        return {
            **self._meta(),
            "rows": self.live_groups,
            "lost_processes": self.lost_processes,
            "writer": self.writer_process,
            "rollbacks": self.rollbacks,
        }

    def _admit(self, epoch: rejoin.Epoch) -> None:
        """Survivors: hand the state to the newcomers of ``epoch`` and grow the mesh back.

        Each survivor keeps its own shards on the host across the backend
        reset and places them again; the processes of one live group (the
        writer's) stream theirs to the newcomers' groups over the devices
        (`spare_jax.broadcast`). No process holds more than its own shards,
        so a group spanning processes is handed over alike. Step ``t`` runs
        next, with every group of the newcomers live.
        """
        start = time.time()
        self._wait_for_saves()
        leaves = jax.tree.leaves(self.state)
        shards = [multihost.own_shards(x) for x in leaves]
        held = [broadcast.Held(own, x.shape) for own, x in zip(shards, leaves, strict=True)]
        del leaves
        self.params0 = jax.tree.map(_host, self.params0)
        rows = self.live_groups
        if self._is_writer():
            rejoin.send(epoch, {**self._record(), "joiners": epoch.joiners})
        self.state, self.step, self._ready, self._held = None, None, {}, {}
        self._drop_backend()
        rejoin.reset_backend(epoch, fresh=False)
        self._regrow(epoch, rows)
        moved = self._move(rows, held)
        placed = [
            multihost.from_shards(own, like)
            for own, like in zip(shards, jax.tree.leaves(self._live_abstract()), strict=True)
        ]
        del shards, held
        self.state = jax.tree.unflatten(jax.tree.structure(self.global_abstract), placed)
        rejoin.done(epoch, moved.bytes)
        self._joined(epoch, start, moved)

    def _join(self) -> None:
        """A replacement: wait for the survivors to see us, take a live group's state, go on."""
        me = jax.process_index()
        ready = time.time()
        self._at("join")
        mates = np.unique(self.owners[domains.domain_of(self.owners, me)]).tolist()
        waiting: list[int] = []
        while True:  # the first block we can run in: the survivors stop there too
            try:
                with live_devices(self._all) as live:
                    procs = {d.process_index for d in live}
            except ProcessFailureError:
                continue  # a loss the survivors saw in the same block: not ours to handle
            if me in domains.whole(self.owners, procs):
                break
            missing = [p for p in mates if p not in procs]  # their replacements are not live
            if missing != waiting:
                runlog.notice(f"waiting for process(es) {missing} of our group to join with")
                waiting = missing
        epoch = self._epoch([me])
        start = time.time()
        rejoin.announce(epoch, ready, start)
        rejoin.reset_backend(epoch, fresh=True)
        meta = rejoin.receive(epoch)
        epoch = rejoin.Epoch(epoch.live, [int(p) for p in meta["joiners"]])
        self.t, self.attempt = int(meta["step"]), int(meta["attempt"])
        self.failures.load_state_dict(meta["liveness"])
        self.interval.load(meta["interval"])
        self.lost_processes = [int(p) for p in meta["lost_processes"]]
        self.writer_process, self.rollbacks = int(meta["writer"]), int(meta["rollbacks"])
        self.members = set(epoch.survivors)
        rows = [int(g) for g in meta["rows"]]
        self._regrow(epoch, rows)
        moved = self._move(rows, None)
        self.state = jax.tree.unflatten(jax.tree.structure(self.global_abstract), moved.leaves)
        rejoin.done(epoch, moved.bytes)
        self._joined(epoch, start, moved)
        runlog.notice(f"joined the running job at step {self.t} with the state of a live group")

    def _rebuild_collectives(self, why: str) -> None:
        """Every live process drops its CPU collectives and builds them anew, state kept.

        A Gloo pair that timed out (a peer stalled past the collective timeout)
        stays closed in the communicator every process caches, so retrying the
        step on it fails the same way. The way out is the re-join's, with no
        newcomer: each process keeps its own shards on the host (never more
        than it holds), resets its backend with the others (`rejoin.reset_backend`)
        and places them again; the step's programs come back from the
        persistent compilation cache.
        """
        start = time.time()
        self._at("compile")  # busy: rebuilding, then compiling (from the cache)
        self._wait_for_saves()
        shards = [multihost.own_shards(x) for x in jax.tree.leaves(self.state)]
        kept = sum(a.nbytes for own in shards for a in own.values())
        self.params0 = jax.tree.map(_host, self.params0)
        live = self.live_groups
        name = f"rebuild/{self.rollbacks}/{self.t}/{self._transient}"  # the same on every process
        epoch = self._epoch([], name=name)
        self.state, self.step, self._ready, self._held = None, None, {}, {}
        self._drop_backend()
        try:
            rejoin.reset_backend(epoch, fresh=False)
        except jax.errors.JaxRuntimeError as err:  # a process went on without us: start afresh
            raise errors.Relaunch(
                f"step {self.t}: the live processes did not all rebuild their collectives "
                f"({str(err).splitlines()[0][:160]}); a fresh job resumes"
            ) from None
        self._regrow(epoch, live)
        placed = [
            multihost.from_shards(own, like)
            for own, like in zip(shards, jax.tree.leaves(self._live_abstract()), strict=True)
        ]
        del shards
        self.state = jax.tree.unflatten(jax.tree.structure(self.global_abstract), placed)
        rebuilt = time.time()
        compile_s, hits = self._compile_on_new_backend()
        self.log.event(
            "collectives_rebuilt",
            step=self.t,
            reason=why,
            rebuild_s=round(rebuilt - start, 6),
            compile_s=round(compile_s, 6),
            cache_hits=hits,
            host_bytes=kept,
        )
        runlog.notice(
            f"step {self.t}: every live process rebuilt its collectives ({why}); retrying the step"
        )

    def _compile_on_new_backend(self) -> tuple[float, int]:
        """Step ``t``'s input and the step's programs on a new backend: (seconds, cache hits).

        Every process compiles (or loads from the persistent cache) before
        the next step's block, at its own pace; the input is checked again.
        """
        self._check_input = True
        stacks, _ = self._input(self.t)
        self._at("compile")
        hits = compile_cache.counts()["cache_hits"]
        compile_s = self.step.precompile(self.state, stacks)
        return compile_s, compile_cache.counts()["cache_hits"] - hits

    def _live_abstract(self) -> Any:
        """The state's shapes, dtypes and shardings on the step's (live) mesh."""
        on_step = lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(self.step.mesh, a.sharding.spec)
        )
        return jax.tree.map(on_step, self.global_abstract)

    def _move(self, rows: list[int], host: list[np.ndarray] | None) -> broadcast.Moved:
        """The writer's group sends the replica to the newcomers' groups, device to device.

        Only the processes of those groups take part; a newcomer gets its
        leaves on the live mesh.
        """
        mine = set(multihost.groups_touching(self.owners, [self.writer_process]).tolist())
        source = min((g for g in rows if g in mine), default=min(rows))
        groups = sorted({source, *self._rejoined})
        mesh = multihost.survivors_mesh(self._by_group, groups, self._template.mesh)
        abstract = jax.tree.leaves(self._live_abstract())
        return broadcast.move(mesh, groups.index(source), abstract, host, scope=self._scope)

    def _regrow(self, epoch: rejoin.Epoch, rows: list[int]) -> None:
        """The mesh over every live group (the newcomers' again), on this backend's devices."""
        by_id = {d.id: d for d in jax.devices()}
        full = Mesh(np.vectorize(by_id.__getitem__, otypes=[object])(self._ids), self._axes)
        self._all = list(full.devices.flat)
        self._by_group = multihost.group_devices(full)
        back = [int(g) for g in multihost.groups_touching(self.owners, epoch.joiners)]
        live = sorted({*rows, *back})
        groups = np.arange(len(self.owners))
        self.global_abstract = self._template.on_mesh(full, groups).abstract_state(self.params0)
        self.step = self._template.on_mesh(
            multihost.survivors_mesh(self._by_group, live, self._template.mesh),
            np.asarray(live),
            domain=self._split_for(full),  # a new backend: its programs are new too
        )
        self.members |= set(epoch.joiners)
        self.lost_processes = [p for p in self.lost_processes if p not in epoch.joiners]
        self.failures.alive[back] = True
        if self.shared_saves and epoch.joiners:  # the newcomers write their part too
            self._regroup_saves()
        self._rejoined = back

    def _joined(self, epoch: rejoin.Epoch, start: float, moved: broadcast.Moved) -> None:
        """Every process has its state: compile the step for the grown mesh, note the re-join."""
        placed = time.time()
        compile_s, hits = self._compile_on_new_backend()
        self.joining = {
            "process": epoch.joiners,
            "groups": self._rejoined,
            "step": self.t,
            "started": rejoin.start_times(epoch) if self._is_writer() else {},
            "transfer_s": round(placed - start, 6),
            "compile_s": round(compile_s, 6),
            "cache_hits": hits,
            "bytes": moved.bytes,
            "move_s": round(moved.transfer.seconds, 6) if moved.transfer else None,
            "move_mb_s": round(moved.transfer.rate / 1e6, 3) if moved.transfer else None,
        }
        if self.replacement:
            runlog.emit("joined", step=self.t)

    def _drop_backend(self) -> None:
        """Before a reset: follow the client being dropped, unless the user's step holds it."""
        client = jax.local_devices()[0].client
        held = self._template.mesh.devices.flat[0].client  # the first: the user's step has it
        self._dropped = None if client is held else weakref.ref(client)
        self._chased = 0

    def _note_rejoin(self) -> None:
        """After each step: a re-join's first on record, and a dropped backend collected.

        After a re-join or a rebuild nothing of ours refers to the old backend
        (`rejoin.reset_backend` emptied the caches that did), but its client
        and devices refer to each other: only a cycle collection frees them,
        with their threads and, on CPU, their connections to every peer, and
        Python's own rarely runs one. A collection after the first step on
        the new backend sometimes leaves it (something still held it then;
        the next step's frees it), so each step collects until the client is
        gone, `COLLECT_STEPS` steps at most (`benchmarks/rejoins.py` counts a
        survivor's threads and sockets over many re-joins).
        """
        self._record_rejoin()
        if self._dropped is None:
            return
        gc.collect()
        self._chased += 1
        if self._dropped() is None:
            self._dropped = None
            release_freed_memory()
        elif self._chased >= COLLECT_STEPS:
            self._dropped = None
            runlog.notice(
                f"step {self.t}: a dropped backend is still referenced after {COLLECT_STEPS} "
                "steps; its threads and connections stay until it is collected"
            )

    def _record_rejoin(self) -> None:
        """After the first step with the newcomers: the re-join on record (the writer's)."""
        if self.joining is None:
            return
        joining, self.joining = self.joining, None
        if not self._is_writer():
            return
        started = joining.pop("started")
        now = time.time()
        if started:
            first = min(started.values(), key=lambda t: t["started"])
            joining["join_s"] = round(now - first["started"], 6)
            joining["start_s"] = round(max(t["ready"] - t["started"] for t in started.values()), 6)
            joining["admit_s"] = round(max(t["admitted"] - t["ready"] for t in started.values()), 6)
        else:
            joining["join_s"] = None
        self.log.event("rejoin", **joining)
        runlog.notice(
            f"process(es) {joining['process']} re-joined at step {joining['step']} "
            f"(groups {joining['groups']} live again, {joining['bytes']} bytes from a live group)"
        )

    def _newcomers(self, live: Sequence[jax.Device]) -> list[int]:
        """Processes this block's live set shows that are not on our mesh (a re-join).

        A replacement for one process of a group spanning several counts
        only once its group-mates' replacements are live too
        (`domains.whole`); until then it waits in every block.
        """
        procs = {d.process_index for d in live}
        if procs <= self.members:  # every step but a re-join's
            return []
        return sorted(set(domains.whole(self.owners, procs)) - self.members)

    def _epoch(self, joiners: list[int], name: str = "") -> rejoin.Epoch:
        """The change, named by the live set every process holds after the block, less any
        newcomer still waiting for its group-mates (the same on every process)."""
        live = rejoin.live_incarnations()
        ready = set(domains.whole(self.owners, live))
        return rejoin.Epoch({p: i for p, i in live.items() if p in ready}, joiners, name=name)
