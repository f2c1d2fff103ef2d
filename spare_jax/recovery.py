"""The survivors' side of a process loss: `ProcessLoss`, a part of `spare_jax.trainer.Trainer`.

A dead process surfaces as ``ProcessFailureError`` in the step's live-set
check on every survivor at once. `ProcessLoss._lose` marks the dead groups
failed, builds the survivors' mesh and step (the step split by failure
domain, `spare_jax.domains`: only the small cross-group program compiles for
the new live set), re-wraps the state from the survivors' own buffers, hands
on the writer role and puts the loss on record. The other processes of a
group that lost one of its processes leave the job (`_leave_group`).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental.multihost_utils import ProcessFailureError
from jax.sharding import Mesh

from spare_jax import (
    compile_cache,
    domains,
    errors,
    inputs,
    multihost,
    rejoin,
    runlog,
)
from spare_jax import train_step as step_lib

__all__ = ["RETRIES", "ProcessLoss"]

RETRIES = 3  # a step failed by collectives with every process alive is tried this often again


class ProcessLoss:
    """Process loss and recovery: mixed into `Trainer`, whose state it reads and sets."""

    @functools.cached_property
    def _scope(self) -> str:
        """Where this process keeps its step's programs (`rejoin.program_scope`): one per
        `Trainer`, kept across a re-join's backend reset, inherited by a replacement."""
        return rejoin.program_scope()

    def _split_for(self, full: Mesh) -> domains.Split:
        """This process's failure domain's programs, over ``full``'s devices (the job's mesh)."""
        rows = domains.domain_of(multihost.group_processes(full), jax.process_index())
        mesh = multihost.survivors_mesh(multihost.group_devices(full), rows, full)
        t = self._template
        return domains.Split(t.loss_fn, t.tx, mesh, rows, t.accum_dtype, self._scope)

    def compiled(self) -> dict[str, int]:
        """Programs this process compiled for its step, by kind (the split step's three)."""
        split = self.step.domain if self.step is not None else None
        counts = dict(split.compiles) if split is not None else {}
        return {**counts, "step": self.step.compiles if self.step is not None else 0}

    def _survivors(self, live: Sequence[int]) -> step_lib.SpareStep:
        ready = self._ready.get(tuple(live))
        if ready is not None:
            return ready
        mesh = multihost.survivors_mesh(self._by_group, live, self._template.mesh)
        return self.step.on_mesh(mesh, np.asarray(live))

    def _precompile_all(self, stacks: Any) -> None:
        """Compile the survivors' step for each single process failure (at start-up)."""
        self._at("compile")
        me = jax.process_index()
        shardings = jax.tree.map(lambda x: x.sharding, self.state)
        mine = set(multihost.groups_touching(self.owners, [me]).tolist())
        for proc in sorted(set(np.unique(self.owners[self.live_groups]).tolist()) - {me}):
            live = [g for g in self.live_groups if proc not in self.owners[g]]
            if mine.isdisjoint(live):
                continue  # that loss takes this process's group too: it would leave
            step = self._survivors(live)
            abstract = jax.tree.map(
                lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                self.state,
                multihost.on_mesh(step.mesh, shardings),
            )
            step.precompile(abstract, stacks)  # only the shapes after the group axis count
            self._ready[tuple(live)] = step
        if not self.step.compiled():  # the job's own step too: no compile inside the first step
            self.step.precompile(self.state, stacks)
        self._resync = True  # compiles end at different times: meet before the first collective

    def _lose(self, err: ProcessFailureError, started: float) -> None:
        """Survivors take over: the dead groups failed, the new step and state, the books."""
        detected = time.time()
        dead_procs = sorted({d.process_index for d in err.failed_devices})
        # The launcher first: it kills what is left of them and knows the others
        # are recovering (compiling the step below can take longer than a heartbeat).
        runlog.emit("dead", processes=dead_procs, step=self.t)
        self._at("compile")  # rebuilding and compiling the survivors' step: busy
        lost = set(multihost.groups_touching(self.owners, dead_procs).tolist())
        dead_groups = [g for g in self.live_groups if g in lost]
        live = [g for g in self.live_groups if g not in dead_groups]
        # The other processes of a dead group leave: they hold no live group.
        leaving = sorted({int(p) for p in np.unique(self.owners[dead_groups])} - set(dead_procs))
        if jax.process_index() in leaving:
            self._leave_group(dead_groups, f"process(es) {dead_procs} died during step {self.t}")
        # The leavers stay in the live-set check until the job declares them dead:
        # then every survivor sees them go in the same block (`_left`).
        if not dead_groups:  # processes that left with their group, already masked
            self._left(dead_procs)
            return
        step = self._survivors(live)
        shardings = multihost.on_mesh(step.mesh, jax.tree.map(lambda x: x.sharding, self.state))
        self.state = multihost.reshard(self.state, shardings)
        rebuilt = time.time()
        stacks, rows = inputs.load(step, self.batches, self.t)  # the same units: no new data
        self.input_rows += rows
        self._held = {self.t: (step, stacks, rows)}
        before, hits = self.compiled(), compile_cache.counts()["cache_hits"]
        compile_s = 0.0 if step.compiled() else step.precompile(self.state, stacks)
        hits = compile_cache.counts()["cache_hits"] - hits
        self.step, self._ready = step, {}
        recompiled = {k: n - before.get(k, 0) for k, n in self.compiled().items()}
        self.lost_processes = sorted({*self.lost_processes, *dead_procs, *leaving})
        self.members -= {*dead_procs, *leaving}
        self.failures.fail(dead_groups, self.t, repair=False)  # no devices to re-join with
        killed = [multihost.kill_time(p) for p in dead_procs]
        origin = max([started, *[k for k in killed if k is not None]])
        if self.writer_process in {*dead_procs, *leaving}:
            self.writer_process = int(self.owners[self.live_groups].min())
        if self.shared_saves:  # every live process takes part in a save: a new group of them
            self._regroup_saves()
        if self._is_writer():
            self.log.become_writer()
            self.ckpt.become_writer()
        self.log.event(
            "process_failure",
            process=dead_procs,
            groups=dead_groups,
            step=self.t,
            detect_s=round(detected - origin, 6),
            rebuild_s=round(rebuilt - detected, 6),
            compile_s=round(compile_s, 6),
            compiled={k: n for k, n in recompiled.items() if n},
            cache_hits=hits,
        )
        runlog.notice(
            f"process(es) {dead_procs} (groups {dead_groups}) declared dead during step "
            f"{self.t}; {len(live)} live group(s) go on"
        )
        self.recovering = {"origin": origin, "detected": detected, "resumed": time.time()}
        self._resync = True
        self._check_input = True

    def _collective_failed(self, error: str) -> None:
        """A collective failed with every process alive: retry the step, all together.

        Every process saw it (a peer stalled past the CPU collective timeout:
        each of its partners timed out, and it found their pairs closed when
        it woke). The first retry runs on the same collectives; from the
        second failure in a row on, every process rebuilds them first (a pair
        that timed out stays closed: `_rebuild_collectives`). When `RETRIES`
        retries have failed, the job relaunches.
        """
        if self._transient >= RETRIES:
            raise errors.Relaunch(
                f"step {self.t}: collectives failed {self._transient + 1} times with every "
                f"process alive, the last time on rebuilt ones ({error}): a worker lags its "
                "peers past the CPU collective timeout (collective_timeout_s; a slow worker "
                "needs a longer one)"
            )
        self._transient += 1
        if self._transient == 1:
            runlog.notice(
                f"step {self.t}: a collective failed with every process alive ({error}); "
                "retrying the step"
            )
        else:
            self._rebuild_collectives(f"a collective failed again: {error}")
        self._resync = True

    def _left(self, procs: list[int]) -> None:
        """Processes whose groups were already masked are gone: the books only, no new step."""
        self.members -= set(procs)
        self.lost_processes = sorted({*self.lost_processes, *procs})
        if self.writer_process in procs:
            self.writer_process = int(self.owners[self.live_groups].min())
        if self.shared_saves:
            self._regroup_saves()
        if self._is_writer():
            self.log.become_writer()
            self.ckpt.become_writer()
        runlog.notice(f"process(es) {procs} left the job with their group (already masked)")
        self._resync = True

    def _leave_group(self, groups: list[int], reason: str) -> None:
        """This process's group is lost (``reason``): leave the job, which goes on without it."""
        runlog.emit("group_lost", process=jax.process_index(), groups=groups, step=self.t)
        err = errors.GroupLost(
            f"{reason}; this process belongs to group(s) {groups}: the job goes on without them"
        )
        # At once, without JAX's shutdown (which would wait on the survivors): the job
        # declares this process dead one heartbeat later, on every survivor alike.
        sys.stderr.write(f"spare-jax: {err}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(err.exit_status)

    def _recovered(self) -> None:
        """After the first step since a recovery (or a relaunch): its time on record."""
        if self.recovering is None:
            return
        now = time.time()
        if self.recovering.get("relaunch"):
            self.log.event(
                "relaunch_step",
                step=self.t,
                since_exit_s=round(now - self.recovering["origin"], 6),
                first_step_s=round(now - self.recovering["resumed"], 6),
            )
            self.recovering = None
            return
        self.log.event(
            "recovered",
            step=self.t,
            live_groups=int(self.failures.alive.sum()),
            recovery_s=round(now - self.recovering["origin"], 6),
            since_detection_s=round(now - self.recovering["detected"], 6),
            first_step_s=round(now - self.recovering["resumed"], 6),
            rolled_back=False,
        )
        self.recovering = None
